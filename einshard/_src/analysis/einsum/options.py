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

This one rule covers the table of docs/theory.md §a (rules 1-10) for any number of
operands; the product of the per-axis options is small and is enumerated.
Each option is turned into operand layouts, and :func:`transition` prices the
way there; the computed result is then taken to the requested output (or, with
none requested, completed with an all-reduce, with reduce-scatters onto each
dimension and the pending ``{U}`` result as alternatives).

The search over these options (enumerating, pricing, pruning, ranking) is
:mod:`einshard.analysis.einsum.search`; the records they share (:class:`Problem`, :class:`Candidate`,
the axis classes) are :mod:`einshard.analysis.einsum.model`.

Several mesh axes may keep one einsum axis (``x@(data,model)``): their
order (major to minor) is taken from the first operand that splits ``x``, and
an operand holding another order pays a collective-permute, because only
equal tuples hold matching blocks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from ...core.layout import Layout
from .model import LONE, Problem

__all__ = ["agreed_splits", "fits", "kept_orders", "operand_variants", "options", "split_at", "splits_of"]


def split_at(lay: Layout) -> dict[str, str]:
    """``{mesh axis: the einsum axis it splits}`` (a valid layout uses a mesh axis at most once)."""
    out: dict[str, str] = {}
    for name, d in zip(lay.axes, lay.dims, strict=False):
        for m in d:
            out[m] = name
    return out


def splits_of(problem: Problem) -> list[dict[str, str]]:
    """:func:`split_at` of each operand, then of the requested result if there is one."""
    at = [split_at(op) for op in problem.operands]
    if problem.requested is not None:
        at.append(split_at(problem.requested))
    return at


def options(problem: Problem, at: Sequence[dict[str, str]] | None = None) -> list[tuple[str, tuple[str | None, ...]]]:
    """Per mesh axis, the einsum axes it may keep (None: keep none), in mesh order.

    A mesh axis of size 1 splits nothing: it keeps none.  ``at``: :func:`splits_of` the problem, if the
    caller has it.
    """
    if at is None:
        at = splits_of(problem)
    out: list[tuple[str, tuple[str | None, ...]]] = []
    for m in problem.mesh:
        seen: list[str | None] = []
        if m.size > 1:
            name = m.name
            for where in at:  # the operands, then the requested result
                e = where.get(name)
                if e is not None and e not in seen:
                    seen.append(e)
        out.append((m.name, (*seen, None)))
    return out


def kept_orders(problem: Problem, e: str, kept: list[str]) -> list[tuple[str, ...]]:
    """Orders (major to minor) for the mesh axes that keep ``e``: one per distinct order among the
    operands and the requested output (each completed with the rest in mesh order)."""
    if len(kept) == 1:
        return [tuple(kept)]
    orders: list[tuple[str, ...]] = []
    sources = list(problem.operands) + ([problem.requested] if problem.requested is not None else [])
    for lay in sources:
        if e in lay.axes:
            d = lay.dims[lay.axes.index(e)]
            order = tuple(m for m in d if m in kept)
            if order:
                order += tuple(m for m in kept if m not in order)
                if order not in orders:
                    orders.append(order)
    return orders or [tuple(kept)]


def fits(shape: tuple[int, ...], dims: tuple[tuple[str, ...], ...], sizes: dict[str, int]) -> bool:
    # loops, not generators: this runs for every candidate operand layout
    for s, d in zip(shape, dims, strict=False):
        if d:
            n = 1
            for m in d:
                n *= sizes[m]
            if s % n:
                return False
    return True


def _pre_reduced(op: Layout, lone: set[str]) -> Layout:
    """The operand with its lone-reduced axes summed locally: pending sums over the mesh axes that split them."""
    keep = [i for i, a in enumerate(op.axes) if a not in lone]
    pending = frozenset(m for i, a in enumerate(op.axes) if a in lone for m in op.dims[i])
    # valid by construction: the summed axes' mesh axes split nothing else and held no pending sums
    return Layout._derive(
        tuple(op.axes[i] for i in keep),
        tuple(op.shape[i] for i in keep),
        op.mesh,
        tuple(op.dims[i] for i in keep),
        op.unreduced | pending,
    )


def operand_variants(problem: Problem, classes: dict[str, str]) -> list[tuple[tuple[Layout, ...], tuple[bool, ...]]]:
    """The operands as given, and with their lone-reduced axes summed locally first (XLA does this:
    ``sum_a x[b, a@x]`` becomes partial sums of ``[b]`` before the contraction, and a gather or
    all-to-all then moves the smaller array)."""
    if LONE not in classes.values():  # the common einsum: no lone-reduced axis, the operands as given only
        return [(problem.operands, (False,) * len(problem.operands))]
    per_op: list[list[tuple[Layout, bool]]] = []
    for op in problem.operands:
        lone = {a for a in op.axes if classes[a] == LONE}
        per_op.append([(op, False)] + ([(_pre_reduced(op, lone), True)] if lone else []))
    return [(tuple(lay for lay, _ in combo), tuple(flag for _, flag in combo)) for combo in itertools.product(*per_op)]


def agreed_splits(problem: Problem, where: Sequence[dict[str, str]] | None = None) -> dict[str, str]:
    """Mesh axes every operand agrees on: ``{m: e}`` where each operand holding einsum axis ``e`` splits
    it over ``m`` (at least two do, or ``e`` is lone-reduced) and no operand splits anything else over ``m``.
    ``where``: :func:`splits_of` the problem, if the caller has it.

    Example:
        >>> from einshard.placement import Layout, MeshAxis
        >>> mesh = (MeshAxis("x", 8),)
        >>> a = Layout(("b", "d"), (8, 16), mesh, (("x",), ()))
        >>> c = Layout(("b", "f"), (8, 16), mesh, (("x",), ()))
        >>> agreed_splits(Problem((a, c), ("d", "f"), (("b", 8), ("d", 16), ("f", 16)), mesh, None, 4, None))
        {'x': 'b'}
    """
    if where is None:
        where = splits_of(problem)
    operands = problem.operands
    out: dict[str, str] = {}
    for m in problem.mesh:
        if m.size == 1:
            continue
        e = None
        for i in range(len(operands)):  # the one einsum axis the operands split over m, if there is one
            f = where[i].get(m.name)
            if f is not None:
                if e is not None and f != e:
                    break
                e = f
        else:
            if e is None:
                continue
            holders = 0
            for i, op in enumerate(operands):
                if e in op.axes:
                    holders += 1
                    if where[i].get(m.name) != e:
                        holders = -1
                        break
            if holders >= 2 or (holders == 1 and e not in problem.out_axes):
                out[m.name] = e
    return out
