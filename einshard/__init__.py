"""einshard: one readable expression says how an array is laid out on a device mesh.

    >>> import einshard, numpy as np
    >>> w = einshard.einshard(np.ones((128, 256)), 'x y -> x y*')   # y split over all devices

The public API is what ``__all__`` lists; the layers behind it (parsing,
core, placement, analysis, lowering) are importable on their own.
"""

from ._caches import clear_caches
from .analysis import Profile, analyze, explain
from .analysis.einsum.plan import EinsumPlan
from .analysis.explicit import check_explicit
from .audit import audit
from .core.layout import Layout
from .core.logical import axis_rules
from .drawing import show
from .errors import EinshardError
from .lowering import data_parallel, fsdp, fsdp_layouts, pipeline, pipeline_info
from .lowering.einsum import einsum, lower
from .placement import describe, einshard, layout, sharding, spec
from .planner import LayoutPlan, plan

__version__ = "0.4.0"

__all__ = [
    # placement: an expression says where an array lives
    "einshard",
    "sharding",
    "spec",
    "layout",
    "describe",
    "show",
    "Layout",
    "axis_rules",
    # analysis: what an einsum or a whole program costs, and which layouts to choose
    "analyze",
    "EinsumPlan",
    "explain",
    "check_explicit",
    "plan",
    "LayoutPlan",
    "audit",
    "Profile",
    # lowering: the explicit shard_map programs
    "einsum",
    "lower",
    "data_parallel",
    "fsdp",
    "fsdp_layouts",
    "pipeline",
    "pipeline_info",
    # the rest
    "EinshardError",
    "clear_caches",
]

# Names that left the top level in 0.4 (docs/architecture.md, "Renamed in 0.4"): still reachable, with a warning that
# names their home.  name -> (module, attribute).
_MOVED: dict[str, tuple[str, str]] = {
    "Plan": ("einshard.analysis", "EinsumPlan"),
    "PlanResult": ("einshard.planner", "LayoutPlan"),
    "Collective": ("einshard.analysis", "Collective"),
    "MeshAxis": ("einshard.core.layout", "MeshAxis"),
    "Expression": ("einshard.parsing", "Expression"),
    "parse": ("einshard.parsing", "parse"),
    "anonymous_mesh": ("einshard.placement", "anonymous_mesh"),
    "EinsumProgram": ("einshard.lowering.einsum", "EinsumProgram"),
}
_RENAMED = {"Plan": "EinsumPlan", "PlanResult": "LayoutPlan"}


def __getattr__(name: str) -> object:
    if name not in _MOVED:
        raise AttributeError(f"module 'einshard' has no attribute {name!r}")
    import importlib
    import warnings

    module, attribute = _MOVED[name]
    new = f"einshard.{_RENAMED[name]}" if name in _RENAMED else f"{module}.{attribute}"
    warnings.warn(f"einshard.{name} is now {new} (einshard 0.4)", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), attribute)
