"""The analyzer: what an einsum or a whole program costs on a mesh, and why (docs/analysis.md).

``analyze`` one einsum, ``explain`` a traced step; the priced moves (``all_gather`` ... ``transition``), the hardware
``Profile`` records, the report records (``EinsumPlan``, ``ProgramReport``, ``OpReport``, ``AuditReport``, ``ExplicitReport``).
"""

from ._src.analysis import (
    KINDS,
    PROFILES,
    Collective,
    EinsumPlan,
    OpReport,
    Problem,
    Profile,
    ProgramReport,
    all_gather,
    all_reduce,
    all_to_all,
    analyze,
    analyze_layouts,
    classify,
    collective_permute,
    dtype_info,
    dynamic_slice,
    explain,
    get_profile,
    plan_einsum,
    reduce_scatter,
    regroup,
    spec_partitions,
    transition,
)
from ._src.analysis.explicit import ExplicitReport, Finding, Fix
from ._src.audit import AuditReport, LayoutDifference, RuleUse

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
    "OpReport",
    "ProgramReport",
    "explain",
    "ExplicitReport",
    "Finding",
    "Fix",
    "AuditReport",
    "LayoutDifference",
    "RuleUse",
]
