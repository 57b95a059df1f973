"""The search over the per-mesh-axis options of :mod:`einshard.analysis.einsum.options`: parts, candidates, ranking.

Each combination of per-axis choices (× orders of mesh axes that keep one
einsum axis × operand variants) is a *part*: the operands' moves to the local
einsum's inputs.  A part's candidates add the ways to deliver the result.

Finding the best candidate prices little: a part's compute time, known
before any collective is priced, and its operand moves each bound every
candidate built on it from below (collectives only add time).  Parts are
visited by compute time; one whose compute alone is dearer than the best
candidate found ends the search, one whose moves are dearer is skipped
before its result's deliveries are priced (:func:`best_candidate`).  Every
candidate, ranked (the plan's alternatives), is built when first asked for,
from the same memos.  Often the first choice (the operands as given) is the
answer and no other needs enumerating (:func:`_as_given` says when).

The parts of the search: every way to move the operands (a spec: a choice of
what each mesh axis keeps, an order of the mesh axes keeping one einsum axis,
an operand variant), and a spec priced (a part: the operands' targets and the
collectives that take them there).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from ...core.collectives import Target
from ...core.layout import Layout
from ...core.moves import derived, trivial_axes
from ...errors import EinshardError
from ..cost import Collective, all_reduce, transition
from .model import CONTRACTED, LONE, Candidate, Problem, classify
from .options import agreed_splits, fits, kept_orders, operand_variants, options, splits_of

__all__ = ["Enumeration", "best_candidate", "enumerate_candidates", "rank", "total_time"]


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


def _specs(en: Enumeration) -> list[_Spec]:
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
    for operands, pre in operand_variants(problem, classes):
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
            multi = [(e, kept_orders(problem, e, ms)) for e, ms in kept_on.items()]
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


def _part(en: Enumeration, spec: _Spec) -> _Part | None:
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
            elif fits(op.shape, dims, en.mesh_sizes):
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


def enumerate_candidates(problem: Problem, classes: dict[str, str] | None = None) -> list[Candidate]:
    """Every candidate (per-axis choices × orders × output resolutions), unsorted, invalid ones dropped.

    ``classes``: :func:`classify` of the problem, if the caller has it."""
    en = Enumeration(problem, classes or classify(tuple(op.axes for op in problem.operands), problem.out_axes))
    return [c for part in en.parts() for c in en.candidates(part)]


def best_candidate(en: Enumeration, complete: bool) -> Candidate | None:
    """``rank(enumerate_candidates(...))``'s first candidate (its first with resolution ``'complete'`` if
    ``complete``), pricing the result's resolutions only for the operand moves that can still win.

    Each part (one way to move the operands) is cheaper than any candidate built on it (the result's
    collectives only add time), and its compute time cheaper still, so parts are visited by compute time,
    the search stops at the first whose compute alone is dearer than the best candidate so far, and a
    part whose moves are dearer is skipped unpriced.  Ties keep the enumeration order, as ``rank`` does.
    """
    best, best_key, decided = _as_given(en, complete)
    if decided:
        return best
    specs = en.specs()
    # Visited by compute time, a lower bound of every candidate's time that needs no collective priced:
    # a part's moves are priced only if it can still win.  The answer is the least key over all candidates
    # whichever the order (every part skipped has only dearer candidates), so ties resolve as in ``rank``.
    for _, _, k in sorted([(spec.unsplits, spec.compute_time, k) for k, spec in enumerate(specs)]):
        spec = specs[k]
        # (a margin of 1e-12: Python 3.12's float sum compensates rounding, so a bound may exceed its
        # candidates' times by an ulp)
        if best is not None and (spec.unsplits, spec.compute_time) > (
            best.unsplits_agreed,
            best.time * (1 + 1e-12),
        ):
            break
        part = en.part(k)
        if part is None or (
            best is not None and (part.unsplits, part.bound) > (best.unsplits_agreed, best.time * (1 + 1e-12))
        ):
            continue
        for j, c in enumerate(en.candidates(part, complete)):
            key = (c.unsplits_agreed, c.time, c.comm_bytes, len(c.steps), k, j)
            if best is None or key < best_key:
                best, best_key = c, key
    return best


def _as_given(en: Enumeration, complete: bool) -> tuple[Candidate | None, tuple[object, ...], bool]:
    """:func:`best_candidate`'s answer when the operands as given decide it without a search.

    Returns (candidate, its key in :func:`best_candidate`, whether it is the answer); the candidate is the
    first part's best (a bound the search starts from) or None when the first part is not priced here.

    The enumeration's first choice (each mesh axis keeps its first option: what the operands, else the
    requested result, split over it) divides the compute by every mesh axis that can divide it, so when no
    operand variant can shrink it (no lone-reduced axis to sum first, no pending sums to carry), no
    candidate computes faster.  Its best candidate (the least key among its ways to deliver the result) is
    then the answer if

    * it needs no collective: nothing is faster, and equal times rank by bytes, steps, then enumeration
      order, where it is first; or
    * every other choice computes slower than it takes in all: when each mesh axis's options are its first
      or none (and the mesh axes keeping one einsum axis have one order), every other choice leaves some
      mesh axis idle, so it divides the compute by at most the whole mesh over the smallest axis that can
      divide it, and collectives only add time.
    """
    problem, classes = en.problem, en.classes
    operands = problem.operands
    mesh_sizes = en.mesh_sizes
    choice: list[tuple[str, str | None]] = []
    order: dict[str, tuple[str, ...]] = {}
    kept_product = 1
    smallest = 0  # the smallest mesh axis that keeps something
    two_options = True  # every mesh axis's options: its first, or none (and one order of the mesh axes)
    several = False
    pending: list[str] = []
    for m, opts in en.per_axis:
        e = opts[0]
        choice.append((m, e))
        if e is not None:
            if e in order:
                order[e] += (m,)
                several = True
            else:
                order[e] = (m,)
            size = mesh_sizes[m]
            kept_product *= size
            if smallest == 0 or size < smallest:
                smallest = size
            if len(opts) > 2:
                two_options = False
            if classes[e] in (CONTRACTED, LONE):
                pending.append(m)
    if several:  # several mesh axes keep one einsum axis: the first of their orders, as _specs enumerates them
        for e, ms in order.items():
            if len(ms) > 1:
                orders = kept_orders(problem, e, list(ms))
                order[e] = orders[0]
                if len(orders) > 1:
                    two_options = False  # another order computes as fast
    held: set[str] = set()
    for op in operands:
        if op.unreduced:
            return None, (), False  # pending sums to carry or sum first: other variants
        held.update(op.axes)
    if LONE in classes.values():
        return None, (), False  # an operand variant with a lone axis summed first computes less
    flops_whole = math.prod(map(en.size_of.__getitem__, held), start=2)
    flops = flops_whole // kept_product
    peak = en.profile.flops
    # as _specs builds it (the same numbers: the plan must not change)
    spec = _new_tuple(
        _Spec,
        (
            tuple(choice),
            order,
            operands,
            flops,
            flops / peak,
            frozenset(pending),
            [frozenset()] * len(operands),
            False,  # each agreed split is kept: it is every mesh axis's first option
        ),
    )
    part = _part(en, spec)
    if part is None:
        return None, (), False
    en.first = part  # the enumeration's first part (the search prices it from here)
    best: Candidate | None = None
    best_key: tuple[object, ...] = ()
    for j, c in enumerate(en.candidates(part, complete)):
        key = (False, c.time, c.comm_bytes, len(c.steps), 0, j)
        if best is None or key < best_key:
            best, best_key = c, key
    if best is None:
        return None, (), False
    if not best.steps:
        return best, best_key, True
    if not two_options:
        return best, best_key, False
    if smallest == 0:
        return best, best_key, True  # no mesh axis keeps anything: the only choice
    # (the margin as best_candidate's: a sum may round an ulp either way)
    decided = (flops_whole // (kept_product // smallest)) / peak > best.time * (1 + 1e-12)
    return best, best_key, decided


class Enumeration:
    """What one enumeration shares across its candidates: the problem's facts, the operand moves (parts),
    and memos of the moves and result resolutions (the same ones recur across choices and orders)."""

    __slots__ = (
        "problem",
        "classes",
        "mesh_sizes",
        "size_of",
        "out_shape",
        "itemsize",
        "profile",
        "memo",
        "per_axis",
        "where",
        "first",
        "_specs",
        "_priced",
    )

    def __init__(
        self,
        problem: Problem,
        classes: dict[str, str],
        where: Sequence[dict[str, str]] | None = None,
        mesh_sizes: dict[str, int] | None = None,
        per_axis: list[tuple[str, tuple[str | None, ...]]] | None = None,
    ) -> None:
        self.problem = problem
        self.classes = classes
        self.mesh_sizes = {m.name: m.size for m in problem.mesh} if mesh_sizes is None else mesh_sizes
        self.size_of = size_of = dict(problem.sizes)
        self.out_shape = tuple(map(size_of.__getitem__, problem.out_axes))
        self.itemsize = problem.itemsize
        self.profile = problem.profile
        self.memo: dict[tuple[object, ...], object] = {}
        # where each operand (then the requested result) splits each mesh axis, and each mesh axis's options
        self.where = splits_of(problem) if where is None else where
        self.per_axis = options(problem, self.where) if per_axis is None else per_axis
        self.first: _Part | None = None  # the first part, when priced before the others are enumerated
        self._specs: list[_Spec] | None = None
        self._priced: list[object] = []

    def transition(self, src: Layout, dst: Layout, operand: Target) -> tuple[Collective, ...] | None:
        """``transition``'s collectives, each recording its tensor (``operand``, which the lowering runs it
        on, and ``tensor``, for people), or None for an impossible step."""
        tensor = "result" if operand == "out" else f"operand {operand + 1}"
        try:
            steps = transition(src, dst, itemsize=self.itemsize, profile=self.profile, tensor=tensor)[1]
        except EinshardError:
            return None
        for c in steps:
            # ``_with_operand(c, operand)`` in place: ``transition`` records each collective afresh for this
            # call (nothing else holds it yet), so filling its operand here is the copy without the copy.
            c.__dict__["operand"] = operand
        return steps

    def specs(self) -> list[_Spec]:
        """Every way to move the operands (per-axis choices × orders × operand variants), in enumeration
        order, unpriced."""
        if self._specs is None:
            self._specs = _specs(self)
            self._priced = [_UNSET] * len(self._specs)
            if self.first is not None:
                self._priced[0] = self.first
        return self._specs

    def part(self, k: int) -> _Part | None:
        """Spec ``k`` priced (None: an indivisible split or an impossible step), memoized."""
        self.specs()
        got = self._priced[k]
        if got is _UNSET:
            got = self._priced[k] = _part(self, self._specs[k])  # type: ignore[index]
        return got  # type: ignore[return-value]

    def parts(self) -> list[_Part]:
        """Every possible way to move the operands, priced, in enumeration order."""
        return [p for k in range(len(self.specs())) if (p := self.part(k)) is not None]

    def candidates(self, part: _Part, complete: bool = False) -> list[Candidate]:
        """The part's candidates, one per way to deliver the result (``complete``: only complete results)."""
        computed, outs = _outcomes(self, part.out_dims, part.pending, complete)
        steps = part.steps
        out: list[Candidate] = []
        for resolution, target_out, variant in outs:
            all_steps = (*steps, *variant)
            cand = Candidate.trusted(  # (one per way to deliver each part's result: the trusted constructor)
                part.choice,
                part.targets,
                all_steps,
                computed,
                target_out,
                resolution,
                part.flops,
                # (none or one step: the sums' values, without their loops)
                part.compute_time + total_time(all_steps) if all_steps else part.compute_time,
                _total_bytes(all_steps),
                part.operands,
                part.unsplits,
            )
            out.append(cand)
        return out


