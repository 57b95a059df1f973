"""The search over the per-mesh-axis options of :mod:`einshard.analysis.rule`: parts, candidates, ranking.

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
from the same memos.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from ..core.collectives import Target
from ..core.layout import Layout
from ..errors import EinshardError
from .cost import Collective
from .primitives import _derived, _unchecked, all_reduce
from .rule import (
    CONTRACTED,
    LONE,
    Candidate,
    Problem,
    _fits,
    _kept_orders,
    _operand_variants,
    agreed_splits,
    classify,
    options,
)
from .transition import transition

__all__ = ["best_candidate", "enumerate_candidates", "rank"]


def enumerate_candidates(problem: Problem, classes: dict[str, str] | None = None) -> list[Candidate]:
    """Every candidate (per-axis choices × orders × output resolutions), unsorted, invalid ones dropped.

    ``classes``: :func:`classify` of the problem, if the caller has it."""
    en = _Enumeration(problem, classes or classify(tuple(op.axes for op in problem.operands), problem.out_axes))
    return [c for part in en.parts() for c in en.candidates(part)]


def best_candidate(en: _Enumeration, complete: bool) -> Candidate | None:
    """``rank(enumerate_candidates(...))``'s first candidate (its first with resolution ``'complete'`` if
    ``complete``), pricing the result's resolutions only for the operand moves that can still win.

    Each part (one way to move the operands) is cheaper than any candidate built on it (the result's
    collectives only add time), and its compute time cheaper still, so parts are visited by compute time,
    the search stops at the first whose compute alone is dearer than the best candidate so far, and a
    part whose moves are dearer is skipped unpriced.  Ties keep the enumeration order, as ``rank`` does.
    """
    specs = en.specs()
    best: Candidate | None = None
    best_key: tuple[object, ...] = ()
    # Visited by compute time, a lower bound of every candidate's time that needs no collective priced:
    # a part's moves are priced only if it can still win.  The answer is the least key over all candidates
    # whichever the order (every part skipped has only dearer candidates), so ties resolve as in ``rank``.
    for k in sorted(range(len(specs)), key=lambda k: (specs[k].unsplits, specs[k].compute_time)):
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


class _Enumeration:
    """What one enumeration shares across its candidates: the problem's facts, the operand moves (parts),
    and memos of the moves and result resolutions (the same ones recur across choices and orders)."""

    __slots__ = ("problem", "classes", "mesh_sizes", "out_shape", "itemsize", "profile", "memo", "_specs", "_priced")

    def __init__(self, problem: Problem, classes: dict[str, str]) -> None:
        self.problem = problem
        self.classes = classes
        self.mesh_sizes = {m.name: m.size for m in problem.mesh}
        size_of = problem.size_of
        self.out_shape = tuple(size_of[e] for e in problem.out_axes)
        self.itemsize = problem.itemsize
        self.profile = problem.profile
        self.memo: dict[tuple[object, ...], object] = {}
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
        return tuple([_with_operand(c, operand) for c in steps])

    def specs(self) -> list[_Spec]:
        """Every way to move the operands (per-axis choices × orders × operand variants), in enumeration
        order, unpriced."""
        if self._specs is None:
            self._specs = _specs(self)
            self._priced = [_UNSET] * len(self._specs)
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
            # Candidate(...) with its fields filled directly (a frozen dataclass without slots or checks of
            # its own): one per way to deliver each part's result, and the generated __init__ is most of it.
            cand = object.__new__(Candidate)
            cand.__dict__.update(
                choice=part.choice,
                targets=part.targets,
                steps=all_steps,
                computed=computed,
                out=target_out,
                resolution=resolution,
                flops=part.flops,
                time=part.compute_time + sum([c.time for c in all_steps]),
                comm_bytes=sum([c.bytes for c in all_steps]),
                sources=part.operands,
                unsplits_agreed=part.unsplits,
            )
            out.append(cand)
        return out


_UNSET = object()


def _with_operand(c: Collective, operand: Target | None) -> Collective:
    """``dataclasses.replace(c, operand=operand)`` without its generic machinery (a tenth of a fresh analysis):
    the record's fields as they are, the operand set."""
    new = object.__new__(Collective)
    d = new.__dict__  # a frozen dataclass without slots: fields filled as object.__setattr__ would
    d.update(c.__dict__)
    d["operand"] = operand
    return new


def _specs(en: _Enumeration) -> list[_Spec]:
    problem, classes = en.problem, en.classes
    size_of = problem.size_of
    mesh_sizes = en.mesh_sizes
    per_axis = options(problem)
    names = [m for m, _ in per_axis]
    result: list[_Spec] = []
    peak = en.profile.flops  # Profile.compute_time, inlined: this loop runs for every way to move the operands
    # Each variant with what every choice asks of it: the FLOPs of its local einsum before any split (the
    # axes it holds), the mesh axes its operands split, and whether any brings pending sums.
    variants = [
        (
            operands,
            pre,
            True in pre,
            2 * math.prod(size_of[a] for a in {a for op in operands for a in op.axes}),
            {m for op in operands for d in op.dims for m in d},
            any(op.unreduced for op in operands),
        )
        for operands, pre in _operand_variants(problem, classes)
    ]
    none_pending: list[frozenset[str]] = [frozenset()] * len(problem.operands)
    agreed = agreed_splits(problem)
    reduced = {e for e, c in classes.items() if c in (CONTRACTED, LONE)}
    for combo in itertools.product(*(opts for _, opts in per_axis)):
        choice = dict(zip(names, combo, strict=False))
        choice_items = tuple(choice.items())
        unsplit = False  # an agreed split dropped (gathered), if some operand variant holds it
        for m in agreed:
            if choice[m] is None:
                unsplit = True
                break
        # one pass over the choice: the mesh axes keeping each einsum axis, their product, the pending sums
        kept_on: dict[str, list[str]] = {}
        kept_product = 1
        pending: list[str] = []
        for m, e in choice_items:
            if e is not None:
                kept_on.setdefault(e, []).append(m)
                kept_product *= mesh_sizes[m]
                if e in reduced:
                    pending.append(m)
        pending_kept = frozenset(pending)
        if len(kept_on) == sum([len(ms) for ms in kept_on.values()]):  # one mesh axis each: one order
            orders_of: list[dict[str, tuple[str, ...]]] = [{e: (ms[0],) for e, ms in kept_on.items()}]
        else:
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
                        _Spec(choice_items, order, operands, flops, flops / peak, pending_kept, none_pending, unsplits)
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
                    result.append(_Spec(choice_items, order, operands, flops, flops / peak, pending_kept, ku, unsplits))
    return result


