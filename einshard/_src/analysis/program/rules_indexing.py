"""Layout rules for the primitives that combine operands: dot_general, gather, scatter, dynamic_update_slice.

``dot_general`` is an einsum: the per-einsum analyzer prices it.  ``gather``
and ``scatter`` follow XLA's SPMD partitioner:

* batching dimensions (``operand_batching_dims``: ``take_along_axis``, optax's
  integer-label cross-entropy) pair an operand axis with an index axis: a
  batch split on both is local, no gather;
* a table split along the axis it is indexed by (a vocab-parallel embedding or
  head) is gathered locally with a mask, and the small result all-reduced over
  the table's mesh axes — the table is never gathered;
* a scatter-add whose updates are split along their scatter (index) axes adds
  into a local copy of the result: one all-reduce over those mesh axes (the
  embedding gradient under data parallelism);
* a scatter-add of constant updates into zeros along batching dimensions (the
  integer-label cross-entropy's gradient) is split like its indices.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout
from .costing import is_free
from .registry import register
from .rules_structural import explicit_dims
from .values import CARRIERS, Partial

if TYPE_CHECKING:
    from .registry import WalkerLike as Walker  # the rules type against the protocol, not walker.py

__all__ = ["leaves_program"]


@register("dot_general")
def dot_general(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    dn = eqn.params["dimension_numbers"]
    summed = [w.summed.get(id(v), frozenset()) for v in eqn.invars[:2]]
    lhs, rhs = match_contracting(ins[0], ins[1], dn, w.costs.mesh_sizes, summed)
    res = w.costs.dot(lhs, rhs, dn, w.dtype(eqn))
    sums = frozenset(m for c in res.collectives if c.kind == "all-reduce" and c.tensor == "result" for m in c.axes)
    if sums:
        w.summed[id(eqn.outvars[0])] = sums
    colls = per_contracted_axis(w, res.collectives, lhs, dn)
    out_dims = res.out.dims
    pending: frozenset[str] = frozenset()
    if sums:
        out_dims, colls = scatter_to_consumers(w, eqn, res.out, colls, sums)
        if out_dims == res.out.dims:  # summed whole: the partial buffer waits for its all-reduce
            w.env[Partial(eqn.outvars[0])] = res.out.with_dims(res.out.dims, sums)
            stages = [c for c in colls if c.kind == "all-reduce" and c.tensor == "result"]
            if len(stages) == 1 and leaves_program(w, eqn.outvars[0]):
                # A gradient that only leaves the program: XLA sums it to the output's layout
                # (a reduce-scatter to an FSDP weight's split, an all-reduce to a replicated one).
                # It stays pending; the output's layout settles it.
                colls = tuple(c for c in colls if c is not stages[0])
                pending = frozenset(stages[0].axes)
    for c in colls:
        tensor = getattr(c, "tensor", "")
        if c.kind == "all-gather" and tensor.startswith("operand "):
            k = int(tensor.split()[1]) - 1
            lay = ins[k]
            w.bind_copy(eqn.invars[k], lay.with_dims(tuple(tuple(m for m in d if m not in c.axes) for d in lay.dims)))
    time_s = res.time_s - sum(c.time for c in res.collectives) + sum(c.time for c in colls)
    kept = tuple(c for c in colls if not w.already_moved(ins, c))
    if len(kept) != len(colls):
        # An operand another dot already brought to the same layout (an FSDP weight gathered for the
        # forward and again for the backward): XLA computes that gather once.
        time_s -= sum(c.time for c in colls if c not in kept)
        colls = kept
    out = w.relayout(eqn.outvars[0].aval, out_dims)
    w.record(eqn, phase, res.expression, out, colls, res.flops, time_s, repeat)
    return [out.with_dims(out.dims, pending) if pending else out]


def leaves_program(w: Walker, var: Any) -> bool:
    """Whether ``var`` is read only on its way out of the program (through transposes, conversions)."""
    v = var
    while True:
        uses = w.uses.get(id(v), [])
        if id(v) in w.program_outputs:
            return not uses
        if len(uses) != 1 or uses[0][0].primitive.name not in CARRIERS:
            return False
        v = uses[0][0].outvars[0]


def consumer_split(w: Walker, var: Any, out: Layout, sums: frozenset[str]) -> list[tuple[str, ...]] | None:
    """The split a dot's summed result takes from a consumer dot (XLA's sharding propagation, backwards).

    A dot whose contraction is split over mesh axes M leaves a partial sum; XLA gives it the
    layout its consumers ask for.  Where a consumer dot contracts an axis of it whose partner
    operand (already laid out) splits that axis over M, the sum lands split that way: a
    reduce-scatter, not an all-reduce (the attention backward's dK/dV under sequence
    parallelism: the weight gradient contracts them with the sequence-split activations).
    Every other consumer then sees the split value (a bias gradient summing it over the
    sequence all-reduces over ``model`` once more, as XLA does).  Followed through transposes
    and dtype conversions; the first such consumer decides, as XLA's propagation takes one.
    """
    used = {m for d in out.dims for m in d}
    frontier: list[tuple[Any, tuple[int, ...]]] = [(var, tuple(range(len(out.dims))))]
    while frontier:
        v, axis_of = frontier.pop(0)  # axis_of[i]: the dot result's axis that is v's axis i
        for eqn, k in w.uses.get(id(v), ()):
            name = eqn.primitive.name
            if name == "transpose":
                perm = eqn.params["permutation"]
                frontier.append((eqn.outvars[0], tuple(axis_of[p] for p in perm)))
            elif name in CARRIERS:
                frontier.append((eqn.outvars[0], axis_of))
            elif name == "reshape":
                mapped = _reshape_axes(tuple(v.aval.shape), tuple(eqn.outvars[0].aval.shape))
                frontier.append((eqn.outvars[0], tuple(-1 if i < 0 else axis_of[i] for i in mapped)))
            elif name in PLACEMENTS:
                # A placement asks for its layout outright: the exit of a jax.sharding.auto_axes region
                # (out_sharding=, or the transpose of its entry: a weight gradient resharded to the weight's
                # FSDP split) takes the sum split there, a reduce-scatter, as XLA compiles it.
                for i, split in enumerate(placement_dims(eqn)):
                    axis = axis_of[i] if i < len(axis_of) else -1
                    if axis < 0 or not split or not set(split) <= sums or set(split) & used:
                        continue
                    if out.shape[axis] % math.prod(w.costs.mesh_sizes[m] for m in split) == 0:
                        return [split if a == axis else d for a, d in enumerate(out.dims)]
            elif name == "dot_general" and k < 2:
                partner = w.env.get(eqn.invars[1 - k])
                if partner is None or is_free(partner) or partner.unreduced:
                    continue
                (lc, rc), _ = eqn.params["dimension_numbers"]
                mine, theirs = (lc, rc) if k == 0 else (rc, lc)
                for i, j in zip(mine, theirs):
                    split = partner.dims[j]
                    axis = axis_of[i]
                    n = math.prod(w.costs.mesh_sizes[m] for m in split)
                    if axis < 0 or not split or not set(split) <= sums or set(split) & used:
                        continue
                    if out.shape[axis] % n == 0:
                        return [split if a == axis else d for a, d in enumerate(out.dims)]
    return None


# Equations that lay a value out as their parameters say.
PLACEMENTS = frozenset({"reshard", "sharding_constraint", "device_put"})


def placement_dims(eqn: Any) -> list[tuple[str, ...]]:
    """The mesh axes a placement equation splits each axis of its result over (unconstrained entries: none)."""
    sh = eqn.params.get("sharding") or eqn.params.get("dst_sharding")
    if isinstance(sh, (list, tuple)):
        sh = sh[0] if sh else None
    spec = getattr(sh, "spec", None)
    if spec is None:
        return []
    out: list[tuple[str, ...]] = []
    for e in spec:
        out.append((e,) if isinstance(e, str) else tuple(e) if isinstance(e, tuple) else ())
    return out


def _reshape_axes(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    """For each axis of a reshape's result, the operand axis a split of it lands on (-1: none).

    Axes kept whole map one to one; a merged axis maps to the major axis of the merged group and
    the major piece of a split axis to the axis it came from (a split of those divides the same
    rows); every other piece is -1.
    """
    out = [-1] * len(dst)
    i = j = 0
    while i < len(src) and j < len(dst):
        i0, j0 = i, j
        a, b = src[i], dst[j]
        while a != b:
            if a < b:
                i += 1
                a *= src[i] if i < len(src) else 0
            else:
                j += 1
                b *= dst[j] if j < len(dst) else 0
            if i >= len(src) or j >= len(dst):
                return tuple(out)
        while i0 < i and src[i0] == 1:  # size-1 axes carry no split
            i0 += 1
        while j0 < j and dst[j0] == 1:
            j0 += 1
        out[j0] = i0
        i, j = i + 1, j + 1
    return tuple(out)


def scatter_to_consumers(
    w: Walker, eqn: Any, out: Layout, colls: tuple[Any, ...], sums: frozenset[str]
) -> tuple[tuple[tuple[str, ...], ...], tuple[Any, ...]]:
    """A dot's result all-reduce becomes a reduce-scatter where a consumer takes the sum split (see above)."""
    dims = consumer_split(w, eqn.outvars[0], out, sums)
    if dims is None:
        return out.dims, colls
    scattered = {m for d in dims for m in d} - {m for d in out.dims for m in d}
    drop = [c for c in colls if c.kind == "all-reduce" and c.tensor == "result" and set(c.axes) <= scattered]
    if not drop:
        return out.dims, colls
    pending = out.with_dims(out.dims, frozenset(m for c in drop for m in c.axes))
    dst = w.relayout(eqn.outvars[0].aval, dims)
    moved = w.costs.reshard(pending, out.with_dims(dst.dims), eqn.outvars[0].aval.dtype)
    return dst.dims, tuple(c for c in colls if c not in drop) + tuple(moved)