_UNSET = object()
# The resolutions that deliver a complete result (no pending sums), without and with reduce-scatters onto an
# output axis (Problem.scatter_chosen).
_COMPLETE = frozenset({"complete"})
_COMPLETE_SCATTERED = frozenset({"complete", "reduce-scatter"})


def total_time(steps: tuple[Collective, ...]) -> float:
    """``sum([c.time for c in steps])``, the same value (one step: its time, which is 0 + its time)."""
    return steps[0].time if len(steps) == 1 else sum([c.time for c in steps])


def _total_bytes(steps: tuple[Collective, ...]) -> int:
    """``sum([c.bytes for c in steps])``, the same value without the loop for none or one step."""
    if len(steps) < 2:
        return steps[0].bytes if steps else 0
    return sum([c.bytes for c in steps])


def _with_operand(c: Collective, operand: Target | None) -> Collective:
    """``dataclasses.replace(c, operand=operand)`` without its generic machinery (a tenth of a fresh analysis):
    the record's fields as they are, the operand set."""
    new = Collective._derive(c.__dict__)  # (copies the fields)
    new.__dict__["operand"] = operand
    return new


def _outcomes(
    en: Enumeration, out_dims: tuple[tuple[str, ...], ...], pending: frozenset[str], complete: bool = False
) -> tuple[Layout, list[tuple[str, Layout, tuple[Collective, ...]]]]:
    """The computed result and the ways to deliver it: (resolution, delivered layout, collectives), memoized.

    ``complete``: only the ways that deliver it complete (resolution ``'complete'``), when no layout is
    requested; the search for the best needs no other (they come first in the full list too)."""
    full = en.memo.get(("result", out_dims, pending))
    if full is not None:
        if complete:
            kept = _COMPLETE_SCATTERED if en.problem.scatter_chosen else _COMPLETE
            return full[0], [o for o in full[1] if o[0] in kept]  # type: ignore[index]
        return full  # type: ignore[return-value]
    key = ("complete" if complete else "result", out_dims, pending)
    hit = en.memo.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    problem = en.problem
    # valid by construction: the kept splits divide their axes (the operands holding them fit), and the
    # pending sums are over mesh axes that keep a summed axis or nothing
    computed = Layout._derive(problem.out_axes, en.out_shape, problem.mesh, out_dims, pending)
    fast = complete and pending and problem.requested is None and not trivial_axes(computed)
    outs = _completed(en, computed) if fast else []
    if not fast or problem.scatter_chosen:
        for resolution, target_out in _resolutions(problem, computed, en.mesh_sizes, complete):
            if fast and resolution == "complete":
                continue  # _completed gave it
            out_steps = en.transition(computed, target_out, "out")
            if out_steps is None:  # a pending sum the request cannot hold, an indivisible split
                continue
            outs.append((resolution, target_out, out_steps))
            split = _split_all_reduces(out_steps, en)
            if split is not None:
                outs.append((resolution, target_out, split))
    en.memo[key] = (computed, outs)
    return computed, outs


