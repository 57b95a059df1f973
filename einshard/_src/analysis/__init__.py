"""The strategy analyzer: from an annotated einsum to its parallelism, collectives and cost.

Nothing here moves data: layouts are :class:`~einshard.core.layout.Layout`\\ s and
meshes may be plain ``{'data': 4, 'model': 2}`` dicts, so a 2048-chip plan is
analysed on a laptop.  Layers: ``cost`` (profiles, the Collective record) →
the moves (collectives as functions on layouts, ``transition``: :mod:`einshard.core.moves`, priced by ``cost``) →
``einsum`` (one einsum, one way through: ``model`` → ``options``, the
per-mesh-axis rule → ``search`` → ``read`` → ``plan`` → ``analyze``) →
``program`` (``explain``: whole programs).
"""

# The public names of the priced moves check their arguments (einshard._checks.RULES, by parameter name); the
# analyzer's own calls use the unchecked functions of .cost.
from .. import _checks  # noqa: E402
from .._checks import RULES as _RULES  # noqa: E402
from .._checks import checked as _checked  # noqa: E402
from ..core import argument_rules as _core_rules  # noqa: E402
from . import argument_rules as _analysis_rules  # noqa: E402
from .cost import (
    KINDS,
    PROFILES,
    Collective,
    Profile,
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    dynamic_slice,
    get_profile,
    reduce_scatter,
    regroup,
    transition,
)
from .einsum.analyze import analyze, analyze_layouts, dtype_info, plan_einsum, spec_partitions
from .einsum.model import Problem, classify
from .einsum.plan import EinsumPlan

all_gather = _checked(all_gather, "einshard.analysis.all_gather")
all_reduce = _checked(all_reduce, "einshard.analysis.all_reduce")
all_to_all = _checked(all_to_all, "einshard.analysis.all_to_all", src=_RULES["axis"], dst=_RULES["axis"])
collective_permute = _checked(collective_permute, "einshard.analysis.collective_permute", dims=_core_rules.REORDERED)
dynamic_slice = _checked(dynamic_slice, "einshard.analysis.dynamic_slice")
reduce_scatter = _checked(reduce_scatter, "einshard.analysis.reduce_scatter")
regroup = _checked(regroup, "einshard.analysis.regroup")
transition = _checked(transition, "einshard.analysis.transition", dst=_core_rules.SAME_TENSOR)
classify = _checked(classify, "einshard.analysis.classify")
plan_einsum = _checked(
    plan_einsum,
    "einshard.analysis.plan_einsum",
    operands=_core_rules.LAYOUTS,
    out=_core_rules.OPTIONAL_LAYOUT,
    dtype=_analysis_rules.DTYPE_NAME,
)
analyze_layouts = _checked(
    analyze_layouts,
    "einshard.analysis.analyze_layouts",
    problem=lambda v, where, name, args: v if isinstance(v, Problem) else _checks.fail(where, name, "a Problem", v),
    dtype=_analysis_rules.DTYPE_NAME,
)
spec_partitions = _checked(spec_partitions, "einshard.analysis.spec_partitions")

__all__ = [
    "KINDS",
    "PROFILES",
    "Collective",
    "EinsumPlan",
    "Problem",
    "Profile",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "analyze",
    "analyze_layouts",
    "classify",
    "collective_permute",
    "dtype_info",
    "dynamic_slice",
    "get_profile",
    "plan_einsum",
    "reduce_scatter",
    "regroup",
    "spec_partitions",
    "transition",
]

from .program import OpReport, ProgramReport, explain  # noqa: E402

__all__ += ["OpReport", "ProgramReport", "explain"]
