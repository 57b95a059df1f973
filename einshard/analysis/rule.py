"""The sharded-einsum rule: for each mesh axis, which einsum axis it keeps, and what that costs.

For every mesh axis ``a`` let S be the set of einsum axes that ``a`` splits in
some operand (plus the axis the requested output splits over ``a``).  The
options for ``a`` are: keep one ``e`` in S, or keep none.

* keep ``e``: an operand that splits another axis over ``a`` moves the split
  onto ``e`` with an all-to-all if it has ``e``, else gathers it; an operand
  that has ``e`` but is replicated over ``a`` slices it (free).  The local
  einsum then leaves the result split on ``e`` if ``e`` is a batch or free
  axis, or as pending partial sums ``{U:a}`` if ``e`` is contracted or
  lone-reduced.
* keep none: every operand is gathered over ``a``; the compute is duplicated.

This one rule covers the table of theory.md §a (rules 1-10) for any number of
operands; the product of the per-axis options is small and is enumerated.
Each option is turned into operand layouts, and :func:`transition` prices the
way there; the computed result is then taken to the requested output (or, with
none requested, completed with an all-reduce, with reduce-scatters onto each
dimension and the pending ``{U}`` result as alternatives).

Several mesh axes may keep one einsum axis (``x@(data,model)``): their
order (major to minor) is taken from the first operand that splits ``x``, and
an operand holding another order pays a collective-permute, because only
equal tuples hold matching blocks.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..layout import Layout, MeshAxis
from .cost import Collective, Profile
from .primitives import transition

__all__ = ["Problem", "Candidate", "classify", "enumerate_candidates"]

BATCH, FREE, CONTRACTED, LONE = "batch", "free", "contracted", "lone-reduced"


@dataclass(frozen=True)
class Problem:
    """One einsum to analyse: operand layouts, the output's axes, the requested output layout if any."""

    operands: tuple[Layout, ...]
    out_axes: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    mesh: tuple[MeshAxis, ...]
    requested: Layout | None
    itemsize: int
    profile: Profile

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)


@dataclass(frozen=True)
class Candidate:
    """One way to compute the einsum."""

    choice: tuple[tuple[str, str | None], ...]  # (mesh axis, einsum axis kept or None), mesh order
    targets: tuple[Layout, ...]  # operand layouts the local einsum runs on
    steps: tuple[Collective, ...]  # operand collectives, then result collectives
    computed: Layout  # the result as the local einsums leave it
    out: Layout  # the result as delivered
    resolution: str  # 'requested', 'complete', 'reduce-scatter', 'unreduced'
    flops: int  # per device
    time: float
    comm_bytes: int


def classify(operand_axes: tuple[tuple[str, ...], ...], out_axes: tuple[str, ...]) -> dict[str, str]:
    """Each einsum axis's class: batch, free, contracted or lone-reduced.

    Example:
        >>> classify((("b", "x", "z"), ("x", "y")), ("b", "y"))
        {'b': 'free', 'x': 'contracted', 'z': 'lone-reduced', 'y': 'free'}
        >>> classify((("b", "i", "j"), ("b", "j", "k")), ("b", "i", "k"))["b"]
        'batch'
    """
    out = set(out_axes)
    classes: dict[str, str] = {}
    for axes in operand_axes:
        for e in axes:
            if e in classes:
                continue
            n = sum(e in o for o in operand_axes)
            if e in out:
                classes[e] = BATCH if n >= 2 else FREE
            else:
                classes[e] = CONTRACTED if n >= 2 else LONE
    return classes


def _position(lay: Layout, m: str) -> str | None:
    for name, d in zip(lay.axes, lay.dims, strict=False):
        if m in d:
            return name
    return None


def options(problem: Problem) -> list[tuple[str, tuple[str | None, ...]]]:
    """Per mesh axis, the einsum axes it may keep (None: keep none), in mesh order."""
    out: list[tuple[str, tuple[str | None, ...]]] = []
    for m in problem.mesh:
        seen: list[str | None] = []
        for op in problem.operands:
            e = _position(op, m.name)
            if e is not None and e not in seen:
                seen.append(e)
        if problem.requested is not None:
            e = _position(problem.requested, m.name)
            if e is not None and e not in seen:
                seen.append(e)
        out.append((m.name, (*seen, None)))
    return out


def _kept_order(problem: Problem, e: str, kept: list[str]) -> tuple[str, ...]:
    order: list[str] = []
    sources = list(problem.operands) + ([problem.requested] if problem.requested is not None else [])
    for lay in sources:
        if e in lay.axes:
            for m in lay.dims[lay.axes.index(e)]:
                if m in kept and m not in order:
                    order.append(m)
    order.extend(m for m in kept if m not in order)
    return tuple(order)