def _completed(en: Enumeration, computed: Layout) -> list[tuple[str, Layout, tuple[Collective, ...]]]:
    """The ways to deliver a result with pending sums complete, on a mesh without axes of size 1: what
    ``_resolutions`` and ``transition`` give (only the sums change: one all-reduce over their mesh axes in
    mesh order, and the same as one all-reduce per axis), without their general checks."""
    pending = computed.unreduced
    summed = tuple(pending) if len(pending) == 1 else tuple([m for m in en.mesh_sizes if m in pending])
    target, c = all_reduce(
        computed, summed, itemsize=en.itemsize, profile=en.profile, tensor="result", why="sum the partial results"
    )
    c.__dict__["operand"] = "out"  # recorded afresh by all_reduce: filled in place, as Enumeration.transition
    steps: tuple[Collective, ...] = (c,)
    outs: list[tuple[str, Layout, tuple[Collective, ...]]] = [("complete", target, steps)]
    split = _split_all_reduces(steps, en)
    if split is not None:
        outs.append(("complete", target, split))
    return outs


def _split_all_reduces(steps: tuple[Collective, ...], en: Enumeration) -> tuple[Collective, ...] | None:
    """The same sums done as one all-reduce per mesh axis (what XLA emits when partial sums come from
    different dimensions), or None if no all-reduce spans several mesh axes.  It sends more bytes
    (2(n_i-1)/n_i of the buffer per axis instead of 2(n-1)/n once) over fewer ring hops (Σ2(n_i-1)
    instead of 2(n-1)), so it wins only for small, latency-bound buffers: a hierarchical all-reduce."""
    for c in steps:  # (a loop, not any() of a generator: this runs for every way to deliver a result)
        if c.kind == "all-reduce" and len(c.axes) > 1:
            break
    else:
        return None
    out: list[Collective] = []
    for c in steps:
        if c.kind != "all-reduce" or len(c.axes) == 1 or c.before is None:
            out.append(c)
            continue
        cur = c.before
        for m in c.axes:
            cur, one = all_reduce(cur, (m,), itemsize=en.itemsize, profile=en.profile, tensor=c.tensor, why=c.why)
            if one.group_size > 1:
                out.append(_with_operand(one, c.operand))
    return tuple(out)


