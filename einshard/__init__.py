"""einshard: one readable expression says how an array is laid out on a device mesh.

    >>> import einshard, numpy as np
    >>> w = einshard.einshard(np.ones((128, 256)), 'x y -> x y*')   # y split over all devices

The public API is what ``__all__`` lists; the layers behind it (parsing,
core, placement, analysis, lowering) are importable on their own.
"""

from ._caches import clear_caches
from .analysis import Collective, Plan, Profile, analyze, explain
from .analysis.planner import PlanResult, plan
from .core.layout import Layout, MeshAxis
from .drawing import show
from .errors import EinshardError
from .lowering import data_parallel, fsdp, fsdp_layouts, pipeline, pipeline_info
from .lowering.einsum import EinsumProgram, einsum, lower
from .parsing import Expression, parse
from .placement import anonymous_mesh, describe, einshard, layout, sharding, spec

__version__ = "0.3.0"

__all__ = [
    "Collective",
    "clear_caches",
    "Plan",
    "Profile",
    "analyze",
    "explain",
    "plan",
    "PlanResult",
    "einsum",
    "lower",
    "EinsumProgram",
    "EinshardError",
    "Expression",
    "Layout",
    "MeshAxis",
    "anonymous_mesh",
    "data_parallel",
    "describe",
    "einshard",
    "fsdp",
    "fsdp_layouts",
    "layout",
    "parse",
    "pipeline",
    "pipeline_info",
    "show",
    "sharding",
    "spec",
]
