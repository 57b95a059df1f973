"""Searching assignments: exhaustive for small spaces, else a guided coordinate descent within an evaluation budget.

The descent (a heuristic; tests measure it against brute force):

1. The starts are costed: ``dp``, ``fsdp``, the user's presets the
   candidates express, then the standard Megatron layouts
   (:func:`tensor_parallel_starts`: dp×tp and fsdp×tp for each batch layout
   that leaves a mesh axis free, the column- and row-parallel weights read
   from the program by :func:`~.roles.megatron_pairs`); then every batch
   layout with the parameters replicated (for the ``memory`` objective split
   over every mesh axis instead: :func:`sharded_parameters`, the least
   parameter memory, so that batch layouts are not ranked by their
   activations alone).  Batch layouts are taken in the
   order of their best costed assignment (within the memory budget first),
   each descending from that assignment and from its replicated (``memory``:
   fully split) parameters (where groups are coupled the two reach different
   local optima): ranked
   by replicated parameters alone, a budget no replicated layout meets
   orders them by memory, and the evaluations go to the batch layout that
   frees the most, not the fastest.  Then, while the budget lasts, each batch
   layout also descends from its parameters split over every mesh axis
   (:func:`sharded_parameters`; except under ``memory``, where that is the
   start already): a third local optimum, where a weight split along its
   contraction pays once the batch's features are split alike.
2. For a batch layout, each parameter group in turn (largest first) takes
   its best candidate with the others fixed, trying first only the candidates
   that can differ in cost for that batch (:func:`~.groups.search_candidates`:
   one FSDP placement per set of batch axes; for the ``memory`` objective
   also ``x@data y@model``), until a round changes nothing.
   Then the batch moves with the parameters fixed, and the groups descend
   again if it did (a round that starts over the memory budget moves the
   batch first: a few assignments that can free more than a whole round).  When a round changes nothing, the relabel moves
   (:func:`relabelings`: every group over mesh axes ``t`` moved to ``t2`` at
   once, the mesh axes permuted) are tried: a row-parallel weight pays off
   only with its column-parallel neighbour split over the same axes, so
   single moves stall on a pair over the wrong ones.
3. While the budget lasts: every candidate of every group (a polish round);
   forced moves (one group forced onto each other candidate, the others
   replying with their best, kept when the end is better: a pair moving to
   the neighbouring layer changes three groups at once); then every two
   groups together when that is at most ``pair_limit`` assignments,
   descending after each improvement.

Each costing walks the whole program (tens of milliseconds on a 2-layer
transformer), so the number costed is the planning time: ``max_evaluations``
bounds it, and ``LayoutPlan.evaluated`` reports it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

from .groups import Group
from .roles import Parallel, Role
from .scoring import Costs

__all__ = ["exhaustive", "guided_descent", "tensor_parallel_starts", "sharded_parameters"]

Assign = tuple[int, ...]


def relabelings(costs: Costs, current: Assign) -> list[Assign]:
    """Moves that change the mesh axes of every group at once, keeping which groups share them.

    A column-parallel weight and its row-parallel neighbour must split the
    index they share over the same mesh axes: moving either alone breaks the
    pair and costs more, so single moves stall on a pair over the wrong axes
    (``(data, model)`` where ``data`` alone is faster).  Here every group (and
    in a second variant the batch) that uses the axes ``t`` on some tensor
    axis uses ``t2`` instead, for every ``t`` in use and every ``t2`` some
    candidate uses (``()``: unsplit), in a third variant with the batch giving
    up the mesh axes ``t2`` adds; and every permutation of the mesh axes
    (TP over ``model`` and the batch over ``data`` become the reverse).  A
    group with no candidate for the result keeps its own.
    """
    cands = [g.candidates for g in costs.groups] + [costs.batch.candidates]
    index = [{c.dims: i for i, c in enumerate(cs)} for cs in cands]
    now = [cands[k][c].dims for k, c in enumerate(current)]
    axes = [m for m, n in costs.sizes.items() if n > 1]
    # Every mesh axis has a rank: a user's preset may name a size-1 axis (plan(presets=) layouts join the
    # candidates), which the moves below never choose but must still be able to sort.
    rank = {m: i for i, m in enumerate(costs.sizes)}
    options = sorted({d for cs in cands for c in cs for d in c.dims})
    out: list[Assign] = []

    def build(sub: dict[tuple[str, ...], tuple[str, ...]], upto: int, yields: frozenset[str] = frozenset()) -> None:
        a = list(current)
        for k in range(upto):
            new = tuple(tuple(sorted(sub.get(d, d), key=rank.__getitem__)) for d in now[k])
            if new != now[k] and new in index[k]:
                a[k] = index[k][new]
        if yields:
            freed = tuple(tuple(m for m in d if m not in yields) for d in now[-1])
            if freed != now[-1] and freed in index[-1]:
                a[-1] = index[-1][freed]
        moved = tuple(a)
        if moved != current and moved not in out:
            out.append(moved)

    for t in sorted({d for dims in now[:-1] for d in dims if d}):
        for t2 in options:
            if t2 != t:
                build({t: t2}, len(current) - 1)
                if t in now[-1]:
                    build({t: t2}, len(current))
                # A split extended onto a mesh axis the batch uses (``y@model`` -> ``y@(data,model)`` under a
                # batch over ``data``) pays off only once the batch gives that axis up: each move alone costs
                # more (the weights gathered back over ``data``, or the batch replicated under narrow TP).
                added = frozenset(t2) - frozenset(t)
                if added & {m for d in now[-1] for m in d}:
                    build({t: t2}, len(current) - 1, added)
    for perm in itertools.permutations(axes):
        if list(perm) != axes:
            to = dict(zip(axes, perm))
            build({d: tuple(to[m] for m in d) for d in options}, len(current))
    return out


def tensor_parallel_starts(
    groups: Sequence[Group],
    batch: Group,
    parallel: Mapping[int, Parallel],
    roles: Sequence[Mapping[int, Role]],
    sizes: Mapping[str, int],
) -> list[Assign]:
    """The standard hand layouts as starts of the descent: Megatron tensor parallelism (with data parallelism).

    For each batch layout that splits the batch over mesh axes ``B`` (none too: pure tensor parallelism) and
    leaves others ``F`` free, two assignments: every weight :func:`~.roles.megatron_pairs` names split over
    ``F`` on its first axis of the matching role (a column-parallel weight on an axis its matmul keeps, a
    row-parallel one on an axis it contracts: the heads of a 3-D attention kernel, not the head dimension),
    the rest replicated (``dp×tp``); and the same with every large group also split over ``B`` on another
    axis (``fsdp×tp``: what fits when replicating over ``B`` does not).

    Single moves cannot reach these from the presets: a column-parallel weight without its row-parallel
    partner gathers its output, so each half of the pair alone costs more than neither, and under a memory
    budget a descent from the replicated start takes the splits that free the most memory first.  They cost
    two assignments per batch layout, whatever the model's size.
    """
    mesh = [m for m, n in sizes.items() if n > 1]
    index = [{c.dims: i for i, c in enumerate(g.candidates)} for g in groups]
    out: list[Assign] = []
    for b, bc in enumerate(batch.candidates):
        on_batch, on_sequence = bc.dims[0], bc.dims[1]
        free = tuple(m for m in mesh if m not in on_batch)
        if on_sequence or not free:
            continue
        tp = [
            _split(g, index[k], {_megatron_axis(g, parallel.get(k), roles[k], free, index[k]): free})
            for k, g in enumerate(groups)
        ]
        out.append((*tp, b))
        if on_batch:
            both = [_with_fsdp(g, index[k], tp[k], on_batch, sizes) for k, g in enumerate(groups)]
            out.append((*both, b))
    return list(dict.fromkeys(out))


def _megatron_axis(
    group: Group, kind: Parallel | None, roles: Mapping[int, Role], free: tuple[str, ...], index: Mapping[Dims, int]
) -> int | None:
    """The tensor axis a Megatron layout splits over ``free``: the first the matmul keeps (column-parallel) or
    contracts (row-parallel) that a candidate splits so; None where the group is no matmul weight."""
    if kind is None:
        return None
    wanted = "out" if kind == "col" else "in"
    for axis in sorted(roles):
        if roles[axis] == wanted and _dims(group, {axis: free}) in index:
            return axis
    return None


Dims = tuple[tuple[str, ...], ...]


def _dims(group: Group, split: Mapping[int, tuple[str, ...]]) -> Dims:
    return tuple(split.get(i, ()) for i in range(len(group.names)))


def _split(group: Group, index: Mapping[Dims, int], split: Mapping[int | None, tuple[str, ...]]) -> int:
    """The candidate splitting those axes (a ``None`` axis: none), else replicated (candidate 0)."""
    return index.get(_dims(group, {a: m for a, m in split.items() if a is not None}), 0)


def _with_fsdp(
    group: Group, index: Mapping[Dims, int], current: int, axes: tuple[str, ...], sizes: Mapping[str, int]
) -> int:
    """``current`` plus a split over the batch's mesh axes on the largest other tensor axis that takes it (FSDP)."""
    if len(group.candidates) == 1:
        return current
    now = dict(enumerate(group.candidates[current].dims))
    options = [
        (max(s[i] for s in group.shapes), i)
        for i in range(1 if group.stacked else 0, len(group.names))
        if not now[i] and _dims(group, {**{k: d for k, d in now.items() if d}, i: axes}) in index
    ]
    if not options:
        return current
    _, axis = max(options)
    return index[_dims(group, {**{k: d for k, d in now.items() if d}, axis: axes})]


