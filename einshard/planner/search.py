"""Searching assignments: exhaustive for small spaces, else a guided coordinate descent within an evaluation budget.

The descent (a heuristic; tests measure it against brute force):

1. The starts (``dp``, ``fsdp``) and every batch layout with the parameters
   replicated are costed; batch layouts are then taken best first.
2. For a batch layout, each parameter group in turn (largest first) takes
   its best candidate with the others fixed, trying first only the candidates
   that can differ in cost for that batch (:func:`~.groups.search_candidates`:
   one FSDP placement per set of batch axes), until a round changes nothing.
   Then the batch moves with the parameters fixed, and the groups descend
   again if it did.
3. While the budget lasts: every candidate of every group (a polish round),
   then every two groups together when that is at most ``pair_limit``
   assignments (a row-parallel weight pays off only with its column-parallel
   neighbour; single moves can stall there), descending after each improvement.

Each costing walks the whole program (tens of milliseconds on a 2-layer
transformer), so the number costed is the planning time: ``max_evaluations``
bounds it, and ``LayoutPlan.evaluated`` reports it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from .scoring import Costs

__all__ = ["exhaustive", "guided_descent"]

Assign = tuple[int, ...]


def exhaustive(costs: Costs, counts: Sequence[int]) -> list[Assign]:
    for assign in itertools.product(*[range(n) for n in counts]):
        costs.score(assign)
    return ranked(costs)


def ranked(costs: Costs) -> list[Assign]:
    return sorted(costs.cache, key=lambda a: costs.cache[a].key)


class _Out(Exception):
    """The evaluation budget is spent."""


def guided_descent(
    costs: Costs,
    counts: Sequence[int],
    starts: Sequence[Assign],
    allowed: Callable[[int, int], Sequence[int]],
    max_evaluations: int,
    pair_limit: int,
    max_rounds: int = 6,
) -> list[Assign]:
    """Coordinate descent; ``allowed(group, batch_candidate)`` lists the candidates tried first."""
    n_groups = len(counts) - 1
    b_index = n_groups
    order = sorted(range(n_groups), key=lambda g: -costs.groups[g].nbytes)

    def key(a: Assign) -> tuple[object, ...]:
        if a not in costs.cache and len(costs.cache) >= max_evaluations:
            raise _Out
        return costs.score(a).key

    def best_of(options: Sequence[Assign], current: Assign) -> Assign:
        best = current
        for a in options:
            if key(a) < key(best):
                best = a
        return best

    def move(current: Assign, g: int, choices: Sequence[int]) -> Assign:
        return best_of([current[:g] + (c,) + current[g + 1 :] for c in choices], current)

    def descend(current: Assign, full: bool) -> Assign:
        for _ in range(max_rounds):
            before = current
            for g in order:
                choices = range(counts[g]) if full else allowed(g, current[b_index])
                current = move(current, g, choices)
            current = move(current, b_index, range(counts[b_index]))
            if current == before:
                break
        return current

    def pair_moves(current: Assign) -> Assign:
        options = []
        for i, j in itertools.combinations(range(len(counts)), 2):
            for ci in range(counts[i]):
                for cj in range(counts[j]):
                    a = list(current)
                    a[i], a[j] = ci, cj
                    options.append(tuple(a))
        return best_of(options, current)

    try:
        for s in starts:
            key(s)
        replicated = tuple(0 for _ in range(n_groups))
        batches = sorted(range(counts[b_index]), key=lambda b: key((*replicated, b)))
        for b in batches:
            from_b = [a for a in costs.cache if a[b_index] == b]
            descend(min(from_b, key=key), full=False)
        best = ranked(costs)[0]
        for _ in range(max_rounds):
            polished = descend(best, full=True)
            if sum(a * b for a, b in itertools.combinations(counts, 2)) <= pair_limit:
                polished = descend(pair_moves(polished), full=False)
            if polished == best:
                break
            best = polished
    except _Out:
        pass
    return ranked(costs)