def match_contracting(
    lhs: Layout, rhs: Layout, dn: Any, sizes: dict[str, int], summed: list[frozenset[str]]
) -> tuple[Layout, Layout]:
    """Slice a whole operand that XLA just summed to its partner's contracted split (XLA's propagation).

    Where one operand splits a contracted axis over mesh axes M and the other holds it whole
    *because it is the all-reduced result of a dot that summed over M* (``summed``: the
    attention backward's dK/dV under sequence parallelism), XLA keeps that value in its
    partial-sum form, slices it locally to the partner's split and sums the partial products
    once more: the weight gradient of sequence-split activations is all-reduced over
    ``model`` then ``data``, never gathered.  A whole operand of any other origin is left to
    the analyzer's cost choice (for an isolated dot XLA gathers the split operand when that is
    cheaper, as the analyzer does).  Only when M is free in the whole operand and divides its axis.
    """
    if is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return lhs, rhs
    (lc, rc), _ = dn
    ldims, rdims = list(lhs.dims), list(rhs.dims)

    def used(dims: list[tuple[str, ...]]) -> set[str]:
        return {m for d in dims for m in d}

    for i, j in zip(lc, rc):
        split_l, split_r = ldims[i], rdims[j]
        if split_l and not split_r and set(split_l) <= summed[1] and not set(split_l) & used(rdims):
            if rhs.shape[j] % math.prod(sizes[m] for m in split_l) == 0:
                rdims[j] = split_l
        elif split_r and not split_l and set(split_r) <= summed[0] and not set(split_r) & used(ldims):
            if lhs.shape[i] % math.prod(sizes[m] for m in split_r) == 0:
                ldims[i] = split_r
    if tuple(ldims) != lhs.dims:
        lhs = lhs.with_dims(tuple(ldims))
    if tuple(rdims) != rhs.dims:
        rhs = rhs.with_dims(tuple(rdims))
    return lhs, rhs


