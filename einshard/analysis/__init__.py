"""The strategy analyzer: from an annotated einsum to its parallelism, collectives and cost.

Nothing here moves data: layouts are :class:`~einshard.core.layout.Layout`\\ s and
meshes may be plain ``{'data': 4, 'model': 2}`` dicts, so a 2048-chip plan is
analysed on a laptop.  Layers: ``cost`` (profiles, the Collective record) →
``primitives`` (collectives as functions on layouts, ``transition``) →
``rule`` (the per-mesh-axis einsum rule) → ``search`` (its
parts and candidates, pruned and ranked) → ``strategy`` (names) → ``plan`` /
``api`` (``analyze``).
"""

from .api import analyze, analyze_layouts, dtype_info, plan_einsum, spec_partitions
from .cost import KINDS, PROFILES, Collective, Profile, get_profile
from .plan import EinsumPlan
from .primitives import (
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    dynamic_slice,
    reduce_scatter,
    regroup,
    transition,
)
from .rule import Problem, classify

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
