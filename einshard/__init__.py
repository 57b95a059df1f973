"""einshard: one readable expression says how an array is laid out on a device mesh.

    >>> import einshard, numpy as np
    >>> w = einshard.einshard(np.ones((128, 256)), 'x y -> x y*')   # y split over all devices

The public API is what ``__all__`` lists, plus the public modules (``einshard.placement``, ``einshard.analysis``,
``einshard.planner``, ``einshard.lowering`` ...: docs/architecture.md); the code lives in ``einshard._src``.
"""

# The public modules users reach as einshard.<name> after `import einshard` (docs/architecture.md lists them all).
from . import analysis as analysis
from . import errors as errors
from . import lowering as lowering
from . import placement as placement
from . import planner as planner
from ._src._caches import clear_caches
from ._src.analysis.explicit import check_explicit
from ._src.audit import audit
from ._src.core.logical import axis_rules
from ._src.moved import __getattr__ as __getattr__  # the 0.4 moves, with a warning
from .analysis import EinsumPlan, Profile, analyze, explain
from .errors import EinshardError
from .lowering import data_parallel, einsum, fsdp, fsdp_layouts, lower, pipeline, pipeline_info
from .placement import Layout, describe, einshard, layout, sharding, show, spec
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
