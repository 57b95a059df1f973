"""Layout rules for ops that read along a whole axis: sort, top_k, cumulative ops, argmax, rev, split, stacking.

Each rule states what XLA's SPMD partitioner compiles for the op on a split axis (one-op programs on the
8-CPU-device mesh, read from ``.compile().as_text()``; tests/test_primitive_rules.py checks them):

* ``sort`` along a split axis moves the split to another axis that divides (one all-to-all per operand,
  the keys and argsort's iota alike), sorts locally, and moves each result that is read back (one
  all-to-all each); with no axis to move to, the operand is gathered and the result stays whole;
* ``top_k`` gathers its operand whole (every split, batch axes included) and keeps the batch axes'
  splits on the result (a local slice);
* ``cumsum``/``cumprod``/``cummax``/``cummin``/``cumlogsumexp`` gather the scanned axis and keep its split
  on the result;
* ``argmax``/``argmin`` over a split axis all-gather each device's (value, index) candidates: two small
  all-gathers, not an all-reduce;
* ``rev`` of a split axis: device ``k``'s block comes from device ``n-1-k``, one collective-permute;
* ``split`` along a split axis: each piece is a slice, its halos exchanged as XLA does
  (:func:`.slice_halo.slice_move`): collective-permutes, or the axis gathered once;
* ``stack`` lines its operands up as an elementwise op does and adds an unsplit axis; ``unstack`` of a
  split axis gathers that axis (each piece is one device's).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout
from .costing import is_free
from .movement import charge, group_size, itemsize, mark_approximate
from .registry import register, sharding_degree
from .rules_structural import ARG_REDUCTIONS, CUMULATIVE, elementwise, widen_bound
from .slice_halo import slice_move

if TYPE_CHECKING:
    from .registry import WalkerLike as Walker  # the rules type against the protocol, not walker.py

__all__ = ["sort", "top_k", "cumulative", "arg_reduction", "rev", "split", "stack", "unstack"]


def _local_bytes(lay: Layout, dtype: Any) -> int:
    n = 1
    for size in lay.shard_shape:
        n *= size
    return n * itemsize(dtype)


def _unsplit(lay: Layout, axis: int) -> Layout:
    return lay.with_dims(tuple(() if i == axis else d for i, d in enumerate(lay.dims)))


def _is_dropped(w: Walker, eqn: Any, v: Any) -> bool:
    """Whether nothing reads a result (argsort's sorted keys): XLA removes what computes it."""
    if type(v).__name__ == "DropVar":
        return True
    if id(v) in w.uses or id(v) in w.program_outputs:
        return False
    for jaxpr, _ in w.costs._uses.values():  # the jaxpr holding eqn: is v one of its results?
        if any(e is eqn for e in jaxpr.eqns):
            return not any(o is v for o in jaxpr.outvars)
    return False


def _lead(ins: list[Layout]) -> Layout | None:
    """The most split operand that is not free (a sort's keys over argsort's iota)."""
    real = [lay for lay in ins if not is_free(lay)]
    return max(real, key=sharding_degree) if real else None


@register("sort")
def sort(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    dim = int(eqn.params["dimension"])
    lead = _lead(ins)
    if lead is None:
        return [w.free(v.aval) for v in eqn.outvars]
    for v, lay in zip(eqn.invars, ins):
        if not is_free(lay) and lay.dims != lead.dims:
            w.change(eqn, phase, lay, lay.with_dims(lead.dims), v.aval.dtype, repeat, "sort operands disagree")
    axes = lead.dims[dim]
    if not axes:
        return [w.relayout(v.aval, lead.dims) for v in eqn.outvars]
    n = group_size(w, axes)
    # XLA moves the split to the first other axis that still divides, sorts, and moves it back.
    to = next(
        (i for i, size in enumerate(lead.shape) if i != dim and size % (n * group_size(w, lead.dims[i])) == 0),
        None,
    )
    if to is None:
        whole = _unsplit(lead, dim)
        for v in eqn.invars:
            w.change(eqn, phase, lead, whole, v.aval.dtype, repeat, "sort along a split axis with nowhere to move it")
        return [w.relayout(v.aval, whole.dims) for v in eqn.outvars]
    arrays = [_local_bytes(lead, v.aval.dtype) for v in eqn.invars]
    arrays += [_local_bytes(lead, v.aval.dtype) for v in eqn.outvars if not _is_dropped(w, eqn, v)]
    charge(w, eqn, phase, repeat, "all-to-all", axes, arrays, "sort along a split axis: split moved away and back")
    return [w.free(v.aval) if _is_dropped(w, eqn, v) else w.relayout(v.aval, lead.dims) for v in eqn.outvars]


@register("top_k")
def top_k(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src = ins[0]
    if is_free(src):
        return [w.free(v.aval) for v in eqn.outvars]
    last = len(src.shape) - 1
    # Gathered whole, one split axis at a time from the last (measured: [16@data, 32@model] gathers
    # [4, 32] over model, then [16, 32] over data).
    dims = list(src.dims)
    for i in reversed(range(len(dims))):
        if dims[i]:
            step = src.with_dims(tuple(dims))
            dims[i] = ()
            w.change(eqn, phase, step, src.with_dims(tuple(dims)), eqn.invars[0].aval.dtype, repeat, "top_k gathers")
    if any(src.dims):
        w.bind_copy(eqn.invars[0], src.with_dims(tuple(dims)))  # the gathered copy is live while top_k runs
    return [w.relayout(v.aval, _unsplit(src, last).dims) for v in eqn.outvars]


@register(*CUMULATIVE)
def cumulative(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src = ins[0]
    if is_free(src):
        return [w.free(v.aval) for v in eqn.outvars]
    axis = int(eqn.params["axis"])
    if src.dims[axis]:
        why = f"{eqn.primitive.name} along a split axis"
        w.change(eqn, phase, src, _unsplit(src, axis), eqn.invars[0].aval.dtype, repeat, why)
    return [w.relayout(v.aval, src.dims) for v in eqn.outvars]


@register(*ARG_REDUCTIONS)
def arg_reduction(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src = ins[0]
    out_aval = eqn.outvars[0].aval
    if is_free(src):
        return [w.free(out_aval)]
    axes = tuple(eqn.params["axes"])
    kept = [d for i, d in enumerate(src.dims) if i not in axes]
    out = w.relayout(out_aval, kept)
    split = tuple(m for i in axes for m in src.dims[i])
    if split:
        n = group_size(w, split)
        local = 1
        for size in out.shard_shape:
            local *= size
        # Each device's best (value, index) pair is gathered, then reduced locally.
        arrays = [local * n * itemsize(eqn.invars[0].aval.dtype), local * n * itemsize(out_aval.dtype)]
        charge(w, eqn, phase, repeat, "all-gather", split, arrays, f"{eqn.primitive.name} over a split axis", out)
    return [out]


@register("reduce")
def variadic_reduce(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """``lax.reduce`` with a computation of several operands (``jnp.minmax`` on jax 0.12): the operands are
    reduced locally, and over a split reduced axis each result's per-device partials are all-gathered (XLA has
    no all-reduce for a tuple computation) and reduced again; measured on (4, 2): (16, 32) split (None, 'a')
    → two all-gathers of f32[16, 4], one per result, over 'a'.  Not on the memory walk: the gathered partials
    are scratch (memory.SCRATCH's sort and scan family)."""
    n = len(eqn.outvars)
    operands = ins[:n]  # then as many init values (scalars)
    src = next((lay for lay in operands if not is_free(lay)), None)
    if src is None:
        return [w.free(v.aval) for v in eqn.outvars]
    for k, lay in enumerate(operands):
        if not is_free(lay) and lay.dims != src.dims:
            w.change(eqn, phase, lay, src, eqn.invars[k].aval.dtype, repeat, "reduce operands brought to one split")
    axes = tuple(eqn.params["dimensions"])
    kept = [d for i, d in enumerate(src.dims) if i not in axes]
    outs = [w.relayout(v.aval, kept) for v in eqn.outvars]
    count = 1
    for i in sorted(axes, reverse=True):
        if src.dims[i]:
            # One split axis at a time, minor first; the candidates gathered so far travel on (measured: (16, 32)
            # split ('b', 'a') reduced whole -> f32[1,4] over 'a', then f32[2,4] over 'b', per result).
            count *= group_size(w, src.dims[i])
            arrays = [math.prod(o.shard_shape) * count * itemsize(v.aval.dtype) for o, v in zip(outs, eqn.outvars)]
            why = "reduce over a split axis (per-device partials)"
            charge(w, eqn, phase, repeat, "all-gather", src.dims[i], arrays, why)
    return outs


@register("rev")
def rev(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src = ins[0]
    if is_free(src):
        return [w.free(eqn.outvars[0].aval)]
    axes = tuple(m for i in eqn.params["dimensions"] for m in src.dims[i])
    if axes:
        # Device k's block of the result is device n-1-k's block of the operand, reversed: one permute.
        arrays = [_local_bytes(src, eqn.invars[0].aval.dtype)]
        charge(w, eqn, phase, repeat, "collective-permute", axes, arrays, "rev of a split axis", src)
    return [w.relayout(eqn.outvars[0].aval, src.dims)]


@register("split")
def split(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src = ins[0]
    if is_free(src):
        return [w.free(v.aval) for v in eqn.outvars]
    axis = int(eqn.params["axis"])
    axes = src.dims[axis]
    if not axes:
        return [w.relayout(v.aval, src.dims) for v in eqn.outvars]
    n = group_size(w, axes)
    dtype = eqn.invars[0].aval.dtype
    row = _local_bytes(src, dtype) // src.shard_shape[axis]  # one position along the axis, per device
    outs: list[Layout] = []
    offset = 0
    block = src.shape[axis] // n
    uneven_from: int | None = None  # where the first uneven piece's gather was recorded
    gathered = False  # whether the operand's axis was gathered for a piece (XLA gathers it once)
    for v in eqn.outvars:
        size = int(v.aval.shape[axis])
        start = len(w.ops)
        if size % n:
            # XLA splits such a piece unevenly (padded); explain gathers the axis for it instead.
            whole = _unsplit(src, axis)
            w.change(eqn, phase, src, whole, dtype, repeat, "split piece does not divide")
            mark_approximate(w, start, f"a piece of {size} does not divide {n} ways; XLA pads it, explain gathers")
            # XLA keeps each padded piece split and moves it on its own: its blocks into place (permutes or
            # all-to-alls, up to n - 1), then gathers it or, in a gradient, moves its cotangent back into the
            # operand's split (up to n - 1 more).  Explain's one gather serves every uneven piece, so each piece
            # widens the mark to 2 (n - 1) collectives (measured: the gradient of a 17 + 15 column split over 8
            # takes 5 permutes and 3 all-to-alls, of a 1 + 15 split over 2 one permute and 3 all-to-alls, where
            # explain gathers once; rows split 3 + 13 over 2 two permutes and two all-gathers).
            own = n - 1 if len(w.ops) > start else 0  # the bound the piece's own gather already carries
            widen_bound(w, start if own or uneven_from is None else uneven_from, collectives=2 * (n - 1) - own)
            uneven_from = start if uneven_from is None else uneven_from
            # Peak: explain holds the gathered operand and the piece whole where XLA holds padded pieces
            # (measured on the gradient of x[:, :1], x[:, 1:] of cols@a over 8: explain 2.0x XLA's peak).
            whole_bytes = _local_bytes(whole, dtype)
            widen_bound(w, start, peak=whole_bytes + whole_bytes * size // src.shape[axis])
            outs.append(w.relayout(v.aval, whole.dims))
        else:
            if not _is_dropped(w, eqn, v):
                # Each piece is a slice: XLA's halo exchange for it (.slice_halo: measured per permute).
                move = slice_move(src.shape[axis], n, size, offset)
                if move.how == "gather" and not gathered:
                    # Halos past the neighbours: the operand's axis gathered once (XLA's reshard cache serves
                    # every piece that falls back), each piece sliced locally.
                    arrays = [_local_bytes(_unsplit(src, axis), dtype)]
                    charge(w, eqn, phase, repeat, "all-gather", axes, arrays, "split: halos past the neighbours")
                    gathered = True
                arrays = [p * row for p in move.permutes]
                charge(w, eqn, phase, repeat, "collective-permute", axes, arrays, "split along a split axis")
                if move.permutes and size // n < block:
                    why = "pieces into blocks smaller than the operand's: XLA's peak holds each permute's buffers"
                    mark_approximate(w, start, why)
                    # Peak: XLA holds each permute's send and receive buffers besides the operand and the
                    # pieces (measured: 64 columns split 40 + 24 over 8, XLA's peak 3.1x explain's).
                    widen_bound(w, start, peak=2 * sum(arrays))
            outs.append(w.relayout(v.aval, src.dims))
        offset += size
    return outs


@register("stack")
def stack(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    axis = int(eqn.params["axis"])
    out_aval = eqn.outvars[0].aval
    # The operands line up as an elementwise op's would (the result's layout without the new axis).
    lined = elementwise(w, _Without(eqn, axis), ins, repeat, phase)[0]
    if is_free(lined):
        return [w.free(out_aval)]
    dims = list(lined.dims)
    dims.insert(axis, ())
    return [w.relayout(out_aval, dims)]


class _Without:
    """An equation seen as the elementwise op over its operands (its result without the stacked axis)."""

    def __init__(self, eqn: Any, axis: int) -> None:
        import jax

        self.primitive = eqn.primitive
        self.params = eqn.params
        self.invars = eqn.invars
        self.source_info = eqn.source_info
        aval = eqn.outvars[0].aval
        shape = tuple(s for i, s in enumerate(aval.shape) if i != axis)
        self.outvars = [_Var(jax.core.ShapedArray(shape, aval.dtype))]


class _Var:
    def __init__(self, aval: Any) -> None:
        self.aval = aval


@register("unstack")
def unstack(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src = ins[0]
    axis = int(eqn.params["axis"])
    if is_free(src):
        return [w.free(v.aval) for v in eqn.outvars]
    dims = [d for i, d in enumerate(src.dims) if i != axis]
    if src.dims[axis]:
        # Each piece lies in one device's block: XLA masks the others and all-reduces the piece. A piece held
        # by a later device is sometimes first moved by a collective-permute (measured: index 8 of 16 over 2
        # devices, not index 2 of 16 over 8): marked approximate.
        block = src.shape[axis] // group_size(w, src.dims[axis])
        read = [(k, v) for k, v in enumerate(eqn.outvars) if not _is_dropped(w, eqn, v)]
        arrays = [_local_bytes(w.relayout(v.aval, dims), v.aval.dtype) for _, v in read]
        start = len(w.ops)
        charge(w, eqn, phase, repeat, "all-reduce", src.dims[axis], arrays, "unstack of a split axis")
        if any(k >= block for k, _ in read):
            mark_approximate(w, start, "a piece on a later device: XLA may first move it (one collective-permute)")
    # Pieces nobody reads are removed by XLA: no buffer (a free layout costs no memory).
    return [w.free(v.aval) if _is_dropped(w, eqn, v) else w.relayout(v.aval, dims) for v in eqn.outvars]
