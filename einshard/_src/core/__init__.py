"""The core every layer shares: a laid-out tensor (:class:`Layout`, :class:`MeshAxis`) and the one mesh resolver.

Both know only names and sizes (no devices), so plans for 2,048-device meshes resolve on a laptop.
"""

from .. import _checks
from . import argument_rules as _argument_rules  # noqa: F401 - registers the core's rules
from .layout import Layout, MeshAxis
from .mesh import resolve_mesh

# The public name checks its arguments (einshard's own calls pass right values by construction).
resolve_mesh = _checks.checked(
    resolve_mesh,
    "einshard.core.resolve_mesh",
    operands=lambda v, where, name, args: (
        v if isinstance(v, (tuple, list)) else _checks.fail(where, name, "a tuple of the call's arrays", v)
    ),
)

__all__ = ["Layout", "MeshAxis", "resolve_mesh"]
