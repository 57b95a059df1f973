"""``SearchOptions``: how ``einshard.plan`` walks the space of layouts (``plan(..., search=SearchOptions(...))``).

These knobs tune the search only; they never change what a layout costs.  They travel as one record so that
``plan``'s own keywords stay few and every other keyword reaches the user's step function: a step with a
keyword of its own called ``seed`` or ``restarts`` gets it, instead of the search taking it silently.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._checks import check_int, describe_value
from ..errors import EinshardError

__all__ = ["SearchOptions", "EXHAUSTIVE_LIMIT", "MAX_EVALUATIONS", "PAIR_LIMIT", "N_ALTERNATIVES"]

EXHAUSTIVE_LIMIT = 256
MAX_EVALUATIONS = 160
PAIR_LIMIT = 512
N_ALTERNATIVES = 5

_WHERE = "einshard.planner.SearchOptions"

# The smallest value each count takes: 0 where "none" means something (no exhaustive search, no restarts, no
# pairs, no alternatives), 1 where the descent needs at least one costed assignment.
_COUNT_MINIMUMS: dict[str, int] = {
    "exhaustive_limit": 0,
    "max_evaluations": 1,
    "restarts": 0,
    "pair_limit": 0,
    "n_alternatives": 0,
}


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    """How ``einshard.plan`` searches (the defaults suit models of a few dozen parameter groups).

    Attributes:
        exhaustive_limit: search exhaustively when there are at most this many assignments (0: never).
        max_evaluations: otherwise, a guided coordinate descent costs at most this many assignments (each walks
            the traced program once).
        restarts: extra random starts of the descent, besides the presets (data parallel, fully sharded).
        pair_limit: also try moving every two groups together when that is at most this many assignments.
        seed: the seed of the random restarts (the search is deterministic for a given seed).
        n_alternatives: how many runners-up the plan lists in ``alternatives`` (besides the presets).
    """

    exhaustive_limit: int = EXHAUSTIVE_LIMIT
    max_evaluations: int = MAX_EVALUATIONS
    restarts: int = 0
    pair_limit: int = PAIR_LIMIT
    seed: int = 0
    n_alternatives: int = N_ALTERNATIVES

    def __post_init__(self) -> None:
        # Checked here, at construction, so a bad knob is named before any tracing; numpy ints become ints so
        # that two equal records compare and hash equal.
        for name, minimum in _COUNT_MINIMUMS.items():
            object.__setattr__(self, name, check_int(getattr(self, name), _WHERE, name, minimum=minimum))
        object.__setattr__(self, "seed", check_int(self.seed, _WHERE, "seed"))


FIELDS: frozenset[str] = frozenset(f.name for f in dataclasses.fields(SearchOptions))


def search_options(value: Any, where: str = "einshard.plan") -> SearchOptions:
    """``plan``'s ``search=``: a :class:`SearchOptions`, or None for the defaults."""
    if value is None:
        return SearchOptions()
    if not isinstance(value, SearchOptions):
        raise EinshardError(
            f"{where}: search= takes an einshard.planner.SearchOptions (e.g. SearchOptions(max_evaluations=40)), "
            f"got {describe_value(value)}"
        )
    return value