def _resolutions(
    problem: Problem, computed: Layout, mesh_sizes: dict[str, int], complete: bool = False
) -> list[tuple[str, Layout]]:
    if problem.requested is not None:
        return [("requested", problem.requested)]
    if not computed.unreduced:
        return [("complete", computed)]
    out = [("complete", derived(computed, computed.dims, frozenset()))]
    if complete and not problem.scatter_chosen:
        return out
    pending = tuple(m.name for m in computed.mesh if m.name in computed.unreduced)
    for i in range(len(computed.axes)):
        dims = computed.dims[:i] + (computed.dims[i] + pending,) + computed.dims[i + 1 :]
        if fits(computed.shape, dims, mesh_sizes):  # the pending axes split nothing: only divisibility to check
            out.append(("reduce-scatter", derived(computed, dims, frozenset())))
    if not complete:
        out.append(("unreduced", computed))
    return out


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Cheapest first (time, then bytes, then fewer collectives); equal candidates dropped.

    Candidates that gather a split every operand agrees on come last whatever
    their time: XLA always keeps such a split (it reduces the partial sums),
    and on small buffers the α–β model alone would prefer gathering both
    operands, which sends fewer bytes when the batch is small (``B < 2DF/(D+F)``
    for ``b d, b f -> d f``) but duplicates the compute and the activations on
    every device.  Analysis is there to say what the compiled program does.
    """
    seen: set[object] = set()
    ranked: list[Candidate] = []
    keyed = sorted(
        enumerate(candidates),
        key=lambda ic: (ic[1].unsplits_agreed, ic[1].time, ic[1].comm_bytes, len(ic[1].steps), ic[0]),
    )
    for _, c in keyed:
        key = (
            c.out.dims,
            c.out.unreduced,
            c.flops,
            tuple((s.kind, s.axes, s.tensor, s.array_bytes) for s in c.steps),
        )
        if key in seen:
            continue
        seen.add(key)
        ranked.append(c)
    return ranked
