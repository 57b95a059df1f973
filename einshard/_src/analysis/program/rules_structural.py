"""Layout rules for the primitives that move no data by themselves: elementwise, shape and reductions.

Elementwise ops take the layout of their most sharded full-size operand and
bring the others to it (operands broadcast from size-1 axes — a ``(1, d)``
norm weight, a ``[1, s, d]`` position table — are brought to it on the axes
they have).  Shape ops (broadcast, transpose, reshape, squeeze, slices,
concatenation) carry sharded axes through where they survive whole and
gather them where they do not.  A reduction over a sharded axis leaves
partial sums: one all-reduce completes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from jax.sharding import PartitionSpec as P

from ...core.layout import Layout
from ..cost import Collective, sent_bytes
from ..einsum.plan import side_string
from .alternatives import taking
from .costing import is_free
from .movement import is_computed, mark_approximate, mark_conflict, mark_open_merge, mark_swap
from .registry import WalkerLike, register, sharding_degree
from .report import OpBound
from .upstream import apply as apply_upstream
from .upstream import plan_upstream
from .values import ELEMENTWISE, REDUCTIONS, Partial, dtype_itemsize

__all__ = ["CUMULATIVE", "ARG_REDUCTIONS", "reshape_dims", "merged_dims", "merged_split", "claimed_dims"]

# Members of values.ELEMENTWISE and values.REDUCTIONS (memory reads them as fusible) whose rule is rules_ordering's: they read
# along a whole axis, so a split there moves data.
CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
ARG_REDUCTIONS = {"argmax", "argmin"}


@register(*(ELEMENTWISE - CUMULATIVE))
def elementwise(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """The operands' splits merged dimension by dimension (:func:`merged_dims`) set the layout, else the most
    sharded full-size operand's; the others are brought to it."""
    out_aval = eqn.outvars[0].aval
    shape = tuple(int(s) for s in out_aval.shape)
    full = [lay for lay in ins if lay.shape == shape and not is_free(lay)]
    # Operands broadcast from size-1 axes (lax broadcasts those implicitly): same rank, smaller.
    partial = [lay for lay in ins if lay.shape != shape and len(lay.shape) == len(shape) and shape and not is_free(lay)]
    open_merge = False
    if not full:
        if not partial:
            if all(is_free(lay) or not lay.shape for lay in ins):
                return [w.free(v.aval) for v in eqn.outvars]
            return [w.replicated(v.aval) for v in eqn.outvars]
        target = w.relayout(out_aval, _spanned_dims(max(partial, key=sharding_degree), shape))
    else:
        target = max(full, key=sharding_degree)
        # A size-1-broadcast operand's splits along the dimensions it spans whole are factors of the result as a
        # full operand's are (XLA broadcasts it explicitly, then propagates): x[64, 4] * s[64@data, 1] runs on
        # s's split, x sliced, no collective (measured, XLA:CPU: the softmax's x / sum(x, keepdims) in a router's
        # gradient; explain had gathered s).  (A split on its size-1 dimension would be a broadcast one: none.)
        spanned = [dims for dims in (_spanned_dims(lay, shape) for lay in partial) if any(dims)]
        factors = [lay.dims for lay in full]
        merged = merged_dims(factors) if len(factors) > 1 else None
        claimed = merged is None and len(factors) > 1
        if claimed:  # one mesh axis named on two dimensions: they claim it in turn, as Shardy does
            merged = claimed_dims(factors, target.mesh_sizes)
        if spanned:
            # The full operands' split, then grown where a size-1-broadcast operand's extends it on mesh axes
            # nobody uses; where they conflict the full operands' wins and the small operand is moved to it
            # (measured on (4, 2) and (2, 2, 2), XLA:CPU: x[8, 8@a] * s[1, 8@b] keeps x's split, s permuted, 8 B;
            # x[8@a, 8@b] * s[1@?, 8@a] gathers s; x[8, 8] * s[1, 8@b] runs on s's split, x sliced).
            merged = _grown_by_broadcasts(merged if merged is not None else target.dims, spanned)
        if merged is not None and merged != target.dims:
            target = target.with_dims(merged, frozenset())
            # a dimension whose splits differ kept only their common prefix (movement.mark_open_merge)
            open_merge = not claimed and any(len(d) > len(m) for dims in factors for d, m in zip(dims, merged))
        typed = _typed_result(eqn) if not any(lay.unreduced for lay in full) else None  # (a pending sum: as before)
        if typed is not None and tuple(typed) != target.dims:
            # On Explicit axes the result's type names its split (lax.clamp's is x's: clamp(lo[16@b], x[16@(a,b)],
            # hi) is [16@(a,b)], and XLA permutes lo there, 128 B, where the merge kept only their common prefix)
            target, open_merge = target.with_dims(tuple(typed), frozenset()), False
        # (Only where the operands disagree: the readers' uses are read, which a copy's replay must key when they
        # lie past it, so an agreeing op -- a residual add under data parallelism -- reads none: test_segments.)
        disagree = len(set(factors + spanned)) > 1
        placed = _placed_reader_split(w, eqn.outvars[0]) if typed is None and disagree else None
        if placed is not None and placed != target.dims:
            # A placement reading the result (an auto_axes region's exit, a sharding constraint) is settled before
            # the operands meet: Shardy carries its split back into the op, and an operand split so keeps it, the
            # others brought to it (measured: mu2 = 0.9 * mu + 0.1 * g, mu whole, g[32@model, 10], placed whole on
            # the auto_axes exit: XLA gathers 0.1 * g at the add, and the update read from mu2 is whole: one gather
            # per placed moment, none at the updated weight; test_elementwise_placed_readers).
            target = next((lay for lay in full if lay.dims == placed), target)
        if taking(w, eqn):
            # XLA's other choice at a marked conflict (a fork of the walk, see :mod:`.alternatives`): the
            # computed operand's split wins and the others are moved to it.
            target = next(
                (
                    lay
                    for v, lay in zip(eqn.invars, ins)
                    if any(lay is f for f in full) and lay.dims != target.dims and is_computed(w, v)
                ),
                target,
            )
    why = f"{eqn.primitive.name} operands disagree"
    since, conflicted = len(w.ops), []
    for k, lay in enumerate(ins):
        if any(lay is f for f in full) and lay is not target and lay.dims != target.dims:
            if _settled_upstream(w, eqn, k, target.dims, repeat, phase):
                continue
            # the operand moves in its own dtype (a select's boolean mask: 1 byte an element, not the result's 4)
            dtype = eqn.invars[k].aval.dtype
            at = len(w.ops)
            # (a loop body's dot result may be gathered whole and sliced: rules_control.dot_result_route)
            from .rules_control import dot_result_route

            step_from = lay
            for step in dot_result_route(
                w, eqn.invars[k], lay, target.with_dims(target.dims, lay.unreduced), dtype, phase
            ):
                w.change(eqn, phase, step_from, step, dtype, repeat, why)
                step_from = step
            mark_swap(w, at, lay, target.dims, dtype)
            conflicted.append(k)
    for k, lay in enumerate(ins):
        if not any(lay is p for p in partial):
            continue
        want = tuple(d if a == b else () for d, a, b in zip(target.dims, lay.shape, shape))
        if want != lay.dims and _settled_upstream(w, eqn, k, want, repeat, phase):
            continue
        if want != lay.dims:
            conflicted.append(k)
            # XLA moves the small operand itself, before broadcasting it (measured, XLA:CPU, on (4, 2) and (2, 2, 2):
            # x[8@a, 8@c] * s[8@b, 1] permutes s's rows, 16 B, not a broadcast [8, 8@c]; s[1, 1, 8@c] *
            # x[8@(b,c), 8@a, 8] gathers s's 32 B).  Moved to another split, the operand's own layout moves, so that
            # a later move of it there is made once (change()'s memo): XLA's partitioner reuses that permute for
            # the gradient's product (x[8, 8@a] * s[1, 8@b], or s[1, 8@(b,a)] against x[8, 8@a]: one move in the
            # gradient).  A gather of its minor mesh axes (or of all) it repeats per reader (s[1, 8@(a,b)] against
            # x[8@a, 8], or s[1, 8@(b,a)] against it: two all-gathers), as a fresh layout's move is.
            gather = all(tuple(o[: len(d)]) == tuple(d) for d, o in zip(want, lay.dims))
            src = Layout(lay.axes, lay.shape, lay.mesh, lay.dims, lay.unreduced) if gather else lay
            dst = src.with_dims(want)
            w.change(eqn, phase, src, dst, eqn.invars[k].aval.dtype, repeat, why)
            if src.sharded_mesh_axes - dst.sharded_mesh_axes:
                # The gathered operand is a collective's result, a buffer whatever fuses after it (measured: a
                # bias b[8@(a,b), 32] read as a table and added to x[8@(a,b), 8, 32], its gathered f32[8,32]
                # held beside the product, XLA:CPU).  (change binds only an operand met in its own layout.)
                w.bind_copy(eqn.invars[k], dst)
    # A conflict settled by an all-to-all on a computed value: XLA may settle it upstream instead.
    mark_conflict(w, eqn, since, conflicted, alternative=bool(full))
    if open_merge:
        mark_open_merge(w, eqn, since)
    return [w.relayout(v.aval, target.dims) for v in eqn.outvars]