def per_contracted_axis(w: Walker, colls: tuple[Any, ...], lhs: Layout, dn: Any) -> tuple[Any, ...]:
    """XLA sums a dot's partial products one contracted axis at a time (minor axis first).

    An all-reduce the analyzer names over mesh axes that split *different* contracted axes
    (``b@data s@model d, b@data s@model f -> d f``) is, in XLA's HLO, one all-reduce per axis:
    over ``model``, then over ``data``.  (One contracted axis split over a tuple stays one.)
    """
    (lc, _), _ = dn
    groups = [lhs.dims[i] for i in sorted(lc, reverse=True) if lhs.dims[i]]
    if len(groups) < 2:
        return colls
    out: list[Any] = []
    for c in colls:
        parts = [tuple(m for m in g if m in c.axes) for g in groups]
        parts = [p for p in parts if p]
        if c.kind != "all-reduce" or len(parts) < 2 or sum(len(p) for p in parts) != len(c.axes):
            out.append(c)
            continue
        for p in parts:
            n = math.prod(w.costs.mesh_sizes[m] for m in p)
            sent = 2 * (n - 1) / n * c.array_bytes
            t = w.costs.profile.collective_time("all-reduce", n, sent, c.array_bytes)
            out.append(replace(c, axes=p, group_size=n, bytes=int(sent), time=t))
    return tuple(out)