def _fits(shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...], sizes: dict[str, int]) -> bool:
    return all(s % math.prod(sizes[m] for m in d) == 0 for s, d in zip(shape, dims, strict=False))


def enumerate_candidates(problem: Problem) -> list[Candidate]:
    """Every candidate (per-axis choices × output resolutions), unsorted, invalid ones dropped."""
    mesh_sizes = {m.name: m.size for m in problem.mesh}
    size_of = problem.size_of
    classes = classify(tuple(op.axes for op in problem.operands), problem.out_axes)
    total_flops = 2 * math.prod(size_of.values())
    per_axis = options(problem)
    names = [m for m, _ in per_axis]
    result: list[Candidate] = []
    kw = {"itemsize": problem.itemsize, "profile": problem.profile}
    for combo in itertools.product(*(opts for _, opts in per_axis)):
        choice = dict(zip(names, combo, strict=False))
        kept_on: dict[str, list[str]] = {}
        for m, e in choice.items():
            if e is not None:
                kept_on.setdefault(e, []).append(m)
        order = {e: _kept_order(problem, e, ms) for e, ms in kept_on.items()}
        # Pending sums an operand brings: kept when no other operand splits over that axis (linearity).
        keep_u: dict[int, frozenset[str]] = {}
        claimed: set[str] = set()
        for i, op in enumerate(problem.operands):
            mine = frozenset(m for m in op.unreduced if choice[m] is None and m not in claimed)
            claimed |= mine
            keep_u[i] = mine
        targets: list[Layout] = []
        steps: list[Collective] = []
        ok = True
        for i, op in enumerate(problem.operands):
            dims = tuple(order.get(e, ()) for e in op.axes)
            if not _fits(op.shape, dims, mesh_sizes):
                ok = False
                break
            target = Layout(op.axes, op.shape, op.mesh, dims, keep_u[i])
            _, st = transition(op, target, tensor=f"operand {i + 1}", **kw)  # type: ignore[arg-type]
            targets.append(target)
            steps.extend(st)
        if not ok:
            continue
        out_shape = tuple(size_of[e] for e in problem.out_axes)
        out_dims = tuple(order.get(e, ()) for e in problem.out_axes)
        pending = frozenset(m for m, e in choice.items() if e is not None and classes[e] in (CONTRACTED, LONE))
        pending |= frozenset().union(*keep_u.values()) if keep_u else frozenset()
        computed = Layout(problem.out_axes, out_shape, problem.mesh, out_dims, pending)
        kept_product = math.prod(mesh_sizes[m] for m, e in choice.items() if e is not None)
        flops = total_flops // kept_product
        compute_time = problem.profile.compute_time(flops)
        for resolution, out in _resolutions(problem, computed, mesh_sizes):
            try:
                _, out_steps = transition(computed, out, tensor="result", **kw)  # type: ignore[arg-type]
            except Exception:  # a pending sum the request cannot hold, an indivisible split
                continue
            all_steps = (*steps, *out_steps)
            time = compute_time + sum(c.time for c in all_steps)
            result.append(
                Candidate(
                    tuple(choice.items()),
                    tuple(targets),
                    all_steps,
                    computed,
                    out,
                    resolution,
                    flops,
                    time,
                    sum(c.bytes for c in all_steps),
                )
            )
    return result


def _resolutions(problem: Problem, computed: Layout, mesh_sizes: dict[str, int]) -> list[tuple[str, Layout]]:
    if problem.requested is not None:
        return [("requested", problem.requested)]
    if not computed.unreduced:
        return [("complete", computed)]
    out = [("complete", computed.with_dims(computed.dims, frozenset()))]
    pending = tuple(m.name for m in computed.mesh if m.name in computed.unreduced)
    for i in range(len(computed.axes)):
        dims = computed.dims[:i] + (computed.dims[i] + pending,) + computed.dims[i + 1 :]
        if _fits(computed.shape, dims, mesh_sizes):
            out.append(("reduce-scatter", computed.with_dims(dims, frozenset())))
    out.append(("unreduced", computed))
    return out


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Cheapest first (time, then bytes, then fewer collectives); equal candidates dropped."""
    seen: set[object] = set()
    ranked: list[Candidate] = []
    keyed = sorted(enumerate(candidates), key=lambda ic: (ic[1].time, ic[1].comm_bytes, len(ic[1].steps), ic[0]))
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