_IMPOSSIBLE = object()


def _part(en: _Enumeration, spec: _Spec) -> _Part | None:
    choice, order, operands, keep_u = spec.choice, spec.order, spec.operands, spec.keep_u
    memo = en.memo
    targets: list[Layout] = []
    steps: list[Collective] = []
    for i, op in enumerate(operands):
        dims = tuple([order.get(e, ()) for e in op.axes])
        key = (i, id(op), dims, keep_u[i])
        moved = memo.get(key)
        if moved is None:
            moved = _IMPOSSIBLE
            if dims == op.dims and keep_u[i] == op.unreduced:
                moved = (op, ())  # the operand as it is (the most common move: none)
            elif _fits(op.shape, dims, en.mesh_sizes):
                target = _derived(op, dims, keep_u[i])  # _fits checked the splits; choices never reuse a mesh axis
                st = en.transition(op, target, i)
                if st is not None:
                    moved = (target, st)
            memo[key] = moved
        if moved is _IMPOSSIBLE:  # an indivisible split or an impossible step: not a candidate
            return None
        targets.append(moved[0])  # type: ignore[index]
        steps.extend(moved[1])  # type: ignore[index]
    compute_time = spec.compute_time
    return _Part(
        choice,
        operands,
        tuple(targets),
        tuple(steps),
        tuple([order.get(e, ()) for e in en.problem.out_axes]),
        spec.pending_kept.union(*keep_u),
        spec.flops,
        compute_time,
        compute_time + sum([c.time for c in steps]),  # the same sum as a candidate's, over fewer steps
        spec.unsplits,
    )


def _outcomes(
    en: _Enumeration, out_dims: tuple[tuple[str, ...], ...], pending: frozenset[str], complete: bool = False
) -> tuple[Layout, list[tuple[str, Layout, tuple[Collective, ...]]]]:
    """The computed result and the ways to deliver it: (resolution, delivered layout, collectives), memoized.

    ``complete``: only the ways that deliver it complete (resolution ``'complete'``), when no layout is
    requested; the search for the best needs no other (they come first in the full list too)."""
    full = en.memo.get(("result", out_dims, pending))
    if full is not None:
        if complete:
            return full[0], [o for o in full[1] if o[0] == "complete"]  # type: ignore[index]
        return full  # type: ignore[return-value]
    key = ("complete" if complete else "result", out_dims, pending)
    hit = en.memo.get(key)
    if hit is not None:
        return hit  # type: ignore[return-value]
    problem = en.problem
    # valid by construction: the kept splits divide their axes (the operands holding them fit), and the
    # pending sums are over mesh axes that keep a summed axis or nothing
    computed = _unchecked(problem.out_axes, en.out_shape, problem.mesh, out_dims, pending)
    outs: list[tuple[str, Layout, tuple[Collective, ...]]] = []
    for resolution, target_out in _resolutions(problem, computed, en.mesh_sizes, complete):
        out_steps = en.transition(computed, target_out, "out")
        if out_steps is None:  # a pending sum the request cannot hold, an indivisible split
            continue
        outs.append((resolution, target_out, out_steps))
        split = _split_all_reduces(out_steps, en)
        if split is not None:
            outs.append((resolution, target_out, split))
    en.memo[key] = (computed, outs)
    return computed, outs


def _split_all_reduces(steps: tuple[Collective, ...], en: _Enumeration) -> tuple[Collective, ...] | None:
    """The same sums done as one all-reduce per mesh axis (what XLA emits when partial sums come from
    different dimensions), or None if no all-reduce spans several mesh axes.  It sends more bytes
    (2(n_i-1)/n_i of the buffer per axis instead of 2(n-1)/n once) over fewer ring hops (Σ2(n_i-1)
    instead of 2(n-1)), so it wins only for small, latency-bound buffers: a hierarchical all-reduce."""
    if not any(c.kind == "all-reduce" and len(c.axes) > 1 for c in steps):
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
    out = [("complete", _derived(computed, computed.dims, frozenset()))]
    if complete:
        return out
    pending = tuple(m.name for m in computed.mesh if m.name in computed.unreduced)
    for i in range(len(computed.axes)):
        dims = computed.dims[:i] + (computed.dims[i] + pending,) + computed.dims[i + 1 :]
        if _fits(computed.shape, dims, mesh_sizes):  # the pending axes split nothing: only divisibility to check
            out.append(("reduce-scatter", _derived(computed, dims, frozenset())))
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