def _agree(
    w: Walker, eqn: Any, phase: str, repeat: int, a: Layout, i: int, b: Layout, j: int, why: str
) -> tuple[tuple[str, ...], Layout, Layout]:
    """Axis ``i`` of ``a`` and axis ``j`` of ``b`` must be split alike: bring the less split one over."""
    da, db = a.dims[i], b.dims[j]
    if da == db or is_free(b):
        return da, a, b
    if is_free(a):
        return db, a, b
    dtype = eqn.outvars[0].aval.dtype
    if len(da) >= len(db) and not (set(da) - set(db)) & set(m for d in b.dims for m in d):
        nb = b.with_dims(tuple(da if k == j else d for k, d in enumerate(b.dims)))
        w.change(eqn, phase, b, nb, dtype, repeat, why)
        return da, a, nb
    # Axis i takes b's split; a mesh axis of it that splits another axis of a is gathered there first
    # (a Layout never names a mesh axis twice).
    na = a.with_dims(tuple(db if k == i else tuple(m for m in d if m not in db) for k, d in enumerate(a.dims)))
    w.change(eqn, phase, a, na, dtype, repeat, why)
    return db, na, b


@register("gather")
def gather(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    operand, indices = ins[0], ins[1]
    out_aval = eqn.outvars[0].aval
    dtype = out_aval.dtype
    dn = eqn.params["dimension_numbers"]
    sizes = eqn.params["slice_sizes"]
    out_rank = len(out_aval.shape)
    offset_dims = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    if is_free(operand):
        operand = w.replicated(operand)
    # 1. batching axes: operand and indices split alike (the common case: both follow the batch).
    batch_dims = {}
    for ob, ib in zip(op_batch, idx_batch):
        d, operand, indices = _agree(w, eqn, phase, repeat, operand, ob, indices, ib, "gather batch axes disagree")
        batch_dims[ib] = d
    # 2. indexed axes: a split one is gathered locally under a mask and the result summed (slice size 1),
    #    or gathered whole first (a window across devices).
    indexed = [i for i in range(len(operand.shape)) if sizes[i] != operand.shape[i] and i not in op_batch]
    masked: tuple[str, ...] = ()
    for i in indexed:
        if not operand.dims[i]:
            continue
        if sizes[i] == 1:
            masked += operand.dims[i]
        else:
            whole = operand.with_dims(tuple(() if k == i else d for k, d in enumerate(operand.dims)))
            w.change(eqn, phase, operand, whole, dtype, repeat, "gather windows across a sharded axis")
            operand = whole
    idx_used = {m for d in indices.dims for m in d}
    kept = [i for i in range(len(operand.shape)) if i not in collapsed and i not in op_batch]
    batch_out = [d for d in range(out_rank) if d not in offset_dims]

    def result_dims(idx: Layout, by_batch: dict[int, tuple[str, ...]]) -> list[tuple[str, ...]]:
        dims: list[tuple[str, ...]] = [()] * out_rank
        for out_dim, op_dim in zip(offset_dims, kept):
            dims[out_dim] = () if op_dim in indexed else operand.dims[op_dim]
        for out_dim, idx_dim in zip(batch_out, range(len(idx.shape) - 1)):
            dims[out_dim] = by_batch.get(idx_dim, idx.dims[idx_dim])
        return dims

    # The split the result would have if the indices kept theirs: where they meet the table, XLA
    # sums the masked lookup back into it (all-reduce + slice: a reduce-scatter), so the batch
    # split survives the lookup (an FSDP embedding table split over the batch's own axis).
    wanted = result_dims(indices, batch_dims)
    if set(masked) & idx_used:
        # The indices are split over a mesh axis that also splits the table: the masked lookup
        # needs every index on every table shard: XLA gathers the (small) indices first.
        keep = tuple(tuple(m for m in d if m not in masked) for d in indices.dims)
        w.change(eqn, phase, indices, indices.with_dims(keep), indices_dtype(eqn), repeat, "gather: indices meet table")
        indices = indices.with_dims(keep)
        batch_dims = {k: tuple(m for m in d if m not in masked) for k, d in batch_dims.items()}
    dims = w.settle_repeats(
        eqn, phase, out_aval, result_dims(indices, batch_dims), repeat, "gather result split twice over a mesh axis"
    )
    out = w.relayout(out_aval, dims)
    if masked:
        pending = out.with_dims(out.dims, frozenset(masked))
        if wanted != dims:
            # (a mesh axis that wanted names twice keeps its first use, as above, where its gather was paid)
            out = w.relayout(out_aval, wanted)
        w.change(eqn, phase, pending, out, dtype, repeat, "masked gather from a sharded table")
    return [out]


def indices_dtype(eqn: Any) -> Any:
    return eqn.invars[1].aval.dtype


@register("scatter-add", "scatter_add", "scatter-sub", "scatter_sub")
def scatter_add(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    return _scatter(w, eqn, ins, repeat, phase, adds=True)


@register("scatter", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min", "scatter-max", "scatter_max")
def scatter(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    return _scatter(w, eqn, ins, repeat, phase, adds=False)


def _scatter(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str, adds: bool) -> list[Layout]:
    operand, indices, updates = ins[0], ins[1], ins[2]
    out_aval = eqn.outvars[0].aval
    dn = eqn.params["dimension_numbers"]
    window = tuple(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    rank = len(out_aval.shape)
    if is_free(updates):
        updates = _free_updates(w, updates, indices, operand, op_batch, idx_batch, window)
    # The updates' scatter axes pair with the indices' axes (the index vector is the last one).
    scatter_axes = [u for u in range(len(updates.shape)) if u not in window]
    by_index = dict(zip(range(len(indices.shape) - 1), scatter_axes))
    op_window = [i for i in range(rank) if i not in inserted and i not in op_batch]
    dims: list[tuple[str, ...]] = [() for _ in range(rank)] if is_free(operand) else list(operand.dims)
    if is_free(operand):
        # Scattered into zeros (the transpose of a gather): the zeros are laid out like the updates.
        for u, o in zip(window, op_window):
            if updates.shape[u] == out_aval.shape[o]:
                dims[o] = updates.dims[u]
        for ob, ib in zip(op_batch, idx_batch):
            dims[ob] = updates.dims[by_index[ib]]
    batch_axes = {by_index[ib] for ib in idx_batch}
    split = tuple(m for u in scatter_axes if u not in batch_axes for m in updates.dims[u])
    used = {m for d in dims for m in d}
    split = tuple(m for m in split if m not in used)
    dims = w.settle_repeats(eqn, phase, out_aval, dims, repeat, "scatter result split twice over a mesh axis")
    out = w.relayout(out_aval, dims)
    if split and adds:
        # Each device adds its share of the updates into its own copy: partial sums over those axes,
        # left pending: the consumer settles them (an output laid out split is reduce-scattered, or
        # all-reduced piecewise, never all-reduced whole and then sliced).  Updates split along
        # several scatter axes (batch over data, sequence over model) are summed as XLA sums a
        # dot's contracted axes: one axis at a time, minor first; the last (major) stays pending.
        groups = [
            tuple(m for m in updates.dims[u] if m in split)
            for u in sorted(scatter_axes, reverse=True)
            if u not in batch_axes
        ]
        groups = [g for g in groups if g]
        pending = frozenset(split)
        for g in groups[:-1]:
            rest = pending - set(g)
            w.change(
                eqn,
                phase,
                out.with_dims(out.dims, pending),
                out.with_dims(out.dims, rest),
                out_aval.dtype,
                repeat,
                "scatter-add of updates split along several axes",
            )
            pending = rest
        return [out.with_dims(out.dims, pending)]
    if split:
        # A non-additive scatter needs every update on every device: gather them (and their indices).
        whole = updates.with_dims(
            tuple(() if k in scatter_axes and k not in batch_axes else d for k, d in enumerate(updates.dims))
        )
        w.change(eqn, phase, updates, whole, updates_dtype(eqn), repeat, "scatter of split updates")
    return [out]


def _free_updates(
    w: Walker,
    updates: Layout,
    indices: Layout,
    operand: Layout,
    op_batch: tuple[int, ...],
    idx_batch: tuple[int, ...],
    window: tuple[int, ...],
) -> Layout:
    """The layout XLA gives updates that carry none of their own (a broadcast constant).

    Scattered into zeros along batching dimensions (the gradient of ``take_along_axis``:
    optax's integer-label cross-entropy, whose updates are the loss's constant cotangent),
    XLA's partitioner splits the updates — and so the result — like the indices along the
    batching axes: each device scatters its own batch rows, nothing moves.  Read as
    replicated, the result would be a whole ``[batch, seq, vocab]`` array on every device.
    Only with a free operand too (an operand with a layout decides the result's) and only
    along batching axes (a split along a scatter axis would be a partial sum XLA has no
    reason to make).
    """
    lay = w.replicated(updates)
    if not idx_batch or is_free(indices) or not is_free(operand):
        return lay
    scatter_axes = [u for u in range(len(updates.shape)) if u not in window]
    dims = list(lay.dims)
    for ib in idx_batch:
        u = scatter_axes[ib] if ib < len(scatter_axes) else -1
        if u >= 0 and updates.shape[u] == indices.shape[ib]:
            dims[u] = indices.dims[ib]
    return lay.with_dims(tuple(dims)) if any(dims) else lay


def updates_dtype(eqn: Any) -> Any:
    return eqn.invars[2].aval.dtype


@register("dynamic_update_slice")
def dynamic_update_slice(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    operand, update = ins[0], ins[1]
    out_aval = eqn.outvars[0].aval
    if is_free(operand) and not is_free(update):
        # Writing into a constant (the transpose of dynamic_slice writes the cotangent into zeros): the
        # update lands anywhere along an axis it does not span, so a split there is gathered first.
        dims = [d if a == b else () for d, a, b in zip(update.dims, update.shape, out_aval.shape)]
        typed = explicit_dims(out_aval)
        if typed is not None:
            # On Explicit axes the result's type names its split (the operand's type): XLA gathers the
            # update's cut splits (measured: dynamic_slice's gradient does its forward gather and this one),
            # writes it whole, and keeps the typed split, sliced locally.
            if tuple(dims) != update.dims:
                why = "dynamic_update_slice into a constant: the update's cut split gathered"
                w.change(eqn, phase, update, update.with_dims(tuple(dims)), out_aval.dtype, repeat, why)
            return [w.relayout(out_aval, typed)]
        return [w.relayout(out_aval, dims)]
    # An update that cuts a split axis lands anywhere in it (its offset is a run-time value): XLA gathers
    # the operand along those axes, updates, and keeps the split (measured on one-op programs).
    # An update one position long on a split axis is written locally by the device that holds it (measured).
    # Once one axis must be gathered, every cut split axis is, one all-gather each (measured).
    cut = [i for i, (d, a, b) in enumerate(zip(operand.dims, update.shape, operand.shape)) if d and a != b]
    if not any(update.shape[i] != 1 for i in cut):
        cut = []
    if cut and not is_free(operand):
        dims = list(operand.dims)
        for i in reversed(cut):
            step = operand.with_dims(tuple(dims))
            dims[i] = ()
            why = "dynamic_update_slice cuts a split axis"
            w.change(eqn, phase, step, operand.with_dims(tuple(dims)), out_aval.dtype, repeat, why)
        whole = operand.with_dims(tuple(dims))
        w.bind_copy(eqn.invars[0], whole)  # the gathered copy is live while the update is written
        if not is_free(update):
            want = tuple(d if a == b else () for d, a, b in zip(whole.dims, update.shape, operand.shape))
            if want != update.dims:
                w.change(eqn, phase, update, update.with_dims(want), out_aval.dtype, repeat, "update lines up")
    return [w.relayout(out_aval, operand.dims)]
