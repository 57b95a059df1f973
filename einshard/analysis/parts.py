"""The parts of the search (:mod:`einshard.analysis.search`): every way to move the operands (a spec: a
choice of what each mesh axis keeps, an order of the mesh axes keeping one einsum axis, an operand variant),
and a spec priced (a part: the operands' targets and the collectives that take them there).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING, NamedTuple

from ..core.layout import Layout
from ..core.moves import derived
from .cost import Collective
from .rule import CONTRACTED, LONE, _fits, _kept_orders, _operand_variants, agreed_splits

if TYPE_CHECKING:
    from .search import _Enumeration

__all__: list[str] = []


# ``_Spec(...)``/``_Part(...)`` as ``tuple.__new__(cls, fields)``: the same tuple, without the Python frame of a
# NamedTuple's generated ``__new__`` (the search builds one per way to move the operands).
_new_tuple = tuple.__new__


class _Spec(NamedTuple):
    """A part before its operand moves are priced: the choice, and what it costs to compute."""

    choice: tuple[tuple[str, str | None], ...]  # (mesh axis, einsum axis kept or None), mesh order
    order: dict[str, tuple[str, ...]]
    operands: tuple[Layout, ...]  # as the moves start (lone-reduced axes summed first or not)
    flops: int
    compute_time: float  # no candidate built on this part is faster
    pending_kept: frozenset[str]
    keep_u: list[frozenset[str]]
    unsplits: bool


class _Part(NamedTuple):
    """One way to move the operands for one choice: the local einsum's inputs, before the result is delivered."""

    choice: tuple[tuple[str, str | None], ...]
    operands: tuple[Layout, ...]  # as the moves start (lone-reduced axes summed first or not)
    targets: tuple[Layout, ...]
    steps: tuple[Collective, ...]
    out_dims: tuple[tuple[str, ...], ...]
    pending: frozenset[str]
    flops: int
    compute_time: float
    bound: float  # compute + operand collectives: no candidate built on this part is faster
    unsplits: bool


def _specs(en: _Enumeration) -> list[_Spec]:
    problem, classes = en.problem, en.classes
    size_of = en.size_of
    mesh_sizes = en.mesh_sizes
    where = en.where
    per_axis = en.per_axis
    names = [m for m, _ in per_axis]
    result: list[_Spec] = []
    peak = en.profile.flops  # Profile.compute_time, inlined: this loop runs for every way to move the operands
    # Each variant with what every choice asks of it: the FLOPs of its local einsum before any split (the
    # axes it holds), the mesh axes its operands split, and whether any brings pending sums.
    variants = []
    for operands, pre in _operand_variants(problem, classes):
        held: set[str] = set()
        split: set[str] = set()
        any_pending = False
        for op in operands:
            held.update(op.axes)
            for d in op.dims:
                split.update(d)
            if op.unreduced:
                any_pending = True
        flops_whole = math.prod(map(size_of.__getitem__, held), start=2)
        variants.append((operands, pre, True in pre, flops_whole, split, any_pending))
    none_pending: list[frozenset[str]] = [frozenset()] * len(problem.operands)
    agreed = agreed_splits(problem, where)
    reduced = {e for e, c in classes.items() if c in (CONTRACTED, LONE)}
    for combo in itertools.product(*[opts for _, opts in per_axis]):
        choice_items = tuple(zip(names, combo))
        choice = dict(choice_items)
        unsplit = False  # an agreed split dropped (gathered), if some operand variant holds it
        for m in agreed:
            if choice[m] is None:
                unsplit = True
                break
        # one pass over the choice: the mesh axes keeping each einsum axis (as the one order when each is kept
        # by one mesh axis), their product, the pending sums
        first_order: dict[str, tuple[str, ...]] = {}
        kept_product = 1
        pending: list[str] = []
        several = False  # some einsum axis kept by several mesh axes (their orders to choose)
        for m, e in choice_items:
            if e is not None:
                if e in first_order:
                    several = True
                else:
                    first_order[e] = (m,)
                kept_product *= mesh_sizes[m]
                if e in reduced:
                    pending.append(m)
        pending_kept = frozenset(pending)
        if not several:  # one mesh axis each: one order
            orders_of: list[dict[str, tuple[str, ...]]] = [first_order]
        else:
            kept_on: dict[str, list[str]] = {}
            for m, e in choice_items:
                if e is not None:
                    kept_on.setdefault(e, []).append(m)
            multi = [(e, _kept_orders(problem, e, ms)) for e, ms in kept_on.items()]
            orders_of = [
                {e: o for (e, _), o in zip(multi, orders, strict=False)}
                for orders in itertools.product(*(os for _, os in multi))
            ]
        for order in orders_of:
            for operands, pre, any_pre, flops_whole, split, any_pending in variants:
                if any_pre and any(
                    pre[i]
                    and any(
                        (e := choice[m]) is not None and e in problem.operands[i].axes and classes[e] == LONE
                        for m in operands[i].unreduced - problem.operands[i].unreduced
                    )
                    for i in range(len(operands))
                ):
                    continue  # summing a lone axis first and also keeping it split: not a different plan
                # gathering an agreed split (a lone-reduced one summed first is reduced instead: not a gather)
                unsplits = False
                if unsplit:
                    for m in agreed:
                        if choice[m] is None and m in split:
                            unsplits = True
                            break
                flops = flops_whole // kept_product
                if not any_pending:
                    result.append(
                        _new_tuple(
                            _Spec,
                            (choice_items, order, operands, flops, flops / peak, pending_kept, none_pending, unsplits),
                        )
                    )
                    continue
                # Pending sums an operand brings: summed before the einsum, or (when no other operand splits
                # over that axis) carried through it, the einsum being linear in each operand.
                keep_u: list[frozenset[str]] = []
                claimed: set[str] = set()
                for op in operands:
                    mine = frozenset(m for m in op.unreduced if choice[m] is None and m not in claimed)
                    claimed |= mine
                    keep_u.append(mine)
                # With pending sums to carry, also price summing them first (every operand whole).
                for ku in [keep_u, none_pending] if any(keep_u) else [keep_u]:
                    result.append(
                        _new_tuple(
                            _Spec, (choice_items, order, operands, flops, flops / peak, pending_kept, ku, unsplits)
                        )
                    )
    return result