def _grown_by_broadcasts(
    full: tuple[tuple[str, ...], ...], spanned: list[tuple[tuple[str, ...], ...]]
) -> tuple[tuple[str, ...], ...]:
    """The full operands' merged split ``full`` grown where a size-1-broadcast operand's split (``spanned``: along
    the dimensions it spans) extends it (``full``'s split there is its prefix), up to its first mesh axis another
    dimension uses; a split that conflicts with ``full``'s, or names a mesh axis used elsewhere, adds nothing (XLA keeps the full
    operands' split and moves the small operand to it: :func:`elementwise`)."""
    out = list(full)
    used = {m for d in out for m in d}
    for dims in spanned:
        for k, d in enumerate(dims):
            have = out[k]
            if len(d) <= len(have) or d[: len(have)] != have:
                continue
            # (up to its first mesh axis used elsewhere: Shardy keeps that prefix, x[16@b, 16] + s[1, 16@(a,b)] is
            # [16@b, 16@a], s gathered over b only)
            more = d[len(have) :]
            cut = next((i for i, m in enumerate(more) if m in used), len(more))
            if cut:
                out[k] = have + more[:cut]
                used |= set(more[:cut])
    return tuple(out)


def _spanned_dims(lay: Layout, shape: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    """A size-1-broadcast operand's splits as the result's factors: its own where it spans the result's dimension,
    none where it is broadcast along it."""
    return tuple(d if a == b else () for d, a, b in zip(lay.dims, lay.shape, shape))


def _placed_reader_split(w: WalkerLike, var: Any) -> tuple[tuple[str, ...], ...] | None:
    """The split a placement reading ``var`` directly lays it out in (every dimension named, whole included), or
    None: no such reader, readers placing it differently, or a dimension left to the propagation (unconstrained)."""
    from .rules_indexing import PLACEMENTS  # rules_indexing imports this module

    rank = len(getattr(var.aval, "shape", ()))
    found: set[tuple[tuple[str, ...], ...]] = set()
    for user, k in w.uses.get(id(var), []):
        if user.primitive.name not in PLACEMENTS or k != 0:
            continue
        sh = user.params.get("sharding") or user.params.get("dst_sharding")
        if isinstance(sh, (list, tuple)):
            sh = sh[0] if sh else None
        spec = getattr(sh, "spec", None)
        if spec is None or len(spec) > rank or any(e is P.UNCONSTRAINED for e in spec):
            return None
        named = [(e,) if isinstance(e, str) else tuple(e) if isinstance(e, tuple) else () for e in spec]
        found.add(tuple(named) + ((),) * (rank - len(named)))
    return found.pop() if len(found) == 1 else None


def merged_dims(operands: list[tuple[tuple[str, ...], ...]]) -> tuple[tuple[str, ...], ...] | None:
    """The result's split that XLA's sharding propagation (Shardy) gives an elementwise op whose operands are
    split differently, where that is decided dimension by dimension; None where it is not.

    Each dimension is one factor: where every operand's mesh axes there are a prefix of the longest one's, the
    longest wins (the others are sliced to it: free); where two disagree (``(a, b)`` against ``b``), only their
    common prefix survives (measured: ``jnp.where(a > 0, a, b)`` with a ``[16@(a,b), 16]``, b ``[16@b, 16@a]``
    gives ``[16, 16@a]``; a ``[16@b, 16]``, b ``[16@(a,b), 16]`` gives a whole result).  Explicit axes type
    the result alike (a dimension split on one side and whole on the other takes the split; two different
    splits are refused).  None where the winners name one mesh axis on two dimensions (``x[rows@a]`` against
    ``y[cols@a]``): then one operand's whole split wins (the caller's rule, and its conflict mark)."""
    merged = [merged_split([dims[k] for dims in operands]) for k in range(len(operands[0]))]
    used = [m for d in merged for m in d]
    return tuple(merged) if len(used) == len(set(used)) else None


def _typed_result(eqn: Any) -> list[tuple[str, ...]] | None:
    """The split an elementwise result's type names on Explicit axes, whole included, where an operand's type names
    a split (so the types are the program's layouts, not those of a trace from unplaced inputs); else None.
    (lax.clamp(lo[16@a], x[16], hi[16@a]) is typed whole, as x: XLA gathers lo and hi.)"""
    aval = eqn.outvars[0].aval
    if not all_explicit(aval):  # (a mixed mesh's type is silent on its Auto axes)
        return None
    typed = explicit_dims(aval)
    if typed is not None:
        return typed
    if not any(explicit_dims(v.aval) for v in eqn.invars if hasattr(v, "aval") and not hasattr(v, "val")):
        return None
    return [() for _ in aval.shape]


def claimed_dims(operands: list[tuple[tuple[str, ...], ...]], sizes: Mapping[str, int]) -> tuple[tuple[str, ...], ...]:
    """The result's split where the operands' merged splits (:func:`merged_dims`) name one mesh axis on two
    dimensions: the dimensions claim their mesh axes in turn, the one split over more devices first (on ties the
    one an earlier operand splits so, then the earlier dimension), each keeping its split up to the first mesh axis
    already claimed (Shardy's propagation; measured on (4, 2): a[16@a, 16@b] * b[16@(a,b), 16] and the other way
    round give [16@(a,b), 16], a[16@a, 16@b] * b[16, 16@(b,a)] gives [16, 16@(b,a)], a[16, 16@a] * b[16@a, 16]
    gives [16, 16@a]: an all-to-all of the other operand each)."""
    merged = [merged_split([dims[k] for dims in operands]) for k in range(len(operands[0]))]

    def owner(k: int) -> int:
        return next((i for i, dims in enumerate(operands) if dims[k] == merged[k]), len(operands))

    order = sorted(range(len(merged)), key=lambda k: (-math.prod(sizes[m] for m in merged[k]), owner(k), k))
    claimed: set[str] = set()
    out: list[tuple[str, ...]] = [()] * len(merged)
    for k in order:
        d = merged[k]
        cut = next((i for i, m in enumerate(d) if m in claimed), len(d))
        out[k] = d[:cut]
        claimed |= set(out[k])
    return tuple(out)


def merged_split(splits: list[tuple[str, ...]]) -> tuple[str, ...]:
    """One dimension's split where operands meet on it (:func:`merged_dims`): the longest where the others are
    its prefixes, else the prefix they all share."""
    longest = max(splits, key=len)
    for d in splits:
        n = 0
        while n < len(d) and n < len(longest) and d[n] == longest[n]:
            n += 1
        if n < len(d):  # not a prefix of the longest: keep what they share
            longest = longest[:n]
    return longest


def _settled_upstream(
    w: WalkerLike, eqn: Any, k: int, want: tuple[tuple[str, ...], ...], repeat: int, phase: str
) -> bool:
    """Operand ``k`` brought to ``want`` the way XLA does where it is computed: the split carried back through
    its producers to plain gathers (:mod:`.upstream`).  False: it is moved here (the caller's all-to-all)."""
    if w.quiet or taking(w, eqn) or not is_computed(w, eqn.invars[k]):
        return False
    route = plan_upstream(w, eqn.invars[k], tuple(want), eqn)
    if route is None:
        return False
    apply_upstream(w, eqn, route, repeat, phase)
    return True


@register("broadcast_in_dim")
def broadcast_in_dim(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    out_aval = eqn.outvars[0].aval
    if not ins[0].shape or is_free(ins[0]):
        return [w.free(out_aval)]
    dims: list[tuple[str, ...]] = [()] * len(out_aval.shape)
    for i, j in enumerate(eqn.params["broadcast_dimensions"]):
        if ins[0].shape[i] == out_aval.shape[j]:
            dims[j] = ins[0].dims[i]
    dims = _split_by_users(w, eqn, dims)
    moved = _operand_at(eqn, ins[0], dims)
    if moved.dims != ins[0].dims:
        # The reader's split won on a kept axis (Shardy propagates the elementwise op first): XLA moves the small
        # operand to it before broadcasting (a bias b[16@a] read with x[16@b]: one collective-permute of b).
        w.change(eqn, phase, ins[0], moved, eqn.invars[0].aval.dtype, repeat, "broadcast operand to its reader's split")
    natural = w.relayout(out_aval, dims)
    if explicit_dims(out_aval) is None or natural.unreduced:
        return [natural]
    # On Explicit axes the result's type names its split (JAX's transpose of a reduction broadcasts the
    # cotangent back to the operand's split type: grad of mean(x[:, rows@b], 1) is split over b): XLA makes
    # it there, a local slice of a whole operand (measured: the gradient leaves split, XLA's peak half).
    return [_declared(w, eqn, natural, repeat, phase, typed_whole=True)]


def _operand_at(eqn: Any, operand: Layout, dims: list[tuple[str, ...]]) -> Layout:
    """The operand's layout that broadcasts to ``dims`` by local slicing: each kept axis split as the result's
    (a size-1 axis, expanded, whole).  Itself where each of its splits is the result's already (nothing moves)."""
    out_shape = eqn.outvars[0].aval.shape
    want = tuple(
        dims[j] if operand.shape[i] == out_shape[j] else () for i, j in enumerate(eqn.params["broadcast_dimensions"])
    )
    if all(not o or o == n for o, n in zip(operand.dims, want)):  # (a whole axis is sliced locally)
        return operand
    return operand.with_dims(want)


def _split_by_users(w: WalkerLike, eqn: Any, dims: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The broadcast's result split as its elementwise readers' other full-size operands, already laid out, split it
    where they all agree (Auto axes only: on Explicit ones the broadcast's type decides), the operand's own splits
    added where they do not clash.

    Shardy propagates elementwise ops before broadcasts: the reader's split reaches the broadcast's result first,
    on the new axes (a local slice of a whole operand) and on the kept ones alike; then the broadcast adds its
    operand's splits where the result's axis is whole or split over a prefix of them and the mesh axes are free.
    A kept axis the operand splits otherwise takes the reader's split: XLA moves the operand there (measured:
    x[16@b, 12@c] + broadcast(b[16@a]) keeps x's split and collective-permutes b; x[8@b, 8] + broadcast(b[8@a])
    along the columns is split [8@b, 8@a], nothing moves).  So every other reader sees it split: a sum over a
    broadcast axis is then an all-reduce (measured: b = broadcast(v[8, 32]) to [8, 4, 4, 32], x[8, 4@b, 4, 32];
    b.sum((1, 2)) all-reduces over b whether it comes before or after x * b; a GroupNorm's gradient under a rows
    split, issue 20's flax_cnn)."""
    out = eqn.outvars[0]
    shape = out.aval.shape
    mesh = getattr(getattr(out.aval, "sharding", None), "mesh", None)
    if any("Explicit" in str(t) for t in getattr(mesh, "axis_types", ())):
        return dims
    readers: list[Layout] = []
    for user, _ in w.uses.get(id(out), []):
        if user.primitive.name not in ELEMENTWISE or len(user.invars) < 2:
            continue
        for v in user.invars:
            lay = None if v is out or hasattr(v, "val") else w.env.get(v)
            if lay is None or is_free(lay) or tuple(lay.shape) != tuple(int(s) for s in shape):
                continue
            readers.append(lay)
    split = [lay for lay in readers if any(lay.dims) and not lay.unreduced]
    if split and all(lay.dims == split[0].dims for lay in split):
        return _reader_first(list(split[0].dims), dims)
    # Readers that disagree (the gradient of sum(a * b, 0): a[16@a, 16] and b[16, 16@a] both read the broadcast
    # cotangent): neither reaches the broadcast's result first; each fills only new axes it does not clash on.
    new_axes = set(range(len(shape))) - set(eqn.params["broadcast_dimensions"])
    new = list(dims)
    for lay in readers:
        if any(lay.dims[j] and lay.dims[j] != new[j] for j in range(len(shape)) if j not in new_axes):
            continue  # the operands disagree off the broadcast axes: XLA settles that another way
        used = {m for d in new for m in d}
        for j in sorted(new_axes):
            d = lay.dims[j]
            if d and not new[j] and not used & set(d):
                new[j] = d
                used |= set(d)
    return new


def _reader_first(reader: list[tuple[str, ...]], own: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """The reader's split, then the broadcast's own per axis where it extends it, up to its first mesh axis used
    elsewhere (Shardy keeps the prefix: b[1, 16@(a,b)] broadcast and read with x[16@b, 16] is [16@b, 16@a], b
    gathered over b only, 16 B; measured, XLA:CPU)."""
    out = list(reader)
    for j, d in enumerate(own):
        if not d or d == out[j] or tuple(d[: len(out[j])]) != tuple(out[j]):
            continue
        used = {m for k, e in enumerate(out) if k != j for m in e}
        cut = next((i for i, m in enumerate(d) if m in used), len(d))
        if cut > len(out[j]):
            out[j] = d[:cut]
    return out


@register("iota", "full", "zeros_like", "empty", "empty2")
def constant(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """Values every device makes for itself: their consumer chooses their layout."""
    return [w.free(v.aval) for v in eqn.outvars]


@register("transpose")
def transpose(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    perm = eqn.params["permutation"]
    if is_free(ins[0]):
        return [w.free(eqn.outvars[0].aval)]
    return [w.relayout(eqn.outvars[0].aval, [ins[0].dims[p] for p in perm])]


@register("squeeze")
def squeeze(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    gone = set(eqn.params["dimensions"])
    if is_free(ins[0]):
        return [w.free(eqn.outvars[0].aval)]
    return [w.relayout(eqn.outvars[0].aval, [d for i, d in enumerate(ins[0].dims) if i not in gone])]


@register("expand_dims")
def expand_dims(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    dims = list(ins[0].dims)
    for ax in sorted(eqn.params["dimensions"]):
        dims.insert(ax, ())
    return [w.relayout(eqn.outvars[0].aval, dims)]


@register("reshape")
def reshape(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(src):
        return [w.free(out_aval)]
    out_shape = tuple(int(s) for s in out_aval.shape)
    dims = reshape_dims(src.shape, src.dims, out_shape)
    if dims is not None and any(out_shape[i] % math.prod(w.costs.mesh_sizes[m] for m in d) for i, d in enumerate(dims)):
        dims = None  # the sharded piece no longer divides evenly
    if dims is None:
        split = reshape_split(src.shape, src.dims, out_shape, w.costs.mesh_sizes)
        if split is not None and split.whole_axes:
            # The split spreads over several result dimensions at mesh-axis boundaries: Shardy keeps it there.
            if split.gathered is not None:
                typed = _declared_dims(eqn, out_aval)
                back = _input_side(typed, out_shape, src.shape, w.costs.mesh_sizes) if typed is not None else None
                if typed is not None and back is not None and typed != split.dims:
                    # On Explicit axes JAX types the result (x[4@a, 2@b, 2] to (16@(a,b),)): XLA moves the operand to
                    # the layout that reshapes to that type locally, [4@(a,b), 2, 2], by one all-to-all (16 B;
                    # measured), not a gather of the minor split and a slice.
                    moved = src.with_dims(back)
                    w.change(eqn, phase, src, moved, out_aval.dtype, repeat, "reshape to its declared layout")
                    return [w.relayout(out_aval, typed)]
                # (a merge keeps its dimensions' splits up to the first one not split all its ways: the minor
                # ones are gathered first)
                kept = src.with_dims(split.gathered)
                w.change(eqn, phase, src, kept, out_aval.dtype, repeat, "reshape merges a split minor axis")
            return [_declared(w, eqn, w.relayout(out_aval, split.dims), repeat, phase)]
        if split is not None:
            return [_declared(w, eqn, _sub_axes_gathered(w, eqn, src, split, repeat, phase), repeat, phase)]
        # The sharded axis does not survive the reshape whole: gather it first.
        gathered = src.with_dims(tuple(() for _ in src.dims))
        w.change(eqn, phase, src, gathered, out_aval.dtype, repeat, "reshape splits a sharded axis")
        return [_declared(w, eqn, w.replicated(out_aval), repeat, phase)]
    return [_declared(w, eqn, w.relayout(out_aval, dims), repeat, phase)]


def _declared_dims(eqn: Any, out_aval: Any) -> tuple[tuple[str, ...], ...] | None:
    """The split a reshape's result is typed with on Explicit axes (its ``sharding=``, else the type JAX gave it;
    whole included), where the operand's type names one too (else None: a trace from unplaced inputs says nothing
    of the walk's layouts)."""
    if not all_explicit(out_aval) or explicit_dims(eqn.invars[0].aval) is None:
        return None
    spec = getattr(eqn.params.get("sharding"), "spec", None)
    if spec is not None:
        return tuple(spec_dims(spec, len(out_aval.shape)))
    typed = explicit_dims(out_aval)
    return tuple(typed) if typed is not None else tuple(() for _ in out_aval.shape)


def _input_side(
    dims: tuple[tuple[str, ...], ...], out_shape: tuple[int, ...], src_shape: tuple[int, ...], sizes: Mapping[str, int]
) -> tuple[tuple[str, ...], ...] | None:
    """The operand's split that reshapes to ``dims`` with nothing moved (the reshape read backwards), or None."""
    back = reshape_dims(out_shape, dims, src_shape)
    if back is not None and not any(n % math.prod(sizes[m] for m in d) for n, d in zip(src_shape, back)):
        return tuple(back)
    split = reshape_split(out_shape, dims, src_shape, sizes)
    if split is None or not split.whole_axes or split.gathered is not None:
        return None
    return split.dims


@dataclass(frozen=True)
class ReshapeSplit:
    """How a split input dimension spreads over the result dimensions a reshape cuts it into (Shardy's rule:
    major first, each result dimension split as many ways as it takes of the split)."""

    dims: tuple[tuple[str, ...], ...]  # the result's split where the mesh axes fall on dimension boundaries
    ways: tuple[int, ...]  # how many ways each result dimension is split (1: whole)
    axes: tuple[str, ...]  # the input's mesh axes that split it
    whole_axes: bool  # every result dimension takes whole mesh axes (else Shardy splits one into sub-axes)
    # The input's split once the splits a merge cannot keep are gathered (None: nothing is gathered first)
    gathered: tuple[tuple[str, ...], ...] | None = None


def reshape_split(
    src_shape: tuple[int, ...],
    src_dims: tuple[tuple[str, ...], ...],
    out_shape: tuple[int, ...],
    sizes: Mapping[str, int],
) -> ReshapeSplit | None:
    """The split of a reshape that cuts one split input dimension into several result dimensions, the split
    running past the major one (x[4, 8@a] with |a| = 8 to (4, 2, 4): 2 ways, then 4); None for any other
    reshape (one split input dimension, the others whole and kept, the result's dimensions dividing it)."""
    split = [i for i, d in enumerate(src_dims) if d]
    if len(split) > 1:
        return _merged_split(src_shape, src_dims, out_shape, sizes)
    if len(split) != 1:
        return None
    i = split[0]
    before = math.prod(src_shape[:i])
    j, acc = 0, 1
    while j < len(out_shape) and acc < before:
        acc *= out_shape[j]
        j += 1
    if acc != before:
        return None
    group, acc = [], 1
    while j < len(out_shape) and acc < src_shape[i]:
        acc *= out_shape[j]
        group.append(j)
        j += 1
    if acc != src_shape[i] or len(group) < 2:
        return None
    axes = src_dims[i]
    remaining = math.prod(sizes[m] for m in axes)
    ways = [1] * len(out_shape)
    for j in group:
        o = out_shape[j]
        if remaining == 1 or o == 1:
            continue
        take = o if remaining % o == 0 else remaining if o % remaining == 0 else 0
        if not take:
            return None
        ways[j], remaining = take, remaining // take
    if remaining != 1:
        return None
    dims: list[tuple[str, ...]] = [()] * len(out_shape)
    k, whole_axes = 0, True
    for j in group:
        n, taken = 1, []
        while n < ways[j] and k < len(axes):
            n *= sizes[axes[k]]
            taken.append(axes[k])
            k += 1
        if n != ways[j]:
            whole_axes = False
            break
        dims[j] = tuple(taken)
    return ReshapeSplit(tuple(dims), tuple(ways), axes, whole_axes)


def _merged_split(
    src_shape: tuple[int, ...],
    src_dims: tuple[tuple[str, ...], ...],
    out_shape: tuple[int, ...],
    sizes: Mapping[str, int],
) -> ReshapeSplit | None:
    """A reshape of several split input dimensions, group by group (the input and result dimensions whose sizes
    multiply alike, as :func:`reshape_dims` matches them):

    * a group merged into one result dimension keeps its split dimensions' mesh axes in order where they are its
      major ones, consecutive, each but the last split all its ways (the blocks stay contiguous); from the first
      one split fewer ways (or from its major one, whole), the split dimensions after it are gathered first
      (``gathered``), the other groups' splits kept;
    * a group cutting one split dimension into several takes :func:`reshape_split`'s split of it (whole mesh
      axes only);
    * a group with one split dimension on each side keeps it on its major, as :func:`reshape_dims` does.

    Measured (XLA:CPU): the gradient of x[4, 8@(a,b,c)] reshaped to (4, 4@(a,b), 2@c) merges back to 8@(a,b,c),
    nothing moves; x[4@c, 2@b, 2@a] to (4, 4) on a (2, 2, 2) mesh is (4@c, 4@(b,a)), nothing moves, and its
    gradient cuts it back; to (16,) it all-gathers b and a (48 B) and keeps 16@c (tests/test_primitive_rules_core.py)."""
    dims: list[tuple[str, ...]] = [()] * len(out_shape)
    kept = list(src_dims)
    groups = reshape_groups(src_shape, out_shape)
    if groups is None:
        return None
    for gi, gj in groups:
        ins = [k for k in gi if k < len(src_shape) and src_shape[k] != 1]
        outs = [k for k in gj if k < len(out_shape) and out_shape[k] != 1]
        split_here = [k for k in ins if src_dims[k]]
        if not split_here:
            continue
        if len(outs) > 1:
            if len(ins) != 1:
                return None  # (several input dimensions regrouped into several: not modelled)
            cut = reshape_split((src_shape[ins[0]],), (src_dims[ins[0]],), tuple(out_shape[k] for k in outs), sizes)
            if cut is None or not cut.whole_axes:
                return None
            for k, d in zip(outs, cut.dims):
                dims[k] = d
            continue
        if not outs:
            return None
        axes: list[str] = []
        # (a whole dimension major to a split one: the blocks are not contiguous, the group's splits are gathered;
        # measured: x[4@a, 2, 2@b] to (4, 4) gathers b only, 32 B, and keeps 4@a)
        for k in ins if split_here[0] == ins[0] else ():
            if k not in split_here:
                break  # (past a whole dimension: a split after it is gathered)
            axes += src_dims[k]
            if math.prod(sizes[m] for m in src_dims[k]) != src_shape[k]:
                break  # (split fewer ways than it has rows: the splits after it are gathered)
        for k in split_here:
            if not set(src_dims[k]) <= set(axes):
                kept[k] = ()
        if out_shape[outs[0]] % math.prod(sizes[m] for m in axes):
            return None
        dims[outs[0]] = tuple(axes)
    every = tuple(m for d in src_dims for m in d)
    ways = tuple(math.prod(sizes[m] for m in d) for d in dims)
    gathered = tuple(kept) if tuple(kept) != tuple(src_dims) else None
    return ReshapeSplit(tuple(dims), ways, every, True, gathered)


def _sub_axes_gathered(w: WalkerLike, eqn: Any, src: Layout, split: ReshapeSplit, repeat: int, phase: str) -> Layout:
    """A reshape whose split Shardy can only keep on sub-axes of a mesh axis (a Layout cannot carry them): XLA
    reshapes locally and, where the result is needed whole, gathers each result dimension on its own, the minor
    first (measured: x[4, 8@a], |a| = 8, to (4, 2, 4) gathers 4 ways then 2, 192 B).  Priced so, and marked:
    a consumer that keeps the sub-axes (a reshape back, a sum) moves nothing of it (or sums instead)."""
    out_aval = eqn.outvars[0].aval
    whole = math.prod(out_aval.shape) * dtype_itemsize(out_aval.dtype)
    left = math.prod(split.ways)
    colls = []
    for j in reversed(range(len(split.ways))):
        if split.ways[j] == 1:
            continue
        array = whole // (left // split.ways[j])
        left //= split.ways[j]
        sent = sent_bytes("all-gather", split.ways[j], array)
        t = w.costs.profile.collective_time("all-gather", split.ways[j], sent, array)
        colls.append(
            Collective(
                "all-gather",
                split.axes,
                split.ways[j],
                int(sent),
                int(array),
                t,
                "operand 1",
                "gather a sub-axis split",
            )
        )
    out = w.replicated(out_aval)
    start = len(w.ops)
    why = "reshape: a split Shardy keeps on sub-axes, gathered one result dimension at a time"
    w.record(eqn, phase, why, out, tuple(colls), 0.0, sum(c.time for c in colls), repeat)
    note = "reshape onto sub-axes of a mesh axis: XLA keeps them where a consumer can (nothing gathered)"
    # (bytes as the buffers the gathers move: what XLA's HLO prints and the checks compare)
    bound = OpBound(len(colls), float(sum(c.array_bytes for c in colls)), float(whole))
    mark_approximate(w, start, note, bound)
    return out


def _declared(w: WalkerLike, eqn: Any, natural: Layout, repeat: int, phase: str, typed_whole: bool = False) -> Layout:
    """The result at the layout the equation's ``sharding=`` names (Explicit axes), moved there from ``natural``.

    On Explicit axes JAX writes the result's type into the equation (a reshape's ``sharding``):
    the transpose of a broadcast over a split batch reshapes the cotangent to a replicated type
    (Haiku's bias gradients), and XLA all-gathers the operand for it, then reduces locally
    (measured in a scanned Haiku stack's backward loop: an all-gather per bias where explain
    had an all-reduce of the reduced sum).  ``typed_whole``: also where the operand's type is whole (a
    broadcast whose result type names a split: the caller checked it does).
    """
    spec = getattr(eqn.params.get("sharding"), "spec", None)
    if spec is None or natural.unreduced or (explicit_dims(eqn.invars[0].aval) is None and not typed_whole):
        # An operand typed whole: the program was traced from unplaced inputs, and its declared layouts
        # say nothing of the layouts the walk follows.
        return natural
    out_aval = eqn.outvars[0].aval
    want = spec_dims(spec, len(out_aval.shape))
    if list(natural.dims) == want:
        return natural
    dst = w.relayout(out_aval, want)
    w.change(eqn, phase, natural, dst, out_aval.dtype, repeat, f"{eqn.primitive.name} to its declared layout")
    return dst


@register(*(REDUCTIONS - ARG_REDUCTIONS))
def reduce(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(src):
        return [w.free(v.aval) for v in eqn.outvars]
    axes = set(eqn.params.get("axes", ()))
    sharded = tuple(m for i in sorted(axes) for m in src.dims[i])
    kept = [d for i, d in enumerate(src.dims) if i not in axes]
    out = w.relayout(out_aval, kept)
    if sharded:
        # Per-device partial results.  XLA completes them one reduced axis at a time, minor axis
        # first: one all-reduce per split axis (over all its mesh axes at once when it is split
        # over a tuple like (data, model)).
        why = f"{eqn.primitive.name} over sharded axes"
        w.env[Partial(eqn.outvars[0])] = out  # the partial buffer waits for its all-reduce
        groups = tuple(src.dims[i] for i in sorted(axes) if src.dims[i])
        scattered = _scattered(w, eqn, out, frozenset(sharded), groups) if eqn.primitive.name == "reduce_sum" else None
        if scattered is not None:
            # A consumer takes the sum split over the summed mesh axes (XLA's propagation, backwards): one
            # reduce-scatter to that split, not an all-reduce.  Summed mesh axes the split does not use are
            # all-reduced first, minor reduced axis first (measured: x[8@a, 4@b, 4, 8] + bias[4, 8@a], the bias
            # gradient asked split as the bias: an all-reduce over b, then a reduce-scatter over a).
            onto = (scattered.sharded_mesh_axes - out.sharded_mesh_axes) & set(sharded)  # the rest: sliced locally
            for i in sorted(axes, reverse=True):
                rest = tuple(m for m in src.dims[i] if m not in onto)
                if rest:
                    w.change(eqn, phase, out.with_dims(out.dims, frozenset(rest)), out, out_aval.dtype, repeat, why)
            pending = out.with_dims(out.dims, frozenset(onto))
            if sum(1 for d, e in zip(out.dims, scattered.dims) if set(e) - set(d)) > 1:
                _scattered_at_once(w, eqn, phase, repeat, pending, scattered, why)
            else:
                w.change(eqn, phase, pending, scattered, out_aval.dtype, repeat, why)
            return [scattered]
        for i in sorted(axes, reverse=True):
            if src.dims[i]:
                pending = out.with_dims(out.dims, frozenset(src.dims[i]))
                w.change(eqn, phase, pending, out, out_aval.dtype, repeat, why)
    typed = _typed_result(eqn)
    if typed is not None and tuple(typed) != out.dims:
        # On Explicit axes the result's type names its split (the transpose of a broadcast reduces the cotangent
        # to its operand's type: jnp.where(c[16, 16@a], x, b[1, 16])'s gradient for b is typed whole), and XLA
        # brings the sum there (measured: one all-gather of the f32[16] sum, 64 B, after the local reduce).
        dst = w.relayout(out_aval, typed)
        w.change(eqn, phase, out, dst, out_aval.dtype, repeat, f"{eqn.primitive.name} to its typed layout")
        out = dst
    return [out for _ in eqn.outvars]


def _scattered_at_once(
    w: WalkerLike, eqn: Any, phase: str, repeat: int, pending: Layout, scattered: Layout, why: str
) -> None:
    """A reduction's pending sum scattered onto several dimensions: one reduce-scatter over all its mesh axes.

    XLA sums the local result over every pending mesh axis at once and each device keeps its block of the 2-d (or
    3-d) tiling (measured: sum(x[8@(a, b, c), 4, 8, 8], 0) asked P('a', 'b', 'c') is one reduce-scatter of the
    whole f32[4, 8, 8]; x[8@(a, b), 4, 8] + bias[4@a, 8@b]'s bias gradient one over the 4 devices), where the
    layout algebra's transition scatters one dimension at a time (tests/test_reduction_scatter.py)."""
    sizes = w.costs.mesh_sizes
    axes = tuple(m for m in sizes if m in pending.unreduced)  # in mesh order
    n = math.prod(sizes[m] for m in axes)
    block = math.prod(pending.shard_shape) * dtype_itemsize(eqn.outvars[0].aval.dtype)
    sent = sent_bytes("reduce-scatter", n, block)
    t = w.costs.profile.collective_time("reduce-scatter", n, sent, block)
    coll = Collective("reduce-scatter", axes, n, int(sent), int(block), t, "result", why)
    w.record(
        eqn, phase, f"{why}: {side_string(pending)} -> {side_string(scattered)}", scattered, (coll,), 0.0, t, repeat
    )


def _scattered(
    w: WalkerLike, eqn: Any, out: Layout, sums: frozenset[str], groups: tuple[tuple[str, ...], ...]
) -> Layout | None:
    """The layout a consumer asks of a reduction's sum where it splits over exactly the summed mesh axes, else None.

    A split asked of the program's output may take only some of the summed mesh axes, those of whole reduced
    axes (``groups``: each reduced axis' mesh axes): the caller all-reduces the others first.  XLA sums one
    reduced axis split over a tuple in one all-reduce and slices it after (measured: x[8@(a, b), ...] +
    bias[4, 8@a] all-reduces over (a, b); x[8@a, 4@b, ...] + the same bias all-reduces over b and reduce-scatters
    over a)."""
    from .rules_indexing import consumer_split  # rules_indexing imports this module

    dims = consumer_split(w, eqn.outvars[0], out, sums)
    partial = False  # whether the split may take some of the summed mesh axes (the rest all-reduced)
    if dims is not None and {m for d in dims for m in d} - {m for d in out.dims for m in d} != set(sums):
        # The look-ahead lands one dimension's split; a layout asked of the sum may take them all (below).
        dims = None if _asked_through_unit_axes(w, eqn.outvars[0]) is not None else dims
    if dims is None:
        # A sum that leaves the program as it is, its layout asked (report(out_specs=), an Explicit program's
        # reshard): XLA sums it straight to that split (measured: a routed expert sum leaving token-split).
        asked = _asked_through_unit_axes(w, eqn.outvars[0])
        if asked is not None and len(asked) == len(out.dims):
            used = {m for d in out.dims for m in d}
            wanted = {m for a in asked for m in a}
            whole = {m for g in groups if set(g) <= wanted for m in g}  # the reduced axes the split can take
            dims = [_asked_split(a, d, whole, used) for a, d in zip(asked, out.dims)]
            partial = True
    if dims is None:
        return None
    onto = {m for d in dims for m in d} - {m for d in out.dims for m in d}
    summed = onto & set(sums) if partial else onto  # an asked split may add unsummed axes: sliced locally
    if not summed or (summed != set(sums) and not (partial and summed < set(sums))):
        return None
    return w.relayout(eqn.outvars[0].aval, dims)


def _asked_split(asked: tuple[str, ...], kept: tuple[str, ...], whole: set[str], used: set[str]) -> tuple[str, ...]:
    """The split a sum's dimension takes where a placement asks ``asked`` of it (``kept``: its split now,
    ``whole``: the summed mesh axes it may take, ``used``: the mesh axes the sum's dimensions keep).

    Asked over summed mesh axes only, the dimension takes them.  Asked over all of them and others besides, XLA
    still sums straight into pieces: each device keeps its piece of the asked split, the rest of the way a
    local slice where the dimension was whole, or, where it kept a split, the summed axes appended to it, then
    moved (measured on (2, 2, 2) and (4, 2): sum(x[16@a, 16], 0) asked P(('b', 'a')) is one reduce-scatter of
    64 B; sum(x[16@a, 16@b], 0) asked P(('c', 'a')) a reduce-scatter to [16@(b, a)], then a permute of 16 B)."""
    if asked and set(asked) <= whole and not set(asked) & used:
        return asked
    taken = tuple(m for m in asked if m in whole)
    if not taken or set(taken) != whole:
        return kept
    if not kept:
        return asked if not set(asked) & used else kept
    return kept + taken


# Ops that only add, drop or reorder size-1 axes (and a sum over size-1 axes): JAX's transpose of a rank-promoting
# broadcast (``x[b, s, h, k] + bias[h, k]``) sums the cotangent over the batch axes, reshapes it to
# ``[1, 1, h, k]`` and sums the unit axes away; XLA's propagation carries the output's split back through them.
_UNIT_AXIS_OPS = frozenset({"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "reduce_sum", "transpose"})
_UNIT_CHAIN_LIMIT = 16  # steps followed from one sum (such chains are a few ops long)


def _unit_axis_map(user: Any) -> dict[int, int] | None:
    """Where each non-unit axis of ``user``'s operand lands in its result, where ``user`` moves size-1 axes only."""
    shape_in = tuple(int(s) for s in user.invars[0].aval.shape)
    shape_out = tuple(int(s) for s in user.outvars[0].aval.shape)
    name = user.primitive.name
    if name == "transpose":
        perm = user.params["permutation"]
        return {perm[j]: j for j in range(len(perm)) if shape_out[j] != 1}
    if name == "reduce_sum" and any(shape_in[i] != 1 for i in user.params.get("axes", ())):
        return None  # a real sum: not a carrier
    kept_in = [i for i, n in enumerate(shape_in) if n != 1]
    kept_out = [j for j, n in enumerate(shape_out) if n != 1]
    if [shape_in[i] for i in kept_in] != [shape_out[j] for j in kept_out]:
        return None  # a broadcast to a bigger axis, or a reshape that merges or splits axes
    return dict(zip(kept_in, kept_out))


def _asked_through_unit_axes(w: WalkerLike, var: Any) -> tuple[tuple[str, ...], ...] | None:
    """The layout asked of the program output ``var`` becomes (rules_indexing's ``requested_dims``), followed
    through ops that move only size-1 axes (:data:`_UNIT_AXIS_OPS`) or write it whole (:func:`_whole_update`),
    and mapped back onto ``var``'s axes.

    A bias gradient reaches the output through such a chain (sum, reshape to ``[1, 1, h, k]``, sum of the unit
    axes): without it the sum's asked split is unseen and its pending sum is all-reduced where XLA
    reduce-scatters it (measured: x[8@data, 8, 4, 8] + b[4@data, 8], the gradient of b asked split as b)."""
    from .rules_indexing import PLACEMENTS, placement_dims, requested_dims  # rules_indexing imports this module

    rank = len(getattr(var.aval, "shape", ()))
    to_var = {i: i for i, n in enumerate(var.aval.shape) if int(n) != 1}  # var's axis -> the followed value's
    v = var
    for _ in range(_UNIT_CHAIN_LIMIT):
        asked = requested_dims(w, v)
        if asked is not None:
            if len(asked) != len(getattr(v.aval, "shape", ())):
                return None
            return tuple(asked[to_var[i]] if i in to_var else () for i in range(rank))
        uses = w.uses.get(id(v), [])
        if len(uses) != 1:
            return None
        user, k = uses[0]
        if user.primitive.name in PLACEMENTS and k == 0:
            # A placement asks its layout outright (the exit of a jax.sharding.auto_axes region, out_sharding=):
            # as an asked output (measured: the bias gradient above under auto_axes(out_sharding=P('a', 'b'))
            # on Explicit axes is one reduce-scatter onto both dimensions, as with jit(out_shardings=)).
            placed = tuple(placement_dims(user))
            if len(placed) != len(getattr(v.aval, "shape", ())):
                return None
            return tuple(placed[to_var[i]] if i in to_var else () for i in range(rank))
        if _whole_update(user, k):
            v = user.outvars[0]  # the update is the result, axis for axis
            continue
        if user.primitive.name not in _UNIT_AXIS_OPS or k != 0:
            return None
        step = _unit_axis_map(user)
        if step is None:
            return None
        to_var = {i: step[j] for i, j in to_var.items() if j in step}
        v = user.outvars[0]
    return None


def _whole_update(user: Any, k: int) -> bool:
    """Whether ``user`` writes its operand ``k`` over the whole of its result: a dynamic_update_slice whose update
    is its operand's shape (its offsets clamp to 0), JAX's transpose of a dynamic_slice that reads a whole table
    (keras-hub's position embedding at full length: its gradient is the batch sum written into zeros)."""
    if user.primitive.name != "dynamic_update_slice" or k != 1:
        return False
    return tuple(user.invars[1].aval.shape) == tuple(user.invars[0].aval.shape)


@register("pad")
def pad(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A pad along a split axis shifts each device's block by the low padding (collective-permutes).

    A result that does not divide is padded further by XLA to the next multiple and gathered whole;
    interior padding (a strided slice's transpose) is modelled as a gather of the axis first.
    """
    out_aval, src = eqn.outvars[0].aval, ins[0]
    if is_free(src):
        return [w.free(out_aval)]
    from .movement import mark_approximate

    dims = list(src.dims)
    config = eqn.params["padding_config"]
    uneven = _uneven_blocks(src, out_aval.shape, w.costs.mesh_sizes, [i for i, c in enumerate(config) if not c[2]])
    for axis, (low, high, interior) in enumerate(config):
        if not dims[axis]:
            continue
        start = len(w.ops)
        dims[axis] = _shift_axis(
            w, eqn, phase, repeat, src, axis, int(out_aval.shape[axis]), -int(low), interior, *_seen(uneven, axis)
        )
        if min(int(low), int(high)) < 0 and not interior:
            # A negative pad crops as it shifts: measured, XLA then sometimes moves one more piece than the
            # shift needs (up to a block's worth of bytes per device more than priced here).
            mark_approximate(w, start, "a negative (cropping) pad on a split axis: XLA may move one more piece")
    return [w.relayout(out_aval, dims)]


@register("slice")
def slice_static(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A static slice of a split axis is a shift (collective-permutes); a strided one gathers the axis."""
    out_aval, src = eqn.outvars[0].aval, ins[0]
    if is_free(src):
        return [w.free(out_aval)]
    strides = eqn.params.get("strides") or (1,) * len(src.shape)
    dims = list(src.dims)
    moved = [i for i, d in enumerate(dims) if d and src.shape[i] != out_aval.shape[i] and int(strides[i]) == 1]
    uneven = _uneven_blocks(src, out_aval.shape, w.costs.mesh_sizes, moved)
    for axis, start in enumerate(eqn.params["start_indices"]):
        if dims[axis] and src.shape[axis] != out_aval.shape[axis]:
            step = int(strides[axis])
            out_len = int(out_aval.shape[axis])
            seen = _seen(uneven, axis)
            dims[axis] = _shift_axis(w, eqn, phase, repeat, src, axis, out_len, int(start), step - 1, *seen)
    return [w.relayout(out_aval, dims)]


def _uneven_blocks(
    src: Layout, out_shape: Any, sizes: Mapping[str, int], axes: list[int]
) -> dict[int, tuple[int, int]]:
    """Of ``axes``, the split ones whose result does not divide its split (nor is smaller than it): XLA pads each
    to the next multiple, (its padded block, its length once gathered over the split's undividing part)."""
    out: dict[int, tuple[int, int]] = {}
    for i in axes:
        d, length = src.dims[i], int(out_shape[i])
        n = math.prod(sizes[m] for m in d)
        if not d or length % n == 0 or length < n:
            continue
        padded = -(-length // n) * n
        out[i] = (padded // n, padded // math.prod(sizes[m] for m in _small_result_split(d, length, sizes)))
    return out


def _seen(uneven: dict[int, tuple[int, int]], axis: int) -> tuple[dict[int, int], dict[int, int]]:
    """The other uneven axes' sizes as ``axis`` moves, and as it is gathered.  Measured (a pad of 16 x 16 to
    17 x 17 over (b, a) of 2 x 4): XLA shifts the axes in order, each seeing the earlier ones at their padded
    blocks, then gathers them in reverse order, each seeing the later ones gathered (padded) and the earlier
    ones still at their padded blocks: [1, 4] and [9, 3] permuted, [9, 20] and [18, 20] gathered."""
    before = {j: b for j, (b, _) in uneven.items() if j < axis}
    after = {j: (b if j < axis else g) for j, (b, g) in uneven.items() if j != axis}
    return before, after


def _shift_axis(
    w: WalkerLike,
    eqn: Any,
    phase: str,
    repeat: int,
    src: Layout,
    axis: int,
    out_len: int,
    offset: int,
    irregular: int,
    before: Mapping[int, int] | None = None,
    after: Mapping[int, int] | None = None,
) -> tuple[str, ...]:
    """Charge the move of a split axis whose result block ``k`` starts at ``k·o + offset``; its new split.

    ``before`` / ``after``: other axes' per-device sizes where XLA's differ from the operand's block as this axis
    moves and as it is gathered (other uneven axes, padded: :func:`_seen`)."""
    from .movement import charge, itemsize, mark_approximate, shift_pieces

    axes = src.dims[axis]
    n = math.prod(w.costs.mesh_sizes[m] for m in axes)
    dtype = eqn.invars[0].aval.dtype
    start = len(w.ops)
    if irregular and _strides_in_place(eqn.primitive.name, src.shape[axis], n, out_len, offset, irregular):
        return axes
    if irregular and eqn.primitive.name == "pad":
        # XLA partitions an interior pad as a window of one over the dilated operand: a halo exchange, the
        # axis kept split (rules_windows models XLA's windowed halos; imported here, not at module level).
        from .rules_windows import dilated_pad

        if dilated_pad(w, eqn, phase, repeat, src, axis, out_len, -offset, irregular):
            return axes
    if irregular:
        # Interior padding or a stride: each device's positions come from everywhere; gather the axis.
        whole = src.with_dims(tuple(() if i == axis else d for i, d in enumerate(src.dims)))
        w.change(eqn, phase, src, whole, dtype, repeat, f"{eqn.primitive.name} with a stride along a split axis")
        mark_approximate(w, start, "a stride or interior padding on a split axis: XLA permutes pieces, explain gathers")
        # XLA keeps the axis split instead, so every later op that moves positions along an axis of what is
        # computed from the result (a slice, pad, concatenate: an associative scan's levels, forward and
        # backward) moves pieces there, up to n - 1 collectives each, where explain's, on the gathered axis,
        # move nothing; and explain holds those values whole where XLA holds pieces (measured: a cummax
        # gradient on 16 rows over 8, XLA 22 permutes and 9 all-to-alls where explain gathers once, explain's
        # peak 2.3x XLA's).
        moves, moved, held = _moved_downstream(w, eqn.outvars[0])
        widen_bound(w, start, collectives=moves * (n - 1), sent=moved, peak=held)
        return ()
    # One position along the axis, per device: permutes move the operand's rows whole (measured: a slice of
    # rows and columns moves whole rows, then slices); a small result is sliced first, then all-reduced.
    out_shape = eqn.outvars[0].aval.shape
    sizes = w.costs.mesh_sizes
    row = math.prod((before or {}).get(i, a) for i, a in enumerate(src.shard_shape) if i != axis) * itemsize(dtype)
    gathered_row = math.prod((after or {}).get(i, a) for i, a in enumerate(src.shard_shape) if i != axis)
    gathered_row *= itemsize(dtype)
    small_row = itemsize(dtype)
    for i, (a, b, d) in enumerate(zip(src.shard_shape, out_shape, src.dims)):
        if i != axis:
            k = math.prod(sizes[m] for m in d)
            small_row *= min(a, int(b) // k if int(b) % k == 0 else int(b))
    block = src.shape[axis] // n
    why = f"{eqn.primitive.name} shifts a split axis"
    if out_len % n and out_len < n and offset >= 0:
        # A result smaller than the split (x[0], a last token): XLA brings its pieces to the first owner
        # (one permute per further block it spans), masks the others and all-reduces the small result.
        first, last = offset // block, (offset + out_len - 1) // block
        pieces = [min(offset + out_len, (j + 1) * block) - j * block for j in range(first + 1, last + 1)]
        charge(w, eqn, phase, repeat, "collective-permute", axes, [p * row for p in pieces], why)
        small = f"{eqn.primitive.name} of a small piece"
        padded_back = _padded_back(w, eqn.outvars[0])
        # Split over a tuple of mesh axes, XLA keeps the result split over the longest leading part of the
        # tuple that divides it and all-reduces the piece over the rest only (measured: x[0, :4] of columns
        # split over (a, b) of 4 x 2 leaves the 4 columns split over a; over (a, b, c) of 2 x 2 x 2 over (a, b)).
        kept = () if padded_back else _small_result_split(axes, out_len, sizes)
        reduced = axes[len(kept) :]
        piece = out_len // math.prod(sizes[m] for m in kept)
        charge(w, eqn, phase, repeat, "all-reduce", reduced, [piece * small_row], small)
        if padded_back:
            # A slice's gradient pads the piece back to the operand's shape: XLA keeps it on its device.
            mark_approximate(w, start, "the piece is padded back (a slice's gradient): XLA moves nothing")
            # ... and pads it back on its device into the operand's split, where explain's walk pads the
            # all-reduced piece whole (measured: explain over XLA's peak by up to the operand's whole array).
            # Measured too: XLA then sometimes still permutes one operand block to the first owner.
            # Measured as well (x[60:61, :1] of rows@c over 2, its gradient): XLA brings the piece to the first
            # owner and sends it back to its own (two permutes) where explain all-reduces: one more collective.
            block_bytes = math.prod(src.shard_shape) * itemsize(dtype)
            widen_bound(w, start, sent=block_bytes, peak=math.prod(src.shape) * itemsize(dtype), collectives=1)
        else:
            # Measured both ways, even for a piece on the first device: XLA sometimes moves it first (a
            # collective-permute), sometimes not; the all-reduce is always there.
            mark_approximate(w, start, "a small piece off the first device: XLA may add or drop a collective-permute")
            # ... of up to one operand block (measured: x[0, :2] of cols@a over 4, XLA permutes a 64-byte
            # column block to the first owner where explain's piece needs none).  A piece kept split over the
            # leading axes is all-reduced over the others only, but XLA may bring its parts to the kept owners
            # from anywhere in the split: up to n - 1 peers in all, as for a piece all-reduced over the split.
            spread = n - math.prod(sizes[m] for m in reduced)
            widen_bound(w, start, sent=math.prod(src.shard_shape) * itemsize(dtype), collectives=spread)
        return kept
    padded = -(-out_len // n) * n
    pieces = shift_pieces(src.shape[axis], n, padded, offset)
    charge(w, eqn, phase, repeat, "collective-permute", axes, [p * row for p in pieces], why)
    if padded == out_len:
        if padded // n < block and pieces:
            # Result blocks smaller than the operand's gather pieces from several devices: XLA's permutes
            # there vary (measured 2 where the exact movement takes 4).
            mark_approximate(w, start, "result blocks smaller than the operand's: XLA may send fewer permutes")
            # ... and may move a whole operand block where explain moves the result's rows, holding its send
            # and receive buffers besides both (measured: x[:22, :1] of 64 rows split in 2 permutes 21 whole
            # rows, XLA's peak 2.3x explain's).
            block_bytes = math.prod(src.shard_shape) * itemsize(dtype)
            widen_bound(w, start, sent=block_bytes, peak=2 * block_bytes)
        return axes
    # XLA pads the result to the next multiple of the split and gathers it whole -- over the split's mesh axes
    # past the longest leading part that divides the result, which it keeps split (measured: 12 of 16 rows
    # split over (a, b) of 4 x 2 stay split over a, gathered over b).
    kept = _small_result_split(axes, out_len, sizes)
    reduced = axes[len(kept) :]
    gathered = padded // math.prod(sizes[m] for m in kept)
    why = f"{eqn.primitive.name} result does not divide"
    charge(w, eqn, phase, repeat, "all-gather", reduced, [gathered * gathered_row], why)
    mark_approximate(
        w, start, f"a result of {out_len} does not divide {n} ways: XLA's permutes of the uneven blocks may differ"
    )
    # Peak: measured (tests/test_primitive_rules.py, pad 16 -> 17 rows over 8), XLA holds the padded, gathered
    # buffer as a temporary besides the result explain holds whole (+padded rows); or it keeps the result in
    # uneven pieces where explain holds it whole (a crop 16 -> 15 and its gradient's pad back, which XLA
    # simplifies to a local mask: -out_len rows).
    # Kept split over the leading axes, XLA may still move the pieces over the whole split (n - 1 peers).
    widen_bound(w, start, peak=(padded + out_len) * row, collectives=n - math.prod(sizes[m] for m in reduced))
    return kept


# Ops that move positions along an axis of a split operand (collective-permutes or all-to-alls on XLA's side).
_POSITIONAL = frozenset({"slice", "pad", "concatenate", "split", "rev", "dynamic_slice", "dynamic_update_slice"})
_DOWNSTREAM_LIMIT = 4096  # equations followed from one mark (a bound, not a walk: big programs stop early)


def _moved_downstream(w: WalkerLike, v: Any) -> tuple[int, int, int]:
    """How many positional ops (:data:`_POSITIONAL`) compute from ``v``, directly or through any op, the bytes
    of their results and the bytes of every value computed from ``v`` (whole): what XLA moves (at most each
    positional result, whole) and what explain holds whole once ``v``'s axis is gathered where XLA keeps it
    split.  Followed up to :data:`_DOWNSTREAM_LIMIT` equations."""

    seen: set[int] = set()
    todo, moves, moved, held = [v], 0, 0, 0
    while todo and len(seen) < _DOWNSTREAM_LIMIT:
        for e, _ in w.uses.get(id(todo.pop()), ()):
            if id(e) in seen:
                continue
            seen.add(id(e))
            positional = e.primitive.name in _POSITIONAL
            moves += positional
            for out in e.outvars:
                aval: Any = getattr(out, "aval", None)  # a token or an abstract ref has no shape
                if hasattr(aval, "shape") and hasattr(aval, "dtype"):
                    size = int(math.prod(aval.shape)) * dtype_itemsize(aval.dtype)
                    held += size
                    moved += size if positional else 0
                todo.append(out)
    return moves, moved, held


def _small_result_split(axes: tuple[str, ...], out_len: int, sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The leading part of a split's mesh axes (never all of them) that a result of ``out_len``, which the
    whole split does not divide, stays split over: the longest whose size divides it; () for one mesh axis."""
    for cut in range(len(axes) - 1, 0, -1):
        if out_len % math.prod(sizes[m] for m in axes[:cut]) == 0:
            return axes[:cut]
    return ()


def _strides_in_place(name: str, length: int, n: int, out_len: int, offset: int, irregular: int) -> bool:
    """Whether a stride or interior padding along an axis split ``n`` ways maps each device's block onto the
    result's block on the same device, so that XLA moves nothing (measured: x[:, s::k] of 32 rows over 4 or 8,
    s < k, and its transpose, a pad (low, high, interior) with low + high = interior: no collectives, the
    result split as the operand).

    A pad (``offset`` = -low, ``irregular`` = interior ``i``): element j lands at low + j(1 + i), inside block
    k's rows of the padded result while low <= i and the result is the operand's rows times 1 + i.  A slice
    (``offset`` = start, ``irregular`` = stride - 1): block k keeps its own every stride-th row while the blocks
    are whole multiples of the stride and the start lies in the first stride."""
    step = irregular + 1
    if name == "pad":
        return 0 <= -offset <= irregular and out_len == length * step
    if name == "slice":
        return 0 <= offset < step and (length // n) % step == 0 and out_len == length // step
    return False


def widen_bound(w: WalkerLike, since: int, *, sent: float = 0.0, peak: float = 0.0, collectives: int = 0) -> None:
    """Widen the bound of the last op marked approximate since ``since`` by ``sent`` bytes, ``peak`` bytes and
    ``collectives``: XLA's alternative moves or holds that much more than the op's own collectives (once, not
    per op: the report sums the ops' bounds)."""
    from dataclasses import replace

    from .report import default_bound

    marked = [i for i in range(since, len(w.ops)) if w.ops[i].approximate]
    if w.quiet or not marked:
        return
    op = w.ops[marked[-1]]
    base = op.bound or default_bound(op)  # each collective's buffer moved another way, one per peer
    w.ops[marked[-1]] = replace(
        op,
        bound=replace(base, collectives=base.collectives + collectives, bytes=base.bytes + sent, peak=base.peak + peak),
    )


@register("dynamic_slice")
def slice_(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A slice keeps whole axes' sharding; an axis it cuts must be gathered first."""
    src, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(src):
        return [w.free(out_aval)]
    out_shape = tuple(int(s) for s in out_aval.shape)
    cut = [i for i, (a, b) in enumerate(zip(src.shape, out_shape)) if a != b and src.dims[i]]
    dims = list(src.dims)
    if cut and eqn.primitive.name == "dynamic_slice" and explicit_dims(out_aval) is not None:
        # A run-time offset on Explicit axes: XLA replicates the operand along every split axis, not only
        # the cut ones, then slices the typed result locally (measured: [16@b, 24@a] sliced to [2, 24]
        # gathers over a too).  On Auto axes it gathers the cut ones only (measured).
        cut = [i for i, d in enumerate(src.dims) if d]
    if cut:
        why = f"{eqn.primitive.name} cuts a sharded axis"
        # One axis at a time from the last, as XLA gathers (measured: [16@a, 16@b] gathers [4, 16] over b,
        # then [16, 16] over a).
        # Each step moves the layout the one before made (the walker follows it to the value: a later reader
        # of the same value gathered alike reuses XLA's gathered copy, as a dynamic_update_slice's gradient
        # and the dynamic_slice of its update's gradient do).
        step = src
        for i in reversed(cut):
            dims[i] = ()
            gathered = src.with_dims(tuple(dims))
            w.change(eqn, phase, step, gathered, out_aval.dtype, repeat, why)
            step = gathered
        w.bind_copy(eqn.invars[0], step)  # the gathered copy is live while it is sliced
        # On Explicit axes the result's type keeps the operand's split where it divides: sliced locally
        # from the gathered operand (no further collective).
        typed = explicit_dims(out_aval)
        if typed is not None:
            dims = [t if i in cut else d for i, (d, t) in enumerate(zip(dims, typed))]
    return [w.relayout(out_aval, dims)]


def explicit_dims(aval: Any) -> list[tuple[str, ...]] | None:
    """The split a value's type names on Explicit mesh axes (None when its type names none)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None or not any(e is not None for e in spec):
        return None
    return spec_dims(spec, len(aval.shape))


def spec_dims(spec: Any, rank: int) -> list[tuple[str, ...]]:
    """A PartitionSpec's mesh axes per dimension of a ``rank``-dimensional value (whole: ``()``)."""
    entries = list(spec) + [None] * (rank - len(spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]


def all_explicit(aval: Any) -> bool:
    """Whether every axis of the mesh a value's type names is Explicit.  On a mixed mesh the type says nothing of
    the Auto axes (their splits are the propagation's), so a type there cannot stand for the whole layout."""
    types = getattr(getattr(getattr(aval, "sharding", None), "mesh", None), "axis_types", ())
    return bool(types) and all("Explicit" in str(t) for t in types)


def typed_dims(aval: Any) -> list[tuple[str, ...]] | None:
    """The split a value's type names where that type is its whole layout (:func:`all_explicit`), else None."""
    return explicit_dims(aval) if all_explicit(aval) else None


@register("concatenate")
def concatenate(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    axis = eqn.params["dimension"]
    out_aval = eqn.outvars[0].aval
    placed = [lay for lay in ins if not is_free(lay)]
    dims = concatenated_dims([lay.dims for lay in placed], axis)
    start = len(w.ops)
    # Operands split differently off the axis: the result is whole there (Shardy merges no split), but XLA's
    # partitioner joins them on the most-split operand's split (the others resharded to it: a regroup's
    # permute, a whole one sliced) and gathers the joined result (measured: [16, 16@b] ++ [16, 16@a] along
    # rows permutes the first and gathers [32, 4] over a; [16, 16@(a,b)] ++ [16, 16@b] permutes the second).
    joined = _joined_on(placed, axis, dims, w.costs.mesh_sizes)
    moved = moved_off_axis(joined, [lay.dims for lay in placed], axis, out_aval.shape, w.costs.mesh_sizes)
    if moved is not None:
        # Joined along a split axis: XLA's partitioner moves that split onto another dimension (each operand
        # split along the axis: an all-to-all; a whole one: sliced), joins the pieces locally and moves the
        # result's split back (an all-to-all) or gathers it where the result is whole along the axis (measured:
        # [16, 16] ++ [16@b, 16]: two all-to-alls; rows@c ++ rows@(a,b,c): two all-to-alls and a gather).
        joined = moved
    for lay in placed:
        # Each operand comes to the split it is joined on off the axis (a whole one is sliced locally, a
        # differently split one moves) and whole along it.
        want = lay.with_dims(tuple(d if i != axis else () for i, d in enumerate(joined)))
        w.change(eqn, phase, lay, want, out_aval.dtype, repeat, "concatenate")
    if tuple(joined) != tuple(dims):
        out = w.relayout(out_aval, joined)
        w.change(
            eqn,
            phase,
            out,
            out.with_dims(tuple(dims)),
            out_aval.dtype,
            repeat,
            "concatenate: the joined result to its merged split",
        )
    if any(lay.dims[axis] for lay in placed):
        # Measured: XLA keeps the split and moves pieces (a collective-permute and all-to-alls of
        # about the operands' blocks); explain gathers the operands along the axis (same order of bytes).
        mark_approximate(w, start, "concatenate along a split axis: XLA permutes and all-to-alls, explain gathers")
    return [w.relayout(out_aval, dims)]


def moved_off_axis(
    joined: list[tuple[str, ...]],
    operands: list[tuple[tuple[str, ...], ...]],
    axis: int,
    shape: tuple[int, ...],
    mesh: Mapping[str, int],
) -> list[tuple[str, ...]] | None:
    """Where XLA joins operands split along the concatenated axis: that split (the most-split operand's among
    those on mesh axes the other dimensions leave free, the first among equals) moved onto the first other dimension it divides, after that dimension's own split.
    None: no operand is split along the axis, or no other dimension takes the split (the operands are gathered
    along the axis instead)."""
    used = {m for i, d in enumerate(joined) if i != axis for m in d}
    # (a split naming a mesh axis the other dimensions keep is gathered, not moved: measured, rows@b ++ rows@a
    # with a splitting the first one's columns moves b)
    splits = [d[axis] for d in operands if d[axis] and not set(d[axis]) & used]
    if not splits:
        return None
    taken = max(splits, key=lambda d: math.prod(mesh.get(m, 1) for m in d))  # first among equals
    for other in (i for i in range(len(shape)) if i != axis):
        ways = math.prod(mesh.get(m, 1) for m in joined[other] + taken)
        if shape[other] % ways == 0:
            return [(joined[i] + taken) if i == other else () if i == axis else joined[i] for i in range(len(shape))]
    return None


def _joined_on(
    placed: list[Layout], axis: int, dims: list[tuple[str, ...]], mesh: Mapping[str, int]
) -> list[tuple[str, ...]]:
    """The split off ``axis`` on which XLA joins operands split differently there: the most-split operand's
    (the largest among equals, then the first), where the merged result (``dims``) is whole on a dimension they split differently;
    else ``dims`` itself."""
    rank = len(dims)
    differ = [i for i in range(rank) if i != axis and len({lay.dims[i] for lay in placed if lay.dims[i]}) > 1]
    if not differ:
        return dims
    # Equally split ones: the largest operand's (measured: rows@a ++ rows@(b,c) ++ rows@(a,b), 16, 32 and 64
    # columns, are joined on (a, b): the first sliced, the second permuted).
    best = max(
        placed, key=lambda lay: (math.prod(mesh.get(m, 1) for i in differ for m in lay.dims[i]), math.prod(lay.shape))
    )
    joined = list(dims)
    used = {m for i, d in enumerate(dims) if i not in differ for m in d}
    for i in differ:
        if not set(best.dims[i]) & used:
            joined[i] = best.dims[i]
            used |= set(best.dims[i])
    return joined


def concatenated_dims(operands: list[tuple[tuple[str, ...], ...]], axis: int) -> list[tuple[str, ...]]:
    """The result's split of a concatenation, as Shardy merges its operands' splits, dimension by dimension as
    an elementwise op's (:func:`merged_split`, a whole operand taking any): the longest split where the others
    are its prefixes, else the prefix they share; off the concatenated axis first, then along it, each keeping
    the prefix of its merged split no earlier dimension took.  Measured: off the axis, a whole operand joined
    to one split along its columns keeps the columns' split, rows@a ++ rows@(a,b) (joined along columns) keeps
    (a, b) with no collective, cols@b ++ cols@a is whole; along it, rows@a ++ rows@(a,b) keeps (a, b),
    rows@(a,b) ++ rows@(a,c) keeps a, rows@c ++ rows@(a,b,c) and rows@a ++ rows@b are whole, cols@a ++ cols@b is
    whole though b splits the first one's rows, and rows@a ++ rows@(a,b) with b taken by the columns keeps a."""
    if not operands:
        return []
    rank = len(operands[0])
    dims: list[tuple[str, ...]] = [()] * rank
    used: set[str] = set()
    for i in [i for i in range(rank) if i != axis] + [axis]:
        splits = [d[i] for d in operands if d[i]]
        if not splits:
            continue
        merged = merged_split(splits)
        free = 0
        while free < len(merged) and merged[free] not in used:
            free += 1
        dims[i] = merged[:free]
        used |= set(dims[i])
    return dims


def reshape_dims(
    src_shape: tuple[int, ...], src_dims: tuple[tuple[str, ...], ...], out_shape: tuple[int, ...]
) -> list[tuple[str, ...]] | None:
    """Where each sharded input axis lands after a reshape, or None if one cannot stay sharded.

    Axes are matched in groups whose sizes multiply to the same number; inside
    a group the sharding must sit on the group's major (first non-1) axis on
    both sides, which is the case where a block-sharded layout survives.
    """
    out: list[tuple[str, ...]] = [()] * len(out_shape)
    groups = reshape_groups(src_shape, out_shape)
    if groups is None:
        return None
    for gi, gj in groups:
        sharded = [k for k in gi if k < len(src_shape) and src_dims[k]]
        if sharded:
            major_in = next(k for k in gi if src_shape[k] != 1)
            major_out = next((k for k in gj if k < len(out_shape) and out_shape[k] != 1), None)
            if sharded != [major_in] or major_out is None:
                return None
            out[major_out] = src_dims[major_in]
    return out


def reshape_groups(src_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """A reshape's input and result dimensions in groups whose sizes multiply to the same number, in order (a
    dimension of size 1 a group of its own where both sides have one; positions past a side's end stand for 1);
    None where the sizes do not line up."""
    groups = []
    i = j = 0
    while i < len(src_shape) or j < len(out_shape):
        gi, gj = [i], [j]
        a = src_shape[i] if i < len(src_shape) else 1
        b = out_shape[j] if j < len(out_shape) else 1
        while a != b:
            if a < b:
                i += 1
                if i >= len(src_shape):
                    return None
                gi.append(i)
                a *= src_shape[i]
            else:
                j += 1
                if j >= len(out_shape):
                    return None
                gj.append(j)
                b *= out_shape[j]
        groups.append((gi, gj))
        i, j = gi[-1] + 1, gj[-1] + 1
    return groups


@register("bitcast_convert_type")
def bitcast_convert_type(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """Same-size dtypes keep the layout; a size change adds or drops a minor axis, which stays whole."""
    src, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(src):
        return [w.free(out_aval)]
    rank = len(out_aval.shape)
    dims = list(src.dims[:rank]) + [()] * max(rank - len(src.dims), 0)
    if rank < len(src.dims) and src.dims[-1]:
        whole = src.with_dims((*src.dims[:-1], ()))
        w.change(eqn, phase, src, whole, eqn.invars[0].aval.dtype, repeat, "bitcast folds a split minor axis")
    return [w.relayout(out_aval, dims)]


@register("create_token", "dce_sink", "platform_index")
def no_data(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """Tokens, DCE anchors and the platform switch's index: no array moves."""
    return [w.replicated(v.aval) for v in eqn.outvars]


def _padded_back(w: WalkerLike, v: Any, depth: int = 4) -> bool:
    """Whether a value reaches a ``pad`` through elementwise ops (a slice's gradient pads its cotangent back)."""
    for e, _ in w.uses.get(id(v), ()):
        name = e.primitive.name
        if name == "pad":
            return True
        if depth and name in ELEMENTWISE and e.outvars and _padded_back(w, e.outvars[0], depth - 1):
            return True
    return False
