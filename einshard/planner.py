"""The planner: ``plan`` chooses every parameter's and the batch's layout for a step (docs/planner.md)."""

from ._src.planner import (
    DEFAULT_VERIFY,
    EXHAUSTIVE_LIMIT,
    MAX_EVALUATIONS,
    OBJECTIVES,
    PAIR_LIMIT,
    SMALL_GROUP_FRACTION,
    Alternative,
    Candidate,
    Group,
    LayoutPlan,
    PipelineCost,
    PipelineSearch,
    SearchOptions,
    Verified,
    parse_bytes,
    plan,
)

__all__ = [
    "plan",
    "SearchOptions",
    "LayoutPlan",
    "PipelineSearch",
    "PipelineCost",
    "Alternative",
    "Verified",
    "DEFAULT_VERIFY",
    "Candidate",
    "Group",
    "parse_bytes",
    "OBJECTIVES",
    "EXHAUSTIVE_LIMIT",
    "MAX_EVALUATIONS",
    "PAIR_LIMIT",
    "SMALL_GROUP_FRACTION",
]