_IMPOSSIBLE = object()


def _part(en: _Enumeration, spec: _Spec) -> _Part | None:
    choice, order, operands, keep_u = spec.choice, spec.order, spec.operands, spec.keep_u
    memo = en.memo
    targets: list[Layout] = []
    steps: list[Collective] = []
    get = order.get
    i = 0
    for op, ku in zip(operands, keep_u):
        dims = tuple(map(get, op.axes, _EMPTY))  # order.get(e, ()) of each axis (map: no comprehension frame)
        key = (i, id(op), dims, ku)
        moved = memo.get(key)
        if moved is None:
            moved = _IMPOSSIBLE
            same_sums = ku == op.unreduced
            if same_sums and dims == op.dims:
                moved = (op, ())  # the operand as it is (the most common move: none)
            elif _fits(op.shape, dims, en.mesh_sizes):
                target = derived(op, dims, ku)  # _fits checked the splits; choices never reuse a mesh axis
                if same_sums and _extends(op.dims, dims):
                    moved = (target, ())  # free slices (what transition answers, without its checks)
                else:
                    st = en.transition(op, target, i)
                    if st is not None:
                        moved = (target, st)
            memo[key] = moved
        if moved is _IMPOSSIBLE:  # an indivisible split or an impossible step: not a candidate
            return None
        targets.append(moved[0])  # type: ignore[index]
        if moved[1]:  # type: ignore[index]
            steps += moved[1]  # type: ignore[index]
        i += 1
    compute_time = spec.compute_time
    return _new_tuple(
        _Part,
        (
            choice,
            operands,
            tuple(targets),
            tuple(steps),
            tuple(map(get, en.problem.out_axes, _EMPTY)),
            spec.pending_kept.union(*keep_u),
            spec.flops,
            compute_time,
            # the same sum as a candidate's, over fewer steps (none: the compute time, as the sum gives it)
            compute_time + (steps[0].time if len(steps) == 1 else sum([c.time for c in steps]))
            if steps
            else compute_time,
            spec.unsplits,
        ),
    )


_EMPTY = itertools.repeat(())  # map's second argument for dict.get(key, ()): an endless supply of ()


def _extends(had: tuple[tuple[str, ...], ...], dims: tuple[tuple[str, ...], ...]) -> bool:
    """Whether ``dims`` only splits each dimension further than ``had`` (its mesh axes kept, others added at
    the minor end).  From an operand to a choice's target with the same pending sums, the added mesh axes
    split nothing else of the operand (each keeps one einsum axis) and sum nothing (a pending sum kept is
    over a mesh axis that keeps none): only free slices (``transition``'s answer)."""
    for h, d in zip(had, dims, strict=True):
        if h and d[: len(h)] != h:
            return False
    return True
