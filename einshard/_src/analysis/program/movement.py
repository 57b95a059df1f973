"""What XLA's SPMD partitioner sends when an op reads neighbours' data: halo exchanges and shifted pieces.

Two measured patterns (one-op programs on the 8-CPU-device mesh, ``.compile().as_text()``):

* a **shift** (``slice``, ``split``, ``pad`` along a split axis): device ``k`` of the result needs the input
  positions ``[k·o + offset, (k+1)·o + offset)``; each piece that lives on another device arrives by a
  collective-permute, one per distinct source-to-destination distance, as large as the largest piece at
  that distance (``x[:, 4:20]`` on 2 devices: one permute of 4 columns);
* a **halo** (``conv_general_dilated``, ``reduce_window*`` along a split spatial axis): the window reaches
  ``left`` positions into the previous device's block and ``right`` into the next one's; each side is one
  collective-permute per device block it spans.  Several split axes exchange one after another, each
  moving the block already grown by the previous axes' halos (a 2-D split's second exchange carries the
  corners).

These functions are pure arithmetic on sizes; the rules (``rules_ordering``, ``rules_windows``) price
them and record them on the walker with :func:`charge`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

from ..cost import Collective, sent_bytes
from .alternatives import offer
from .report import APPROXIMATE_MARK, OpBound
from .values import dtype_itemsize

if TYPE_CHECKING:
    from .registry import WalkerLike

__all__ = [
    "APPROXIMATE",
    "shift_pieces",
    "halo_pieces",
    "charge",
    "itemsize",
    "group_size",
    "mark_approximate",
    "mark_conflict",
    "mark_open_merge",
    "mark_swap",
    "is_computed",
]

# The note that marks an op whose collectives turn on an XLA heuristic explain does not reproduce
# (``OpReport.note`` starts with it, followed by what may differ and by how much).
APPROXIMATE = APPROXIMATE_MARK

SentKind = Literal["all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"]


def mark_approximate(w: WalkerLike, since: int, why: str, bound: OpBound | None = None) -> None:
    """Mark the ops recorded since index ``since`` as approximate (``OpReport.note``), saying what may differ.

    ``bound``: how far XLA may be from each of them, where its alternative moves more than the op's own
    collectives (None: the report's default, each collective's buffer moved another way)."""
    if w.quiet:
        return
    from dataclasses import replace

    for i in range(since, len(w.ops)):
        w.ops[i] = replace(w.ops[i], note=f"{APPROXIMATE}: {why}", bound=bound or w.ops[i].bound)


# Why a conflict is approximate, in the op's note (the report's first line names the op and its line).
CONFLICT_NOTE = (
    "operands split one mesh axis along different dimensions, and the moved one is computed in the program: XLA's sharding "
    "propagation may instead carry the other's split back through the ops that compute it (gathering their "
    "inputs) and settle the sums after it another way (a reduce-scatter for an all-reduce)"
)


def mark_conflict(w: WalkerLike, eqn: Any, since: int, moved: list[int], alternative: bool = False) -> None:
    """Mark an all-to-all that settles a layout conflict between an op's operands, where XLA may not make it.

    XLA makes the all-to-all where the moved operand is an argument or a constrained value; where it is computed,
    its propagation carries the winning split backward through the ops that compute it.  Where every route ends in
    a plain all-gather (a top-k router's indices and probabilities), the rules settle the conflict that way
    (:mod:`.upstream`, exact: tests/test_moe_rules.py) and this mark never fires.  It fires where explain cannot
    follow the route (it reaches a dot's result or an op :mod:`.upstream` does not carry a split through: dense
    softmax routing weights, tests/test_explain_approximate.py), so the all-to-all is explain's guess, with a bound
    that covers the moves XLA may make instead: per operand and for the result, one collective per peer of the
    all-to-all's group; bytes and peak up to the moved operands' and the result's whole arrays (what XLA may gather or
    sum instead, or hold whole).  ``moved``: the indices of the operands the all-to-all moved.
    ``alternative``: the rule takes XLA's other choice when asked (:func:`.alternatives.taking`: the computed
    operand's split wins), so the report walks the program under it too and the bound covers what it changes
    downstream.
    """
    new = w.ops[since:]
    a2a = [c for op in new for c in op.collectives if c.kind == "all-to-all"]
    computed = [k for k in moved if is_computed(w, eqn.invars[k])]
    if not a2a or not computed:
        return
    peers = max(max(1, c.group_size - 1) for c in a2a)
    whole = sum(_whole_bytes(eqn.invars[k].aval) for k in computed)
    whole += sum(_whole_bytes(v.aval) for v in eqn.outvars)
    bound = OpBound(peers * (len(eqn.invars) + 1), float(whole), float(whole))
    mark_approximate(w, since, CONFLICT_NOTE, bound)
    if alternative:
        offer(w, eqn, since)


# Why a merge that dropped splits is approximate (the report's first line names the op and its line).
MERGE_NOTE = (
    "operands split one dimension differently and the result is read on: Shardy leaves such a result open and may "
    "give it a split from another reader (in a gradient, the cotangent's ops reach it first), which then wins"
)


def mark_open_merge(w: WalkerLike, eqn: Any, since: int) -> None:
    """Mark an elementwise op whose operands' splits merged to less than one of them (:func:`.rules_structural.
    merged_dims`: a dimension whose splits differ keeps only their common prefix) where its result is read by
    another op.  Shardy does not write such a merge: the result stays open, and any other op that reads or
    makes it (its cotangent's selects, a product with an argument) may settle it on one operand's split, which
    then wins here (measured: the gradient of ``jnp.where(c, a, b)`` with a ``[24@b]``, b ``[24@(a,b)]``,
    c ``[24@a]`` runs the select on c's split; of ``a * b``, a ``[16@b]``, b ``[16@(a,b)]``, on b's).  Where the
    result only leaves the program, nothing reaches it and the merge is XLA's (exact, unmarked).  The bound: each
    operand and the result moved another way, one collective per peer of the widest move's group, and up to the
    operands' and the result's whole arrays (what XLA may gather instead, or hold whole)."""
    if w.quiet or all(id(v) in w.program_outputs and not w.uses.get(id(v)) for v in eqn.outvars):
        return  # (a call body's result read outside it is not among the body's uses, nor does it leave)
    new = w.ops[since:]
    peers = max((max(1, c.group_size - 1) for op in new for c in op.collectives), default=0)
    if not peers:
        return
    whole = sum(_whole_bytes(v.aval) for v in eqn.invars if hasattr(v, "aval") and v.aval.shape)
    whole += sum(_whole_bytes(v.aval) for v in eqn.outvars)
    mark_approximate(w, since, MERGE_NOTE, OpBound(peers * (len(eqn.invars) + 1), float(whole), float(whole)))


# Why an operand's swap of split dimensions is approximate (the report's first line names the op and its line).
SWAP_NOTE = (
    "an operand's split moves whole to another dimension over other mesh axes: XLA gathers it, or all-to-alls it "
    "there and permutes the blocks to the devices the target names, by the device order of the layout it meets"
)


def mark_swap(w: WalkerLike, since: int, src: Any, dst: tuple[tuple[str, ...], ...], dtype: Any) -> None:
    """Mark the move recorded since ``since`` where it takes ``src``'s one split dimension whole to another
    dimension split over as many devices, its major mesh axis leaving (``[x@b, y] -> [x, y@c]``): the layout
    algebra gathers it, as XLA's partitioner does for that reshard alone (core.moves._swapped_tiles), but as an
    elementwise op's operand whose partner moves too XLA may swap the tiles with an all-to-all and a
    collective-permute (measured on (2, 2, 2): a[16@b, 16] * b[16@a, 16@c] all-to-alls and permutes a, 512 B
    each, where a[16@b, 16] * b[16, 16@c] gathers a; the device order of the target it inherits decides, which a
    Layout does not carry).  The bound: two collectives for the gather, and both moves of the block, each of
    ``src``'s shard, in bytes and in peak."""
    if w.quiet or len(w.ops) <= since:
        return
    split_src = [i for i, d in enumerate(src.dims) if d]
    split_dst = [j for j, d in enumerate(dst) if d]
    if len(split_src) != 1 or len(split_dst) != 1 or split_src == split_dst:
        return
    i, j = split_src[0], split_dst[0]
    if src.dims[i][0] in dst[j]:
        return
    own = sum(c.array_bytes for op in w.ops[since:] for c in op.collectives)
    if group_size(w, src.dims[i]) != group_size(w, dst[j]):
        # Over unequal groups the algebra slices the new split first and gathers the smaller piece, as XLA's
        # partitioner does for that reshard alone; as an elementwise op's operand XLA may find no such path and
        # gather it whole ("Involuntary full rematerialization", measured on (4, 2): lo[16@b, 16] in
        # lax.clamp(lo, x[16@(a,b), 16], hi[16@b, 16@a]) is gathered whole, 1024 B, where the same lo in
        # jnp.where(x > 0, lo, hi) is sliced first, 256 B).  The bound: the whole array gathered, in bytes and peak.
        whole = math.prod(src.shape) * itemsize(dtype)
        mark_approximate(w, since, REMAT_NOTE, OpBound(1, float(max(0, whole - own)), float(whole)))
        return
    shard = math.prod(src.shard_shape) * itemsize(dtype)
    mark_approximate(w, since, SWAP_NOTE, OpBound(2, float(own + 2 * shard), float(2 * shard)))


def mark_gather_then_shift(w: WalkerLike, since: int, src: Any, dst: tuple[tuple[str, ...], ...], dtype: Any) -> None:
    """Mark the move recorded since ``since`` where a dimension of ``src`` loses its major mesh axes to a gather and
    its minor ones to an all-to-all onto a dimension ``src`` keeps whole (``[x@(a,b), y] -> [x, y@b]``): the layout
    algebra all-to-alls b and gathers a, as XLA does where its propagation gives a neighbour that layout; as a
    reshard of its own XLA finds no direct path and gathers the value whole (measured on (4, 2) and (2, 2, 2):
    the identity to P(None, 'b') from P(('a', 'b')) is one all-gather of the whole array, and ``x * 2`` so on
    Explicit axes, where on Auto axes it is the all-to-all and the gather; a dynamic_update_slice's update lined
    up so is gathered whole).  The bound: one collective, and the whole array against the moves' own bytes."""
    if w.quiet or len(w.ops) <= since:
        return
    dst_at = {m: j for j, d in enumerate(dst) for m in d}
    for i, d in enumerate(src.dims):
        shifted = [k for k, m in enumerate(d) if m in dst_at and dst_at[m] != i and not src.dims[dst_at[m]]]
        gathered = [k for k, m in enumerate(d) if m not in dst_at]
        if shifted and gathered and max(gathered) < min(shifted):
            whole = math.prod(src.shape) * itemsize(dtype)
            own = sum(c.array_bytes for op in w.ops[since:] for c in op.collectives)
            mark_approximate(w, since, REMAT_NOTE, OpBound(1, float(abs(whole - own)), float(whole)))
            return


# Why an operand's split moved to another dimension over a group of another size is approximate.
REMAT_NOTE = (
    "an operand's split moves to another dimension over a group of another size: explain slices the new split "
    "first and gathers the piece; XLA may gather the operand whole and slice it after (its 'involuntary full "
    "rematerialization', by the device order of the layout it meets)"
)


def is_computed(w: WalkerLike, v: Any) -> bool:
    """Whether XLA's propagation may change ``v``'s layout: not a literal, an argument or a constrained value."""
    return not hasattr(v, "val") and id(v) not in w.pinned


def _whole_bytes(aval: Any) -> int:
    return int(math.prod(int(s) for s in aval.shape)) * itemsize(aval.dtype)


def itemsize(dtype: Any) -> int:
    return dtype_itemsize(dtype)


def group_size(w: WalkerLike, axes: tuple[str, ...]) -> int:
    return math.prod(w.costs.mesh_sizes[m] for m in axes)


def shift_pieces(length: int, n: int, out_length: int, offset: int) -> list[int]:
    """Collective-permute sizes (positions along the axis) for a result whose device ``k`` holds
    ``[k·o + offset, (k+1)·o + offset)`` of an input split ``n`` ways (``o = out_length / n``)."""
    s, o = length // n, out_length // n
    by_distance: dict[int, int] = {}
    for k in range(n):
        lo, hi = max(k * o + offset, 0), min((k + 1) * o + offset, length)
        for j in range(lo // s, -(-hi // s)):
            piece = min(hi, (j + 1) * s) - max(lo, j * s)
            if j != k and piece > 0:
                by_distance[j - k] = max(by_distance.get(j - k, 0), piece)
    return [by_distance[d] for d in sorted(by_distance)]


def halo_pieces(
    length: int,
    n: int,
    out_length: int,
    window: int,
    stride: int,
    dilation: int,
    low: int,
    window_split: bool = False,
) -> list[int]:
    """Collective-permute sizes (positions) of a windowed read along one axis split ``n`` ways.

    Device ``k`` computes result positions ``[a, b)`` over window taps ``[p, q)``; result position ``r``
    with tap ``t`` reads input ``r·stride + t·dilation - low``.  Normally the result is split and every
    device runs the whole window; a window split too (``window_split``: a kernel gradient, whose
    "window" is the split cotangent) gives each device its block of taps and the whole result.
    """
    s = length // n
    left = right = 0
    for k in range(n):
        if window_split:
            a, b, p, q = 0, out_length, k * (window // n), (k + 1) * (window // n)
        else:
            o = out_length // n
            a, b, p, q = k * o, (k + 1) * o, 0, window
        start = a * stride + p * dilation - low
        end = (b - 1) * stride + (q - 1) * dilation - low + 1
        if k > 0:
            left = max(left, k * s - start)
        if k < n - 1:
            right = max(right, end - (k + 1) * s)
    pieces = []
    for side in (left, right):
        while side > 0:
            pieces.append(min(side, s))
            side -= s
    return pieces


def idle_slice_sum(w: WalkerLike, summed: tuple[str, ...], n: int, block: int) -> tuple[Collective, ...]:
    """A dot's partial sum over ``summed`` (``n`` devices) spread over the idle mesh axes, as XLA does where they
    hold at least as many devices: each idle group all-reduces the ``block``-byte slice of the result its devices
    own, then permutes it onto the result's split (rules_indexing.scatter_to_consumers, rules_control's sum
    carry: one pair of collectives, the same words in both)."""
    steps: tuple[tuple[SentKind, str], ...] = (
        ("all-reduce", "dot partial sums (a slice per idle group)"),
        ("collective-permute", "dot result moved from the idle groups' slices onto its split"),
    )
    out = []
    for kind, why in steps:
        sent = sent_bytes(kind, n, block)
        t = w.costs.profile.collective_time(kind, n, sent, block)
        out.append(Collective(kind, summed, n, int(sent), int(block), t, "result", why))
    return tuple(out)


def charge(
    w: WalkerLike,
    eqn: Any,
    phase: str,
    repeat: int,
    kind: SentKind,
    axes: tuple[str, ...],
    arrays: list[int],
    why: str,
    out: Any = None,
    note: str = "",
) -> None:
    """Record one collective of ``kind`` over ``axes`` per buffer size in ``arrays`` (bytes, XLA's convention)."""
    n = group_size(w, axes)
    if n <= 1 or not arrays:
        return
    colls = []
    for array in arrays:
        sent = sent_bytes(kind, n, array)
        t = w.costs.profile.collective_time(kind, n, sent, array)
        colls.append(Collective(kind, axes, n, int(sent), int(array), t, "operand 1", why))
    w.record(eqn, phase, why, out, tuple(colls), 0.0, sum(c.time for c in colls), repeat, note)
