"""Where a value sits in its jaxpr, for the look-ahead of sharding propagation (``rules_indexing.consumer_split``).

``consumer_split`` looks for the split a dot's (or a reduction's) partial sum takes from its consumers: it
follows the sum through transposes, conversions, reshapes, broadcasts, gradient sums and elementwise ops, as
far as they go.  Ahead of the walk nothing is laid out yet, so in an unrolled decoder that search runs through
the rest of the program (the residual stream): O(depth) per dot, O(depth²) per costing.

What the search reaches is layout-independent (the program's structure); only a few points of it read
layouts, and only layouts already bound can change its course: the walk binds a jaxpr's values in order, so
when the equation at position ``p`` is stepped, a value its equations make at ``p`` or later is not bound yet
(its read finds nothing, whatever the layouts).  :func:`home_of` gives, once per traced program, each value's
jaxpr with its consumers and each value's position there, so ``rules_indexing`` can precompute a search once per
value (:class:`Reach`) and, in each costing, test only the points where a bound layout is read.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["JaxprHome", "Reach", "home_of", "reach_cache", "LookAheadCounts", "counts_of"]

# How many steps one precomputed search may take before it is given up (the walk then searches as it always did):
# a bound on the memory one value's reach may hold, far above a decoder's (a few hundred).
MAX_STEPS = 200_000


@dataclass(frozen=True, eq=False)
class JaxprHome:
    """One jaxpr's consumers and positions: ``uses`` as the walker reads them (``OpCosts.uses_of``), ``position``
    id(value) -> the position of the equation that makes it (arguments and constants are absent: always bound)."""

    jaxpr: Any  # held, so the ids below stay its values'
    uses: dict[int, list[tuple[Any, int]]]
    position: dict[int, int]

    def made_at(self, value: Any) -> int:
        """Where ``value`` is made (-1: an argument, a constant, a literal: bound before any equation is stepped)."""
        return self.position.get(id(value), -1)


@dataclass(frozen=True, eq=False)
class Reach:
    """One value's precomputed look-ahead (built by ``rules_indexing``): the steps of the search in its order,
    with the points that read layouts (``checks``); see ``rules_indexing.consumer_split``."""

    var: Any  # held: the cache is keyed by its id
    # Each step of the search (breadth-first, as the walk visits them): (value, its axes' map onto the sum's axes,
    # the look-ahead conditions (indices) its path passed: elementwise ops whose other operands may be laid out).
    steps: tuple[tuple[Any, tuple[int, ...], tuple[int, ...]], ...]
    # The points that read a bound layout or ask for one, in visit order: (step, consumer index, kind, equation,
    # operand index, condition index or -1).
    checks: tuple[tuple[int, int, str, Any, int, int], ...]
    # id(value) -> the steps that reach it through a gradient sum (``consumer_split``'s ``summed_with``).
    summed_by: dict[int, tuple[int, ...]]
    # id(value) -> the steps that visit it (a program output asked for: its check is made per costing).
    steps_of: dict[int, tuple[int, ...]]
    conditions: int


@dataclass
class LookAheadCounts:
    """How much the look-ahead did (tallies for tests: the steps per search must not grow with depth)."""

    searches: int = 0  # consumer_split calls answered from a precomputed reach
    steps: int = 0  # steps and checks those searches took
    most: int = 0  # the most one search took
    walked: int = 0  # searches walked the plain way (no reach: a value outside the indexed jaxprs, or too large)


@dataclass
class _State:
    indexed: dict[int, Any] = field(default_factory=dict)  # id(jaxpr) -> the jaxpr indexed under it
    homes: dict[int, JaxprHome] = field(default_factory=dict)  # id(value made by an equation) -> its home
    reaches: dict[int, Reach | None] = field(default_factory=dict)  # id(value) -> its reach (None: walk it)
    counts: LookAheadCounts = field(default_factory=LookAheadCounts)


# Per OpCosts (one per traced program): weak, so a program's index goes with it.
_STATES: weakref.WeakKeyDictionary[Any, _State] = weakref.WeakKeyDictionary()


def _state(costs: Any) -> _State:
    st = _STATES.get(costs)
    if st is None:
        st = _STATES[costs] = _State()
    return st


def counts_of(costs: Any) -> LookAheadCounts:
    """The look-ahead's tallies over the costings made with ``costs``."""
    return _state(costs).counts


def home_of(costs: Any, var: Any) -> JaxprHome | None:
    """The jaxpr ``var`` is made in, among those walked with ``costs`` (None: not made by one of their equations)."""
    st = _state(costs)
    home = st.homes.get(id(var))
    if home is None:
        # Every jaxpr a walk steps through has its uses from OpCosts.uses_of (held there with the jaxpr): index the
        # ones not seen yet.
        for key, (jaxpr, uses) in list(costs._uses.items()):
            if st.indexed.get(key) is jaxpr:
                continue
            st.indexed[key] = jaxpr
            position = {id(v): p for p, e in enumerate(jaxpr.eqns) for v in e.outvars}
            made = JaxprHome(jaxpr, uses, position)
            for i in position:
                st.homes[i] = made
        home = st.homes.get(id(var))
    if home is None or home.position.get(id(var), -1) < 0:
        return None
    return home


def reach_cache(costs: Any) -> dict[int, Reach | None]:
    """id(value) -> its precomputed reach (None: too large, searched the plain way), for ``rules_indexing``."""
    return _state(costs).reaches