def sharded_parameters(groups: Sequence[Group]) -> tuple[int, ...]:
    """Each group's candidate that splits it over the most mesh axes (the least parameter memory per device), on
    its largest tensor axis (FSDP's choice; the first candidate on ties); never a stacked group's layer axis
    (a pipeline stage split, which ``jax.jit`` does not run as a pipeline)."""

    def rank(g: Group, i: int) -> tuple[int, int, int]:
        dims = g.candidates[i].dims
        split = [k for k, d in enumerate(dims) if d]
        return (sum(len(d) for d in dims), max((max(s[k] for s in g.shapes) for k in split), default=0), -i)

    return tuple(
        max(
            (i for i, c in enumerate(g.candidates) if not (g.stacked and c.dims and c.dims[0])),
            key=lambda i, g=g: rank(g, i),  # type: ignore[misc]
            default=0,
        )
        for g in groups
    )


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
    megatron: Sequence[Assign] = (),
    base: Sequence[int] | None = None,
) -> list[Assign]:
    """Coordinate descent; ``allowed(group, batch_candidate)`` lists the candidates tried first; ``base`` the
    parameters each batch layout starts from (default replicated)."""
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
            if not costs.score(current).fits:
                # Over the budget the batch layout moves first: it sets most of the activations' memory, and
                # costs a few assignments, where a round over the groups of a large model can take the whole
                # budget (the 80-layer llama-7b's round from its dp×tp start ended past 140 evaluations
                # without fitting, on a batch layout the batch move would have left at once).
                current = move(current, b_index, range(counts[b_index]))
            for g in order:
                choices = range(counts[g]) if full else allowed(g, current[b_index])
                current = move(current, g, choices)
            current = move(current, b_index, range(counts[b_index]))
            if current == before:
                current = best_of(relabelings(costs, current), current)
                if current == before:
                    break
        return current

    def forced_moves(current: Assign) -> Assign:
        # A group forced onto each other candidate, every other group then taking its best reply: the first
        # that ends better.  Reaches what no single move does when groups must change together (a
        # column/row-parallel pair moving to the neighbouring layer changes three groups at once).
        for g in [*order, b_index]:
            for c in range(counts[g]):
                if c == current[g]:
                    continue
                a = current[:g] + (c,) + current[g + 1 :]
                for h in order:
                    if h != g:
                        a = move(a, h, allowed(h, a[b_index]))
                if g != b_index:
                    a = move(a, b_index, range(counts[b_index]))
                if key(a) < key(current):
                    return a
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
        # The Megatron starts after the presets, before the replicated batch layouts (a few assignments per batch
        # layout: on the 80-layer llama-7b, where nothing fits before evaluation ~100, they move its first fit
        # by two evaluations and leave its plan as it was).
        for s in megatron:
            key(s)
        replicated = tuple(0 for _ in range(n_groups)) if base is None else tuple(base)
        for b in range(counts[b_index]):
            key((*replicated, b))
        # Each batch layout descends from its best start, the batch layouts in the order of their best starts
        # (within the budget first): ranked by replicated parameters alone, a budget that no replicated layout
        # meets would order them by memory, and the evaluations would go to the batch that frees the most.
        batches = sorted(
            range(counts[b_index]), key=lambda b: min(costs.cache[a].key for a in costs.cache if a[b_index] == b)
        )
        for b in batches:
            # From the batch layout's best start and from its replicated parameters: where groups are coupled the
            # two reach different local optima (a Megatron pair vs one column-parallel weight alone).
            best_start = min((a for a in costs.cache if a[b_index] == b), key=key)
            for s in dict.fromkeys([best_start, (*replicated, b)]):
                descend(s, full=False)
        # Then, where the budget lasts, each batch layout from its parameters split over every mesh axis: a third
        # local optimum where a weight split along its contraction pays once the batch's features are split alike
        # (a 2-layer MLP's step on (data 2, model 4): w0 rows over (data, model), w1 whole, the features over data,
        # 1.01e-5 s, where the other starts' descents stopped at a Megatron pair's 1.20e-5 s once open values took
        # their readers' splits, :mod:`einshard._src.analysis.program.open_values`).
        if base is None:
            sharded = sharded_parameters(costs.groups)
            for b in batches:
                descend((*sharded, b), full=False)
        best = ranked(costs)[0]
        for _ in range(max_rounds):
            polished = descend(best, full=True)
            polished = descend(forced_moves(polished), full=False)
            if not costs.score(polished).fits:
                # Nothing fits: the least memory is reached where the groups change their mesh axes together and
                # then each moves on (the optimum of a 2-layer MLP's forward on (data 2, model 4) had every group
                # and the batch on the other axis; no single, forced, pair or relabelling move that improves at
                # once reached it): a descent from every relabelling.
                for r in relabelings(costs, polished):
                    end = descend(r, full=False)
                    if key(end) < key(polished):
                        polished = end
            if sum(a * b for a, b in itertools.combinations(counts, 2)) <= pair_limit:
                polished = descend(pair_moves(polished), full=False)
            if polished == best:
                break
            best = polished
    except _Out:
        pass
    return ranked(costs)
