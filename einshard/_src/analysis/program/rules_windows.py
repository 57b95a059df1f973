"""Layout rules for windowed ops: convolutions and pooling (``reduce_window*``, ``select_and_scatter_add``).

A convolution is a dot whose spatial axes slide a window.  What XLA's SPMD partitioner compiles, measured
on one-op programs (tests/test_primitive_rules.py checks it):

* a batch split (the input's batch axis) and an output-feature split (the kernel's) stay local;
* an input-feature split on both operands leaves partial sums: one all-reduce of the result (the
  kernel gradient under data parallelism is such a conv: its contracted "feature" is the batch);
* a spatial split keeps the result split and exchanges halos: per split axis, one collective-permute
  per neighbour block the window reaches into, each side (:func:`.movement.halo_pieces`); a 3×3 SAME conv
  on rows split 4 ways sends one row up and one down;
* a kernel gradient whose window (the cotangent's spatial axes) is split like the input's exchanges the
  input's halos and sums the result over the split (all-reduce);
* an input whose features are split like the kernel's outputs is gathered, unless the mesh axes neither
  operand uses hold more devices than that split: XLA then moves the input's features onto them (one
  collective-permute) and sums there (one all-reduce), or gathers the input over them when the result's
  block is the larger (:func:`_regroup_axes`); idle axes count when they hold at least as many devices;
* an input gradient between channel-split convs goes back split like the activations' channels: a
  reduce-scatter, or with idle mesh axes at least as large, an all-reduce of the channel slice each idle
  group computes plus one collective-permute into place (:func:`_scatter_axes`);
* the input's batch and the kernel's outputs split over the same mesh axes (FSDP): the result takes the
  split Shardy's propagation gives it (:func:`_features_win`) and XLA gathers the other operand, over idle
  axes after a permute onto them where they are at least as large; partial sums asked back split over the
  summed axes are one reduce-scatter (:func:`_asked_scatter_dim`);
* a depthwise conv (a group a channel) under FSDP, the batch and the kernel's outputs split alike: XLA moves the
  input's split from the batch onto the channels (an all-to-all) and the result back (another)
  (:func:`_depthwise_regroup`); its kernel gradient (a ``batch_group_count`` conv) is local where the groups are
  split like the cotangent's channels (:func:`_batch_groups_split_alike`), and with the batch split on a 2-D mesh
  all-reduced over the whole mesh, as jax 0.10.2's XLA miscompiles it (tests/test_xla_depthwise_grad_miscompile.py);
* a window longer than the result: Shardy gives the result's axis a factor of its own, its split the one its
  readers ask for.  Where an elementwise reader meets it with a value split along the axis (a residual add of a
  rows-split shortcut, :func:`_rows_asked`), XLA keeps (or slices, free) the input's rows split and exchanges
  halos; else it gathers the input's rows, the result whole along them, marked approximate: an ask the
  look-ahead does not see (through a call, in the backward pass) is one shared fork's (:data:`ROWS_SPLIT_FORK`),
  walked for the bound; a window as long as the result keeps the rows split, marked, the gathered rows its fork.

Pooling is the same window without a kernel: a non-overlapping pool (2×2, stride 2) of blocks that
divide moves nothing; an overlapping one exchanges halos.  A max pool's gradient (``select_and_scatter_add``)
exchanges the halos XLA's partitioner computes, not each shard's own need (:func:`_scatter_exchange`), with
the pad and slice JAX's CPU / GPU lowering puts around a padded window.  Cases XLA handles by heuristics
explain does not reproduce (a transposed conv's ``lhs_dilation`` on uneven blocks, grouped convs, a result
that does not divide) gather the axis or exchange what explain can model, and are marked approximate on the
op (``OpReport.note``), their bound counting XLA's other way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout
from .alternatives import offer, taking
from .costing import is_free
from .idle_axes import gather_route
from .lookahead import home_of
from .movement import charge, group_size, halo_pieces, itemsize, mark_approximate
from .registry import register
from .rules_structural import all_explicit, explicit_dims, widen_bound
from .slice_halo import HaloSend, Pieces, exchange_pieces, group_compact_sends
from .values import CARRIERS, ELEMENTWISE, Derived, Partial
from .xla_behaviour import xla_behaviour

if TYPE_CHECKING:
    from .registry import WalkerLike as Walker  # the rules type against the protocol, not walker.py

__all__ = [
    "conv_general_dilated",
    "dilated_pad",
    "reduce_window",
    "select_and_scatter_add",
    "windowed_pieces",
    "WINDOW_REDUCTIONS",
]

WINDOW_REDUCTIONS = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")


class PaddedBlocks(Derived):
    """The split XLA keeps a value on padded (uneven) blocks where explain's layouts, which split evenly only, hold
    it whole: an interior pad's result that a window sum reads (an average pool's gradient), bound to a layout
    whose ``dims`` name those splits (:func:`dilated_pad` writes it, :func:`reduce_window` reads it)."""


def _with(lay: Layout, axis: int, dims: tuple[str, ...]) -> Layout:
    return lay.with_dims(tuple(dims if i == axis else d for i, d in enumerate(lay.dims)))


def _bring(w: Walker, eqn: Any, phase: str, repeat: int, k: int, lay: Layout, want: Layout, why: str) -> Layout:
    if not is_free(lay) and lay.dims != want.dims:
        w.change(eqn, phase, lay, want, eqn.invars[k].aval.dtype, repeat, why)
    return want


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes both splits start with (the part of a dimension's split two operands share)."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _rows_gathered(w: Walker, lhs: Layout, rhs: Layout, li: int, rj: int, out_len: int) -> bool:
    """Whether a conv gathers the input's split spatial axis ``li`` whole: its blocks or the result's are
    uneven, and the kernel's window axis ``rj`` is whole (the spatial loop's last case)."""
    lsplit, wsplit = lhs.dims[li], rhs.dims[rj]
    if not lsplit or wsplit:
        return False
    n = group_size(w, lsplit)
    return bool(int(out_len) % n or lhs.shape[li] % n)


def _mark(w: Walker, before: int, note: str) -> None:
    mark_approximate(w, before, note)


def _exchange_halos(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    lay: Layout,
    halos: list[tuple[int, list[int]]],
    dtype: Any,
    blocks: dict[int, int] | None = None,
) -> list[int]:
    """Charge each split axis's halo permutes, in axis order, on the block grown by the earlier ones; the block
    after them.  ``blocks``: an axis's block once XLA keeps only the rows its windows read (its
    ``ExchangeHaloAndGetValidData``; measured: 8 rows over 2, a 3-row window of stride 3, one halo row: the next
    axis's permutes carry 3 rows, not 5), else the block and its halos."""
    local = list(lay.shard_shape)
    for axis, pieces in halos:
        row = math.prod(s for i, s in enumerate(local) if i != axis) * itemsize(dtype)
        why = f"{eqn.primitive.name}: halo exchange along a split axis"
        charge(w, eqn, phase, repeat, "collective-permute", lay.dims[axis], [p * row for p in pieces], why)
        local[axis] = (blocks or {}).get(axis, local[axis] + sum(pieces))
    return local


@register("conv_general_dilated")
def conv_general_dilated(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    p = eqn.params
    out_aval = eqn.outvars[0].aval
    lhs, rhs = ins
    if is_free(lhs) and is_free(rhs):
        return [w.free(out_aval)]
    dn = p["dimension_numbers"]
    lb, lf, *ls = dn.lhs_spec
    ro, ri, *rs = dn.rhs_spec
    ob, of, *os_ = dn.out_spec
    grouped = p["feature_group_count"] != 1 or p["batch_group_count"] != 1
    pairs = [(lf, ri), *zip(ls, rs)]
    # A free operand (a cotangent of ones) takes its partner's split on the axes they pair.
    if is_free(lhs):
        lhs = _adopt(w, out_aval, lhs, rhs, pairs, ())
    elif is_free(rhs):
        rhs = _adopt(w, out_aval, rhs, lhs, [(b, a) for a, b in pairs], (ro,))
    start = len(w.ops)
    approx: list[str] = []
    alternative = False  # whether XLA's other choice is known here (offered to a fork of the walk)
    rows_fork = False  # a window longer than the result: offered to the fork shared by all such convs
    kernel_keeps: tuple[str, ...] = ()  # the kernel's output split kept where it clashes with the input's
    rows_alternative = 0  # collectives XLA's other way of settling a rows/outputs clash takes, beyond the marked
    gathered_out = 0  # bytes XLA may all-gather (an uneven result, the input's rows), beyond the marked collectives
    gathered_again = 0  # an all-gather XLA may make again where the walk shares an earlier one
    held_alternative = 0  # bytes of gathered copies XLA's other choice may not hold (a grouped conv's)
    summed: list[tuple[str, ...]] = []  # one all-reduce per contracted split axis (XLA sums them one by one)
    whole_sum = False  # the partial sums are all-reduced whole whatever the result's users
    regrouped: tuple[str, ...] = ()  # a depthwise conv's batch split moved onto its channels (and back after)
    batch_groups_alike = False  # a batch-grouped conv's groups split alike on both operands (local)
    out_dims: list[tuple[str, ...]] = [()] * len(out_aval.shape)
    # The contracted feature axes: split alike they leave partial sums, otherwise they are gathered.
    # Each operand is brought to its target in one step (XLA gathers a kernel's splits in one all-gather).
    lhs_to, rhs_to = lhs, rhs
    if grouped and _groups_split_alike(w, eqn, lhs, rhs, lf, ri, ro):
        # Each device holds whole groups of the input's features and the kernel's outputs for them: it convolves
        # its own groups, nothing moves or sums (measured: a depthwise conv, features and kernel outputs over
        # 'b': no collective, the result's channels over 'b'; tests/test_conv_rules.py).
        pass
    elif batch_groups_alike := _batch_groups_split_alike(w, p, lhs, rhs, lb, lf, ri, ro):
        # Batch groups (a grouped conv's kernel gradient: the input's batch is the activations' channels) split like
        # the cotangent's channels, the contracted features whole: each device holds whole groups and the outputs
        # they make, as a feature-grouped conv split alike: nothing moves or sums (measured: the depthwise kernel's
        # gradient of an Equinox block under tensor parallelism, channels over 'model': no collective; explain had
        # gathered the cotangent; tests/test_depthwise_conv_rules.py).  Contracted features split alike (the batch
        # under dp x tp) leave partial sums, one all-reduce (measured: over 'data', the kernel's f32[8,1,3,3] slice).
        summed = [lhs.dims[lf]] if lhs.dims[lf] else []
    elif _batch_groups_whole(p, lhs, rhs, lb, lf, ri, ro):
        # Batch groups (a grouped conv's kernel gradient: the input's batch is the activations' channels, paired
        # with the cotangent's channels) leave the contracted features ungrouped: split alike on both operands
        # they leave partial sums, one all-reduce, as an ungrouped conv's (measured: grad of a depthwise conv,
        # the batch over 'data' of (2,), (2, 2), (4, 2): one all-reduce of the kernel-sized partial; on 2-D
        # meshes XLA's all-reduce spans the idle axis too and doubles the gradient, a miscompile:
        # tests/test_xla_depthwise_grad_miscompile.py).
        summed = [lhs.dims[lf]]
        if idle := _idle_axes(w, lhs, rhs):
            # ... that all-reduce, as jax 0.10.2's XLA compiles it, spans the mesh axes neither operand uses too (the
            # miscompile), over the whole kernel, and a result asked split (an FSDP kernel) is sliced from it, not
            # reduce-scattered (measured: the depthwise kernel's gradient of (8,16,8,8), batch over 'data' of
            # (4, 2), the kernel asked o@data: one all-reduce f32[16,1,3,3] over all 8 devices and a dynamic slice;
            # over (8,): one reduce-scatter).  explain names the collectives XLA compiles, not the sum it means.
            summed = [tuple(m for m in w.costs.mesh_sizes if m in lhs.dims[lf] or m in idle)]
            whole_sum = True
    elif regrouped := _depthwise_regroup(w, eqn, lhs, rhs, lb, lf, ri, ro):
        # A depthwise conv (one channel a group) whose input is split on its batch over the mesh axes that split the
        # kernel's outputs (FSDP), its channels whole: the groups are independent like a batch, so XLA moves the
        # input's split from the batch onto the channels (one all-to-all), convolves each device's own groups, and
        # moves the result back onto the batch (another), not gathering the kernel (measured on one-op programs:
        # (8,16,8,8) NCHW or NHWC, batch and kernel outputs over 'data' of (4, 2) or 'a' of (8,): two all-to-alls
        # of the input-sized block, the result batch-split whatever its reader; tests/test_depthwise_conv_rules.py).
        why = "depthwise conv input moved from its batch onto the kernel's channel split"
        lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(_with(lhs, lb, ()), lf, regrouped), why)
        lhs_to = lhs
    elif grouped:
        approx.append("grouped conv: feature splits gathered")
        lhs_to, rhs_to = _with(lhs_to, lf, ()), _with(_with(rhs_to, ri, ()), ro, ())
        # XLA's grouped features are independent like a batch: it may move the input onto the kernel's output
        # split instead (an all-to-all) and the result back (another), not gather, and so hold no gathered copy
        # (measured on an Equinox depthwise conv under FSDP, kernel o@data against a batch@data input: 2
        # all-to-alls where explain gathered; session 16's probe): a depthwise conv's is modelled above
        # (_depthwise_regroup); other layouts and groups of several channels are bounded here: the op says so.
        whole_in = _local_bytes(lhs.with_dims(tuple(() for _ in lhs.dims)), eqn.invars[0].aval.dtype)
        rows_alternative += 2
        gathered_out += whole_in + math.prod(out_aval.shape) * itemsize(out_aval.dtype)
        held_alternative += whole_in
    elif lhs.dims[lf] == rhs.dims[ri]:
        summed = [lhs.dims[lf]] if lhs.dims[lf] else []
    elif (
        not lhs.dims[lf]
        and set(rhs.dims[ri]) & set(lhs.dims[lb])
        and (moved := _idle_regroup(w, lhs, rhs, rhs.shape[ri], rhs.dims[ri]))
    ):
        # The kernel's contracted features split over the input's batch axis (an FSDP kernel's input
        # gradient: the kernel transposed, its outputs now contracted): XLA moves the kernel's split onto
        # the idle mesh axes (one collective-permute), slices the input's features alike (free) and sums
        # there (one all-reduce).  Measured on (2,2,2), batch and kernel outputs over 'b': permute
        # f32[3,3,64,16] + all-reduce f32[4,4,4,64] over ('a', 'c') (tests/test_conv_rules.py).
        rhs = _bring(w, eqn, phase, repeat, 1, rhs, _with(rhs, ri, moved), "conv kernel moved onto idle mesh axes")
        lhs_to, rhs_to = _with(lhs, lf, moved), rhs
        summed = [moved]
        whole_sum = True  # summed whole: the activations were never split over the idle axes (measured)
        if phase == "backward":
            # A lone conv's gradient (the kernel gathered whole in the forward pass) reuses that copy
            # instead: no collective here (measured on (4, 2), x (8,2,2,4) batch@b, w (1,1,4,8) outputs@b).
            approx.append("XLA may reuse the kernel the forward pass gathered instead (no collective here)")
    elif regroup := _regroup_axes(w, lhs, rhs, lf, ri, ro):
        # The input's features split like the kernel's outputs, both replicated over mesh axes more devices
        # than that split: XLA groups the devices by the kernel's output block and, within each group, moves
        # the input's features onto the idle axes (one collective-permute), slices the kernel's input
        # features alike (free) and contracts over them (partial sums over the idle axes); or, when the
        # result's block is larger than the whole input, gathers the input over the idle axes instead.
        # Measured on one-op programs: (4, 2) features@model -> permute + all-reduce over the 4; (2, 4) or a
        # (2, 2, 2) split over two axes -> all-gather (tests/test_conv_rules.py).
        lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(lhs, lf, regroup), "conv input moved onto idle mesh axes")
        # At a tie (the result's block as large as the whole input) XLA gathers too (measured: x (8,8,8,16)
        # features@b against a (1,1,16,32) or (3,3,16,32) kernel outputs@b on (4, 2): permute + all-gather).
        if _bytes(out_aval.shape, (of,), rhs.dims[ro], w) >= _bytes(lhs.shape, (), (), w):
            lhs_to, rhs_to = _with(lhs, lf, ()), rhs
            # The gathered input is a copy the conv reads (peak memory: memory._conv_gather_bytes), though its
            # all-gather starts from the permuted value rather than the one the walk bound.
            w.bind_copy(eqn.invars[0], lhs_to)
        else:
            lhs_to, rhs_to = lhs, _with(rhs, ri, regroup)
            summed = [regroup]
    elif (
        lhs.dims[lf]
        and not rhs.dims[ri]
        and all(rhs.shape[r] == 1 for r in rs)
        and not set(lhs.dims[lf]) & {m for d in rhs.dims for m in d}  # the kernel's own splits elsewhere
        and 2 * math.prod(out_aval.shape) < math.prod(lhs.shape)
    ):
        # A 1x1 conv (a dot over the features) whose input features are split against a whole kernel, its result
        # less than half the input (a stride): XLA slices the kernel's inputs alike (free) and all-reduces the
        # partial result, an all-reduce sending twice its buffer, rather than gathering the input (measured: x
        # (4, 8, 8, 8) features@a over 8, stride 2: one all-reduce of 2 KiB, not a gather of 8 KiB; stride 1, or
        # half as many outputs as inputs over 2: the gather).
        rhs_to = _with(rhs_to, ri, lhs.dims[lf])
        summed = [lhs.dims[lf]]
    else:
        # Split alike on a common major part (x@a against w@(a,b)): XLA keeps that part, leaving partial
        # sums over it, and gathers only the rest (measured: one all-gather and one all-reduce).
        common = _common_prefix(lhs.dims[lf], rhs.dims[ri])
        lhs_to, rhs_to = _with(lhs_to, lf, common), _with(rhs_to, ri, common)
        summed = [common] if common else []
    if any(d != 1 for d in p["lhs_dilation"]) and lhs.dims[lf] != rhs.dims[ri] and not grouped:
        # A transposed conv whose contracted features are split otherwise on the two operands: XLA's partitioner
        # then often replicates both operands, each split axis gathered, and slices the result (measured by the
        # deep run's random seeds: x rows@b, features@a against kernel inputs@b, dilation 3: three collectives
        # more than explain's; x batch@b, features@a, two more): a heuristic explain does not reproduce.
        # ... or keeps the input's feature split and all-reduces the (dilated, larger) result: x rows@b, features@a
        # against kernel inputs@b over (2, 2, 2): a permute and an all-reduce of the result, 7.6 KiB.
        approx.append("a transposed conv's features split otherwise on each operand; XLA may replicate both")
        rows_alternative += sum(1 for d in (*lhs.dims, *rhs.dims) if d)
        gathered_out += _local_bytes(lhs.with_dims(tuple(() for _ in lhs.dims)), eqn.invars[0].aval.dtype)
        gathered_out += _local_bytes(rhs.with_dims(tuple(() for _ in rhs.dims)), eqn.invars[1].aval.dtype)
        gathered_out += math.prod(out_aval.shape) * itemsize(out_aval.dtype)
    # (Batch groups split alike: the result's batch is one group's, its split the output features'.)
    out_dims[ob] = () if batch_groups_alike else lhs.dims[lb]
    taken = {m for i in ((*ls,) if batch_groups_alike else (lb, *ls)) for m in lhs.dims[i]}
    # Rows the spatial loop below gathers whole (uneven blocks) free their mesh axes: the kernel's outputs keep
    # their split over them (measured, tests/test_primitive_rules.py's transposed convs: rows@a of 8 rows
    # dilated to 15, kernel outputs@a -> XLA gathers the rows, the result split on its features@a).
    taken -= {
        m
        for li, rj, oi in zip(ls, rs, os_)
        if _rows_gathered(w, lhs, rhs, li, rj, out_aval.shape[oi])
        for m in lhs.dims[li]
    }
    clash = tuple(m for m in lhs.dims[lb] if m in rhs.dims[ro])
    asked = _asked_split(w, eqn.outvars[0], of)
    if (
        clash
        and not grouped
        and not any(lhs.dims[i] for i in ls)
        and (asked == rhs.dims[ro] or (asked is None and _features_win(eqn, lhs, rhs)))
    ):
        # The result is asked for split like the kernel's outputs (a kernel gradient: the input is the
        # activations, whose channels are the conv's batch here, the kernel is the cotangent): XLA keeps the
        # kernel's split and gathers the input's batch split instead (measured on the one-op kernel
        # gradient with out_shardings: x channels@b, dy channels@b -> all-gather x; with idle mesh axes of
        # more devices, a collective-permute onto them first, then the all-gather over them).
        keep = tuple(m for m in lhs.dims[lb] if m not in clash)
        onto_idle = bool(not keep and (regroup := _idle_regroup(w, lhs, rhs, lhs.shape[lb], clash)))
        if onto_idle:
            lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(lhs, lb, regroup), "conv input moved onto idle mesh axes")
        src, gathered, needs = lhs, _with(lhs, lb, keep), not is_free(lhs) and lhs.dims[lb] != keep
        before = len(w.ops)
        lhs = _bring(w, eqn, phase, repeat, 0, lhs, gathered, "conv input's batch split gathered")
        if needs and len(w.ops) == before and _whole_window(eqn) and not onto_idle:
            # Shared with an earlier op's gather of the same value in the walk (its memo), but this conv is a 1x1
            # conv's kernel gradient (its window the whole input, its result 1x1): a dot to XLA, which gathers its
            # input again rather than reuse the forward conv's gather (measured: x (8,8,8,16) batch@a, features@b
            # against a 1x1 kernel's outputs@b on (4, 2), NHWC or NCHW: two all-gathers of x's f32[4,8,8,16]; a
            # 3x3 kernel's: one; tests/test_depthwise_conv_rules.py).  Moved onto idle mesh axes first, it reuses the
            # forward's permuted gather (measured: the Equinox depthwise block's pointwise conv under tp).
            axes = tuple(m for m in src.dims[lb] if m not in keep)
            block = _local_bytes(gathered, eqn.invars[0].aval.dtype)
            charge(w, eqn, phase, repeat, "all-gather", axes, [block], "conv input's batch split gathered again")
        elif needs and len(w.ops) == before:
            # Shared with an earlier op's gather of the same value (the walk's memo, XLA's CSE).  XLA shares it in
            # a channel-split step (the activations gathered once for the next conv and its kernel gradient,
            # measured) but not always: which of its passes makes each gather decides, not modelled here.
            approx.append("the input's gather is shared with an earlier op's; XLA may gather it again")
            gathered_again = 1
            gathered_out += _local_bytes(gathered, eqn.invars[0].aval.dtype)
        lhs_to = _with(lhs_to, lb, keep)
        out_dims[ob] = keep
        taken = {m for i in (lb, *ls) for m in lhs.dims[i]} - set(clash)
    if set(rhs.dims[ro]) & taken:
        # The kernel's output features split over a mesh axis the input's batch or rows already use.
        # Where the batch and the kernel's outputs are split over the same axes and the batch wins
        # (:func:`_features_win`), XLA gathers the kernel: exact.  Otherwise explain gathers the (small)
        # kernel's split, XLA's most common choice; XLA's cost model also
        # gathers only the clashing axes (batch@b against outputs@(a,b) at stride 1), keeps the kernel
        # split and moves the result (collective-permutes, with a reduce-scatter under a dilated window),
        # depending on strides, dilation and sizes (measured by the deep run of
        # tests/test_primitive_rules.py): a heuristic explain does not reproduce, so the op says so.
        clashing_rows = [i for i in ls if set(rhs.dims[ro]) & set(lhs.dims[i])]
        if clashing_rows and not set(rhs.dims[ro]) & set(lhs.dims[lb]):
            # The kernel's outputs split over a mesh axis of the input's rows: XLA gives the result the kernel's
            # output split and gathers those rows whole (measured on one-op programs over 1-, 2- and 3-axis
            # meshes, 1x1 to 3x3 kernels, stride 1 and 2: rows@a, rows@(a,b), cols@a, against outputs@a or
            # @(a,b) -> one all-gather of the input, the result features@(kernel's split)).  With a window
            # over rows and mesh axes idle, XLA instead exchanges halos, moves the result pieces (an
            # all-to-all) and sums them (measured: 2 permutes, an all-to-all, an all-reduce).
            # ... over the clashing mesh axes and those after them: their major axes before the first clash stay
            # (measured: a transposed conv's rows@(a, b) against outputs@b keep 'a').
            kept = {i: _free_prefix(lhs.dims[i], set(rhs.dims[ro])) for i in clashing_rows}
            lhs_to = lhs_to.with_dims(tuple(kept.get(i, d) for i, d in enumerate(lhs_to.dims)))
            approx.append(
                "a mesh axis splits both the input's rows and the kernel's outputs: XLA keeps the kernel's split "
                "and gathers the rows, or (a window, idle mesh axes) exchanges halos and moves the result"
            )
            # Those: two halo permutes, the all-to-all and the all-reduce of the result's block.
            rows_alternative = 3
            gathered_out += 2 * _bytes(out_aval.shape, (of,), rhs.dims[ro], w) * itemsize(out_aval.dtype)
            if _differentiated(w, eqn):
                # The gradient's convs follow that choice: another all-to-all, a reduce-scatter for their
                # all-reduce and a halo permute (measured: a dilation-2 stride-2 conv's gradient, rows@a over 8
                # against kernel outputs@a: 2 all-to-alls, 2 reduce-scatters, 7 permutes where explain gathers).
                rows_alternative += 3
                gathered_out += 2 * _bytes(out_aval.shape, (of,), rhs.dims[ro], w) * itemsize(out_aval.dtype)
        elif clashing_rows or any(lhs.dims[i] for i in ls):
            approx.append("a mesh axis splits both the input's rows and the kernel's outputs; XLA may move the result")
            # XLA's other choice keeps the kernel's split and gathers the input's rows instead (measured: the
            # input gradient of a 1x1 conv, rows@a against kernel inputs@a over 8: XLA all-gathers the whole
            # f32[4,8,8,8] cotangent, explain the 256 B kernel): that gather's bytes, beyond the marked ones.
            rows_whole = tuple(() if i in ls else d for i, d in enumerate(lhs.dims))
            gathered_out += _local_bytes(lhs.with_dims(rows_whole), eqn.invars[0].aval.dtype)
            # The kernel's major mesh axes that neither the batch nor split rows hold (rows gathered for uneven
            # blocks free theirs) stay: XLA gathers only the clashing rest (measured: a transposed conv, batch@c,
            # rows@(a, b) dilated 4 -> 7, kernel outputs@(b, c): the result features@b).
            # Rows split over the kept axes give them up, as against the kernel's outputs alone (measured: batch@c,
            # rows@(a, b) dilated 4 -> 8 against outputs@(b, c): XLA keeps rows@a, features@b).
            kernel_keeps = _free_prefix(rhs.dims[ro], set(lhs.dims[lb]))
            lhs_to = lhs_to.with_dims(
                tuple(_free_prefix(d, set(kernel_keeps)) if i in ls else d for i, d in enumerate(lhs_to.dims))
            )
        elif grouped or lhs.dims[lb] != rhs.dims[ro]:
            approx.append(
                "a mesh axis splits both the input's batch and the kernel's outputs: XLA may gather part of the "
                "kernel's split, or move the result instead (permutes, a reduce-scatter) by its cost model"
            )
        elif not is_free(rhs) and (regroup := _idle_regroup(w, lhs, rhs, rhs.shape[ro], rhs.dims[ro])):
            # As for the input's batch above: with idle mesh axes of at least as many devices, XLA moves the
            # kernel's outputs onto them (one collective-permute) and gathers over them (measured on (4, 2):
            # x batch@b, w outputs@b -> permute f32[1,1,4,2] + all-gather over 'a').
            rhs = _bring(
                w, eqn, phase, repeat, 1, rhs, _with(rhs, ro, regroup), "conv kernel moved onto idle mesh axes"
            )
        if not rows_alternative:
            rhs_to = _with(rhs_to, ro, kernel_keeps)
    if sum(a != b for a, b in zip(rhs.dims, rhs_to.dims)) > 1 and not is_free(rhs):
        approx.append("the kernel is gathered along several axes; XLA may split the gathers differently")
    if phase == "backward" and rhs_to.dims != rhs.dims and not is_free(rhs):
        # A gradient conv's kernel is the forward's kernel reversed: XLA reuses the copy it gathered in the
        # forward pass where it can (one all-gather fewer, measured); explain gathers it again.
        approx.append("the kernel's gather may be shared with the forward pass's (XLA: one all-gather fewer)")
    # The kernel's contracted features gathered from a split over mesh axes the input's rows use too: Shardy's
    # propagation cannot give one mesh axis to both factors and replicates the input's rows as well (an all-gather
    # after the features'); the result keeps the rows' split, a local slice (measured on (4, 2): x cols@a,
    # features@b against kernel inputs@(a, b): three all-gathers, the result cols@a; on (2, 2, 2) with cols and
    # kernel inputs@(a, c)).
    # (Only where the input's features are split and gathered too: with them whole, XLA gathers the kernel alone
    # and keeps the rows split, measured: x cols@a against kernel inputs@a over 8.)
    gathered_features = lhs.dims[lf] and lhs_to.dims[lf] != lhs.dims[lf]
    both = rhs.dims[ri] and rhs_to.dims[ri] != rhs.dims[ri] and gathered_features and not grouped
    crossed = set(rhs.dims[ri]) if both else set()
    sliced = {
        li: lhs.dims[li]
        for li, rj, oi in zip(ls, rs, os_)
        if crossed & set(lhs.dims[li])
        and not rhs.dims[rj]
        and int(out_aval.shape[oi]) % group_size(w, lhs.dims[li]) == 0  # else XLA computes uneven blocks (marked)
    }
    lhs = _bring(w, eqn, phase, repeat, 0, lhs, lhs_to, "conv operand brought to the split it needs")
    held = {m for d in lhs_to.dims for m in d}  # (with the input's features whole: a direct gather, measured)
    clashing = rhs.dims[ri] and not rhs_to.dims[ri] and set(rhs.dims[ri]) <= held
    if clashing and not is_free(rhs) and (via := gather_route(w.costs.mesh_sizes, rhs, rhs_to, (lhs_to,))):
        # The kernel's inputs gathered from mesh axes the input holds elsewhere (its rows), over idle mesh axes at
        # least as large: XLA moves the kernel's split onto them first (one collective-permute), then gathers
        # over them (idle_axes.gather_route; measured on (4, 2): x cols@b against a 1x1 kernel's inputs@b,
        # permute f32[1,1,1,8] then all-gather over 'a').
        rhs = _bring(w, eqn, phase, repeat, 1, rhs, via, "conv kernel moved onto idle mesh axes")
    rhs = _bring(w, eqn, phase, repeat, 1, rhs, rhs_to, "conv kernel brought to the split it needs")
    for li in sliced:
        lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(lhs, li, ()), "conv input's rows replicated (axis clash)")
    out_dims[of] = rhs.dims[ro]
    for li, split in sliced.items():
        out_dims[os_[ls.index(li)]] = split
    halos: list[tuple[int, list[int]]] = []
    window_summed: list[str] = []
    sliced_after_sum: dict[int, tuple[str, ...]] = {}  # result axes XLA slices to the rows' split once summed
    typed = explicit_dims(out_aval)  # the result's split as its type names it (Explicit axes), else None
    # A window longer than the result gives the result's axis a factor of its own in Shardy's conv rule: its split
    # is what the result's readers ask (:func:`_rows_asked`), not the input's.
    propagated = phase == "forward" and not all_explicit(out_aval)
    held_out = {m for d in out_dims for m in d}
    for j, (li, rj, oi) in enumerate(zip(ls, rs, os_)):
        lsplit, wsplit = lhs.dims[li], rhs.dims[rj]
        length, window, out_len = lhs.shape[li], rhs.shape[rj], int(out_aval.shape[oi])
        stride, (low, _), ldil, rdil = (
            p["window_strides"][j],
            p["padding"][j],
            p["lhs_dilation"][j],
            p["rhs_dilation"][j],
        )
        rows_asked: tuple[str, ...] = ()
        if propagated and not wsplit and ldil == 1 and window > out_len:
            rows_asked = _rows_asked(w, eqn.outvars[0], oi, held_out - set(lsplit))
            if rows_asked and (out_len % group_size(w, rows_asked) or length % group_size(w, rows_asked)):
                rows_asked = ()
        if not lsplit and not wsplit:
            if rows_asked:
                # The input whole along the axis, the result asked split (a residual add of a rows-split shortcut
                # after the conv): XLA slices the input's rows to the result's split (free) and exchanges halos
                # (measured: the keras-hub ResNet's second stride-1 conv on 2 rows over 2 after the gathered
                # stride-2 conv: two permutes f32[2,1,2,64]; tests/test_conv_rules.py's residual chains).
                lhs = _with(lhs, li, rows_asked)
                halos.append((li, halo_pieces(length, group_size(w, rows_asked), out_len, window, stride, rdil, low)))
                out_dims[oi] = rows_asked
                held_out |= set(rows_asked)
            continue
        n = group_size(w, lsplit or wsplit)
        if wsplit and lsplit == wsplit and ldil == 1 and (lhs.dims[lb] or rhs.dims[ro]):
            # A window split like the input's rows, but the input's batch or the kernel's outputs split too: XLA's
            # window-split partitioning supports neither (PartitionConvolutionWithSpatialDimensionHaloExchangeOnRHS
            # gives up).  It then gathers the kernel's window and exchanges the input's halos, the result split
            # like the rows, where the result's rows divide (measured: a 2x2 stride-2 conv, x batch@(b, c),
            # rows@a, kernel rows@a, cols@b on (2, 2, 2): the result rows@a); else it gathers the spatial axis of
            # both operands and keeps the other splits (measured: a 1x1 stride-2 conv's kernel gradient, x cols@b,
            # features@a, the cotangent cols@b on (4, 2), a one-column result: two all-gathers over b).
            why = "conv spatial split gathered (window split)"
            rhs = _bring(w, eqn, phase, repeat, 1, rhs, _with(rhs, rj, ()), why)
            if out_len % n == 0 and length % n == 0:
                halos.append((li, halo_pieces(length, n, out_len, window, stride, rdil, low)))
                out_dims[oi] = lsplit
            else:
                lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(lhs, li, ()), why)
        elif wsplit and lsplit == wsplit and ldil == 1 and length % n == 0 and window % n == 0:
            halos.append((li, halo_pieces(length, n, out_len, window, stride, rdil, low, window_split=True)))
            window_summed.extend(wsplit)
            if window <= out_len and out_len % n == 0:
                sliced_after_sum[oi] = lsplit
        elif lsplit and not wsplit and ldil == 1 and out_len % n == 0 and length % n == 0:
            pieces = halo_pieces(length, n, out_len, window, stride, rdil, low)
            # (longer than the result, whether the blocks need halos or not: 8 rows over 2, a 4-row window of
            # stride 4, 2 result rows, is gathered; a 2-row window of stride 2 over 4 rows to 2 stays split, with
            # a halo where padded (1, 0): measured on one-op programs, tests/test_conv_rules.py)
            covers = window > out_len and not (typed and typed[oi]) and rows_asked != lsplit
            as_long = window == out_len and not (typed and typed[oi])
            if as_long:
                # As long as the result: XLA keeps the rows split (halos where the blocks need them), and its
                # gradient's convs too, by a choice of its own (measured: 4 rows over 2, a 2x2 stride-2 window, its
                # gradient one all-reduce and one reduce-scatter where explain all-reduces twice): the op says so,
                # the gathered rows its alternative (a fork of its own).
                alternative = True
                approx.append(
                    f"spatial axis {li}: the window is as long as the result; XLA keeps the rows split, its "
                    "gradient may sum otherwise, or gather the input's rows"
                )
            if covers:
                # A window longer than the result: Shardy's conv rule pairs the input's axis with the
                # kernel's, not the result's, so XLA's propagation leaves the result whole along it and gathers
                # the input's rows (measured on one-op programs and short chains, tests/test_conv_rules.py: a 3x3
                # stride-2 conv of 4 rows over 2 to 2 rows, alone, before a batch norm, a mean or another conv:
                # one all-gather, the batch norm's all-reduces over the axis gone; the keras-hub ResNet's
                # f32[2,6,6,64]).  Charged here, not as a layout change the walk may reuse: XLA gathers the rows
                # again for a later reader (the kernel gradient's conv in the backward pass).  XLA's other choice
                # (a fork of the walk, :mod:`.alternatives`): where a later op asks for the rows split (a residual
                # add of a rows-split shortcut), its propagation splits the result back and exchanges halos
                # instead: :func:`_rows_asked` sees the asks of elementwise readers (then ``rows_asked`` keeps the rows
                # split, no mark); one it does not see stays the fork's, and the op says so.
                rows_fork = True
                approx.append(
                    f"spatial axis {li}: the window covers the result; XLA gathers the input's rows and leaves the "
                    "result whole, unless a later op asks for the rows split (then halo permutes, its users' "
                    "all-reduces along the axis kept)"
                )
            if (covers and id(ROWS_SPLIT_FORK) not in w.costs.forced) or (as_long and taking(w, eqn)):
                whole = _with(lhs, li, ())
                if not is_free(lhs):
                    block = math.prod(whole.shard_shape) * itemsize(eqn.invars[0].aval.dtype)
                    charge(w, eqn, phase, repeat, "all-gather", lsplit, [block], "conv input's rows gathered")
                    w.bind_copy(eqn.invars[0], whole)
                lhs = whole
                continue
            halos.append((li, pieces))
            out_dims[oi] = lsplit
        elif lsplit and ldil != 1 and out_len % n == 0 and length % n == 0:
            if wsplit:
                # The kernel's window split otherwise than the input's rows: XLA gathers the (small) kernel's window
                # and keeps the rows split (measured: a dilation-2 transposed conv, x cols@b, kernel cols@c on
                # (2, 2, 2): the result cols@b).
                why = "conv kernel's window gathered"
                rhs = _bring(w, eqn, phase, repeat, 1, rhs, _with(rhs, rj, ()), why)
            # A transposed conv (a strided conv's input gradient: the cotangent dilated by the stride):
            # the window reads the dilated input, so the halo is counted in the input's own rows.
            halos.append((li, _dilated_halo_pieces(length, n, out_len, window, stride, rdil, low, ldil)))
            out_dims[oi] = lsplit
            if summed or rhs_to.dims[ri] != rhs.dims[ri]:
                # ... but with the contracted features split too (partial sums, or the kernel's input features
                # gathered), XLA's partitioner may instead replicate both operands, each split axis gathered, and
                # slice the result (measured: x cols@b, features@a, kernel inputs@(a, b), dilation 2, padding
                # (0, 1): three all-gathers where explain gathers the kernel over 'b' and all-reduces over 'a').
                approx.append(
                    f"spatial axis {li}: a dilated input with split features; XLA may replicate both operands"
                )
                rows_alternative += sum(1 for d in (*lhs.dims, *rhs.dims) if d)
                gathered_out += _local_bytes(lhs.with_dims(tuple(() for _ in lhs.dims)), eqn.invars[0].aval.dtype)
                gathered_out += _local_bytes(rhs.with_dims(tuple(() for _ in rhs.dims)), eqn.invars[1].aval.dtype)
        else:
            approx.append(
                f"spatial axis {li} (dilated input or uneven blocks) gathered; XLA may exchange halos instead"
            )
            if summed or any(rhs.dims):
                # Keeping the axis split, XLA's halo permutes (each a buffer the gather's bound already covers)
                # leave the result split where the kernel's split wants it elsewhere: it moves the kernel or the
                # result (an all-to-all) and settles the partial sums by a reduce-scatter (measured: rows@a over 8
                # of 16, a dilation-2 VALID 2x2 conv to 14 rows, kernel outputs@a: 6 permutes, an all-to-all and a
                # reduce-scatter; a transposed conv's gradient, rows@b, kernel inputs@b: an all-to-all, a
                # reduce-scatter and a third all-gather beyond explain's).
                rows_alternative += 2
                if _differentiated(w, eqn):
                    # ... and the gradient's convs follow that choice: another all-to-all, reduce-scatter and halo
                    # permute (measured: a dilation-2 VALID stride-2 conv's gradient, 16 rows@a over 8 to 7, against
                    # kernel outputs@a: 11 collectives from explain's).
                    rows_alternative += 3
            if out_len % n:
                # ... or compute the result split and gather it, padded to the next multiple (measured: a
                # transposed conv's 15 rows over 8 devices, one all-gather of 16 result rows).
                padded = -(-out_len // n) * n
                # Its halos (a gradient's, on the padded result too) are bounded by that padded result: twice it.
                gathered_out += 2 * padded * math.prod(out_aval.shape) // out_len * itemsize(out_aval.dtype)
            # The result's rows that divide over the split's major axes stay split over them: XLA computes on the
            # whole split's padded blocks and regroups the result onto those axes (measured: a dilation-2
            # transposed conv, x rows@(a, b) of 4, 6 result rows, kernel split on its window: the result rows@a).
            major = _dividing_prefix(w, lsplit, out_len) if lsplit else ()
            if (
                major
                and length % group_size(w, major) == 0
                and not set(major) & (set(rhs.dims[ro]) | set(lhs.dims[lb]))
            ):
                nk = group_size(w, major)
                lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(lhs, li, major), "conv spatial split gathered")
                halos.append((li, _dilated_halo_pieces(length, nk, out_len, window, stride, rdil, low, ldil)))
                out_dims[oi] = major
            else:
                lhs = _bring(w, eqn, phase, repeat, 0, lhs, _with(lhs, li, ()), "conv spatial split gathered")
            rhs = _bring(w, eqn, phase, repeat, 1, rhs, _with(rhs, rj, ()), "conv spatial split gathered")
    if window_summed:
        # The window's split axes are summed together: one all-reduce over all of them (measured: rows@b,
        # cols@a in a kernel gradient all-reduce once over (a, b)).
        summed.append(tuple(m for m in w.costs.mesh_sizes if m in window_summed))
    _exchange_halos(w, eqn, phase, repeat, lhs, halos, eqn.invars[0].aval.dtype)
    dims = w.settle_repeats(eqn, phase, out_aval, out_dims, repeat, "conv result split twice over a mesh axis")
    out = w.relayout(out_aval, dims)
    if regrouped:
        # ... and the result goes back onto the batch split the input came with (the second all-to-all).
        home = _with(_with(out, of, ()), ob, regrouped)
        w.change(eqn, phase, out, home, out_aval.dtype, repeat, "depthwise conv result moved back onto its batch")
        out = home
    if summed:
        w.env[Partial(eqn.outvars[0])] = out  # the partial buffer waits for its all-reduce
        scatter, via_idle = ((), False) if whole_sum else _scatter_axes(w, eqn, phase, lhs, rhs, out, of, summed)
        onto: int | None = of if scatter else None if whole_sum else _asked_scatter_dim(w, eqn, out, summed)
        if onto is not None and not scatter:
            # The result is asked for split over the summed axes (an FSDP kernel gradient, its outputs split
            # over the batch's axis): XLA sums straight into that split.
            scatter, via_idle = summed[0], _idle_size(w, lhs, rhs) >= group_size(w, summed[0])
        if via_idle and onto is not None:
            # XLA spreads the work over the idle mesh axes: each device computes the slice of the result its
            # group of the idle axes' major part owns (the other operand sliced there, free), sums that slice
            # over the contracted split (an all-reduce of 1/n of the result), then moves the slices onto the
            # split the result is wanted in (one collective-permute of 1/n).  Measured: the input gradient
            # (8,4,4,64), features@model against a kernel o@model on (data=4, model=2): all-reduce
            # f32[8,4,4,32] over model + collective-permute f32[8,4,4,32]; an FSDP kernel gradient on (2,2,2),
            # batch and outputs over 'b': all-reduce f32[3,3,64,32] over 'b' + permute (tests/test_conv_rules.py).
            out = out.with_dims(tuple(scatter if i == onto else d for i, d in enumerate(out.dims)))
            block = math.prod(out.shard_shape) * itemsize(out_aval.dtype)
            charge(w, eqn, phase, repeat, "all-reduce", scatter, [block], "conv partial sums (a slice per idle group)")
            why = "conv result moved from the idle axes' slices onto its split"
            charge(w, eqn, phase, repeat, "collective-permute", scatter, [block], why, out=out)
            summed = []
        for axes in reversed(summed):
            pending = out.with_dims(out.dims, frozenset(axes))
            if onto is not None and axes == scatter:
                # Summed straight into the split the result goes on with (a reduce-scatter), not whole: an
                # input gradient back onto its activations' channels, a kernel gradient onto its own split.
                out = out.with_dims(tuple(axes if i == onto else d for i, d in enumerate(out.dims)))
            w.change(eqn, phase, pending, out, out_aval.dtype, repeat, "conv partial sums")
        used = {m for d in out.dims for m in d}
        for oi, split in sliced_after_sum.items():
            if not out.dims[oi] and not set(split) & used:
                # A window split like the input's rows and no longer than the result: Shardy pairs the input's
                # rows with the result's, so XLA sums the whole result over the window's split and slices it back
                # to the rows' split (free; measured: a 2x2 SAME conv, x rows@c against a kernel rows@c, cols@b on
                # (2, 2, 2): one all-reduce of the whole f32[4,8,8,8] over 'c', the result rows@c).
                out = _with(out, oi, split)
                used |= set(split)
    if approx:
        _mark(w, start, "; ".join(approx))
        widen_bound(w, start, sent=gathered_out, collectives=rows_alternative + gathered_again, peak=held_alternative)
        if alternative:
            offer(w, eqn, start)  # the op's own other choice: walked to the program's end
        if rows_fork:
            _offer_rows_split(w, start)  # the rows split back by their users: one fork for every such conv
    return [out]


class _RowsSplitFork:
    """The alternative every conv whose window covers its result offers (:mod:`.alternatives`): one fork for all.

    XLA's choice there is its propagation's, program-wide: where a later op asks for the rows split (a residual
    add of a rows-split shortcut), the split travels back through the chain and the convs on it exchange halos
    (measured on the keras-hub ResNet: the stride-2 conv gathers its rows, the stride-1 conv after it, 2 rows
    over 2, exchanges halos for the add; gathered alone).  So the fork keeps the rows split at every such conv,
    not at one: the walk whose difference bounds what XLA may do between the two."""


ROWS_SPLIT_FORK = _RowsSplitFork()


def _offer_rows_split(w: Walker, since: int) -> None:
    """Offer :data:`ROWS_SPLIT_FORK` on the approximate ops recorded since ``since`` (:func:`.alternatives.offer`,
    keyed by the shared fork instead of the equation)."""
    if w.quiet or w.costs.forced:
        return  # a dry run records nothing; a fork's own marks are not walked again
    for i in range(since, len(w.ops)):
        if w.ops[i].approximate:
            w.ops[i] = dataclasses.replace(w.ops[i], alternative=id(ROWS_SPLIT_FORK))


# Ops a split passes through position by position (an elementwise meet of a conv's result and a shortcut).
_FOLLOWED = frozenset(ELEMENTWISE | CARRIERS - {"transpose"} | {"select_n"})
# How many equations the look-ahead visits per conv (XLA's propagation is global; this bounds the search).
_ASK_BUDGET = 64


def _rows_asked(w: Walker, out: Any, axis: int, taken: set[str]) -> tuple[str, ...]:
    """The split of axis ``axis`` that the readers of a conv's result ``out`` ask for: followed forward through
    elementwise ops, the first operand of the same shape met there whose layout is split along the axis (over
    mesh axes not in ``taken``: the result's other splits).  () where none asks.

    Shardy pairs a conv's spatial axis with the kernel's, not the result's, where the window is longer than the
    result; the result's axis then takes its split from its readers only, and a residual add of a rows-split
    shortcut splits it (measured, tests/test_conv_rules.py: a 3x3 conv on 2 rows over 2, its result added to a
    rows-split shortcut after a batch norm: two halo permutes, the batch norm's sums over the rows' axis too;
    without the add, the rows gathered).  The operand met may not be walked yet (a shortcut computed after the
    main path): :func:`_split_along` follows its producers back to a value the walk laid out."""
    for x in _same_shape_operands(w, out):
        split = _split_along(w, x, axis)
        if split and not set(split) & taken:
            return split
    return ()


def _same_shape_operands(w: Walker, out: Any) -> Iterator[Any]:
    """The other operands, of ``out``'s shape, of the elementwise readers met following ``out`` forward (through
    readers' results of its shape, at most ``_ASK_BUDGET`` readers): what :func:`_rows_asked` and
    :func:`_readers_hold_whole` ask about, in the order they meet them."""
    shape = tuple(out.aval.shape)
    seen: set[int] = set()
    frontier, budget = [out], _ASK_BUDGET
    while frontier and budget > 0:
        v = frontier.pop()
        for u, _ in w.uses.get(id(v), ()):
            if id(u) in seen or u.primitive.name not in _FOLLOWED:
                continue
            seen.add(id(u))
            budget -= 1
            for x in u.invars:
                if x is not v and not hasattr(x, "val") and tuple(getattr(x.aval, "shape", ())) == shape:
                    yield x
            frontier.extend(o for o in u.outvars if tuple(getattr(o.aval, "shape", ())) == shape)


def _readers_hold_whole(w: Walker, out: Any, axis: int) -> bool:
    """Whether the elementwise readers of ``out`` (followed forward as :func:`_rows_asked` does) meet it with an
    operand of its shape whose layout the user fixed (:attr:`Walker.pinned`: an argument, a sharding constraint)
    whole along ``axis``.  An intermediate value met whole (an activation's) does not decide: XLA reduce-scatters
    input gradients met so (measured on keras-hub's FSDP ResNet)."""
    for x in _same_shape_operands(w, out):
        lay = w.env.get(x)
        if id(x) in w.pinned and lay is not None and not is_free(lay) and not lay.dims[axis]:
            return True
    return False


def _split_along(w: Walker, value: Any, axis: int) -> tuple[str, ...]:
    """The split ``value`` has (or will have) along ``axis``: its layout where the walk has one, else its
    producer's operands' through elementwise ops and convs whose window is no longer than the result along the
    axis (Shardy pairs the input's axis with the result's there), () where that leads nowhere split."""
    stack, budget = [(value, axis)], _ASK_BUDGET
    while stack and budget > 0:
        v, ax = stack.pop()
        budget -= 1
        lay = w.env.get(v)
        if lay is not None:
            if not is_free(lay) and lay.dims[ax]:
                return tuple(lay.dims[ax])
            continue
        home = home_of(w.costs, v)
        if home is None:
            continue
        made = home.jaxpr.eqns[home.made_at(v)]
        name = made.primitive.name
        if name in _FOLLOWED:
            shape = tuple(v.aval.shape)
            stack.extend(
                (x, ax) for x in made.invars if not hasattr(x, "val") and tuple(getattr(x.aval, "shape", ())) == shape
            )
        elif name == "conv_general_dilated":
            dn, q = made.params["dimension_numbers"], made.params
            spatial = list(dn.out_spec[2:])
            if ax in spatial:
                j = spatial.index(ax)
                kernel = made.invars[1].aval.shape[dn.rhs_spec[2 + j]]
                if q["lhs_dilation"][j] == 1 and kernel <= v.aval.shape[ax]:
                    stack.append((made.invars[0], dn.lhs_spec[2 + j]))
    return ()


def _differentiated(w: Walker, eqn: Any) -> bool:
    """Whether the program differentiates this conv: its input is read by another conv (the kernel gradient)."""
    uses = w.uses.get(id(eqn.invars[0]), [])
    return any(u is not eqn and u.primitive.name == "conv_general_dilated" for u, _ in uses)


def _features_win(eqn: Any, lhs: Layout, rhs: Layout) -> bool:
    """Whether XLA's sharding propagation gives a conv's result the kernel's output-feature split rather than
    the input's batch split, where one mesh axis splits both (an FSDP kernel split on its outputs against a
    batch split over the same axis).

    Shardy's rule for a convolution makes each spatial axis a factor shared by the input and the result
    where the kernel is no larger than the result along it (else the input shares it with the kernel);
    the conflict goes to the larger side of the result seen as a matrix: output features against the batch
    times the shared spatial factors.  Measured on one-op programs on (data=4, model=2), the batch and the
    kernel's outputs both over 'data' (tests/test_conv_rules.py): (8,4,4,64) 3×3 stride 1 → batch (64 ≤
    8·4·4), 256 features → features; stride 2 (result 2×2 < kernel 3) → features once they exceed the batch
    (16 > 8); a 1×1 stride-2 conv → features above 8·2·2.  XLA then gathers the other operand's split.

    Newer XLA (jax 0.12's, :mod:`.xla_behaviour`) also multiplies the features by the kernel's window along each
    shared spatial axis of stride 1, the kernel's size against the input's there: (8,8,8,16) against 3×3×16×64
    → features (64·9 > 8·8·8), against 3×3×16×56 → batch; a 3×3 window on 2×2 rows (kernel larger) and stride-2
    axes weigh as before (measured on one-op programs, dilated windows and (2, 1) strides included).
    """
    p = eqn.params
    dn = p["dimension_numbers"]
    out_shape = eqn.outvars[0].aval.shape
    windows_join = xla_behaviour().conv_windows_join_features
    rows, features = lhs.shape[dn.lhs_spec[0]], int(out_shape[dn.out_spec[1]])
    for j, (rj, oi) in enumerate(zip(dn.rhs_spec[2:], dn.out_spec[2:])):
        if rhs.shape[rj] <= out_shape[oi]:
            rows *= int(out_shape[oi])
            if windows_join and p["window_strides"][j] == 1:
                features *= int(rhs.shape[rj])
    return features > rows


def _dilated_halo_pieces(
    length: int, n: int, out_len: int, window: int, stride: int, rdil: int, low: int, ldil: int
) -> list[int]:
    """Collective-permute sizes (rows) of a windowed read of an input dilated ``ldil`` times, split ``n`` ways.

    Result row ``r`` with tap ``t`` reads dilated position ``r·stride + t·rdil - low``: input row
    ``position / ldil`` where that divides (the holes between rows are zeros nobody sends).
    """
    s, o = length // n, out_len // n
    left = right = 0
    for k in range(n):
        rows = [
            q // ldil
            for r in range(k * o, (k + 1) * o)
            for t in range(window)
            if (q := r * stride + t * rdil - low) % ldil == 0 and 0 <= q // ldil < length
        ]
        if not rows:
            continue
        left = max(left, k * s - min(rows))
        right = max(right, max(rows) + 1 - (k + 1) * s)
    pieces = []
    for side in (left, right):
        while side > 0:
            pieces.append(min(side, s))
            side -= s
    return pieces


def _batch_groups_whole(p: Any, lhs: Layout, rhs: Layout, lb: int, lf: int, ri: int, ro: int) -> bool:
    """Whether a depthwise conv's kernel gradient (``batch_group_count`` = the input's batch: one activation
    channel a group; features ungrouped) contracts features split alike on both operands while its groups are
    whole on each device: then it is an ordinary contraction with partial sums.  Groups of several channels are
    not: XLA gathers an operand whole first (measured: 4 channels in 2 groups, batch over 2: an all-gather of
    the input and an all-reduce), not modelled."""
    return (
        p["batch_group_count"] != 1
        and p["batch_group_count"] == lhs.shape[lb]
        and p["feature_group_count"] == 1
        and bool(lhs.dims[lf])
        and lhs.dims[lf] == rhs.dims[ri]
        and not lhs.dims[lb]
        and not rhs.dims[ro]
    )


def _whole_window(eqn: Any) -> bool:
    """Whether a conv's window covers its whole unpadded input, one result position per spatial axis (a 1x1
    conv's kernel gradient: a contraction over the batch and spatial axes, a dot), ungrouped and undilated."""
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    x, k, y = (v.aval.shape for v in (eqn.invars[0], eqn.invars[1], eqn.outvars[0]))
    if p["feature_group_count"] != 1 or p["batch_group_count"] != 1:
        return False
    if any(d != 1 for d in (*p["lhs_dilation"], *p["rhs_dilation"], *p["window_strides"])):
        return False
    if any(lo or hi for lo, hi in p["padding"]):
        return False
    spatial = zip(dn.lhs_spec[2:], dn.rhs_spec[2:], dn.out_spec[2:])
    return all(int(x[i]) == int(k[j]) and int(y[o]) == 1 for i, j, o in spatial)


def _depthwise_regroup(
    w: Walker, eqn: Any, lhs: Layout, rhs: Layout, lb: int, lf: int, ri: int, ro: int
) -> tuple[str, ...]:
    """The mesh axes a depthwise conv's input is moved onto from its batch (its channels over the kernel's output
    split), or () where XLA does not: the input's batch split exactly as the kernel's outputs, its channels, the
    kernel's per-group inputs and both operands' spatial axes whole, each channel its own group, the groups
    dividing over the split.  Groups of several channels are not moved: XLA gathers the input and the kernel
    (measured: 16 channels in 8 groups, batch and outputs over 4: two all-gathers), left to the grouped bound."""
    p, split = eqn.params, rhs.dims[ro]
    if p["batch_group_count"] != 1 or p["feature_group_count"] != lhs.shape[lf] or p["feature_group_count"] == 1:
        return ()
    if not split or lhs.dims[lb] != split or lhs.dims[lf] or rhs.dims[ri]:
        return ()
    if any(d for i, d in enumerate(lhs.dims) if i not in (lb, lf)) or any(d for i, d in enumerate(rhs.dims) if i != ro):
        return ()
    if lhs.unreduced or rhs.unreduced or lhs.shape[lf] % group_size(w, split):
        return ()
    return split


def _batch_groups_split_alike(w: Walker, p: Any, lhs: Layout, rhs: Layout, lb: int, lf: int, ri: int, ro: int) -> bool:
    """Whether a batch-grouped conv (a grouped conv's kernel gradient) has its input's batch (the groups) split
    like the kernel's outputs into whole groups, the contracted features split alike on both (or whole): its
    groups independent."""
    split = lhs.dims[lb]
    if p["batch_group_count"] == 1 or p["feature_group_count"] != 1 or not split or rhs.dims[ro] != split:
        return False
    if lhs.dims[lf] != rhs.dims[ri] or lhs.unreduced or rhs.unreduced:
        return False
    return bool(p["batch_group_count"] % group_size(w, split) == 0)


def _groups_split_alike(w: Walker, eqn: Any, lhs: Layout, rhs: Layout, lf: int, ri: int, ro: int) -> bool:
    """Whether a feature-grouped conv's input features and kernel outputs are split alike into whole groups (the
    kernel's per-group inputs whole): its groups are independent, as a batch is."""
    p, split = eqn.params, lhs.dims[lf]
    if p["batch_group_count"] != 1 or not split or rhs.dims[ro] != split or rhs.dims[ri]:
        return False
    return bool(p["feature_group_count"] % group_size(w, split) == 0)


def _scatter_axes(
    w: Walker, eqn: Any, phase: str, lhs: Layout, rhs: Layout, out: Layout, of: int, summed: list[tuple[str, ...]]
) -> tuple[tuple[str, ...], bool]:
    """(the summed axes an input gradient's partial sums end split over, onto its channels, or (); whether XLA
    gets there through the idle mesh axes).

    Measured on the keras-hub ResNet under dp×tp: each input-gradient conv (the cotangent's channels
    contracted with the kernel's outputs, both split over 'model') reduce-scatters onto the channels, the
    split its activations had in the forward pass.  Where the mesh axes neither operand uses hold more
    devices than the sum, XLA computes a slice of the channels per idle group instead, all-reduces that
    slice and permutes it onto the split (``via_idle``).  Not for a program output (XLA leaves those whole
    unless asked).
    """
    if phase != "backward" or len(summed) != 1 or out.dims[of] or id(eqn.outvars[0]) in w.program_outputs:
        return (), False
    axes = summed[0]
    if not axes or any(m in d for d in out.dims for m in axes) or out.shape[of] % group_size(w, axes):
        return (), False
    if _asked_split(w, eqn.outvars[0], of) is not None:
        return (), False  # asked for explicitly (an output, a reshard): that decides
    if not _rows_asked(w, eqn.outvars[0], of, set()) and _readers_hold_whole(w, eqn.outvars[0], of):
        # Where the result's readers meet it with a value the user laid out whole along the channels (an argument:
        # a kernel gradient summed over the batch's axis, read by a replicated optimizer update with the weight or
        # its moments), and none split, XLA's propagation gives it the argument's layout and all-reduces it whole
        # (measured: a data-parallel SGD step of two convs, each kernel gradient one all-reduce,
        # tests/test_conv_rules.py).
        return (), False
    return axes, _idle_size(w, lhs, rhs) >= group_size(w, axes)


def _idle_axes(w: Walker, lhs: Layout, rhs: Layout) -> tuple[str, ...]:
    """The mesh axes neither operand of a conv uses, in the mesh's order."""
    used = {m for d in (*lhs.dims, *rhs.dims) for m in d}
    return tuple(m for m in w.costs.mesh_sizes if m not in used)


def _idle_size(w: Walker, lhs: Layout, rhs: Layout) -> int:
    """Devices along the mesh axes neither operand of a conv uses."""
    return group_size(w, _idle_axes(w, lhs, rhs))


def _asked_scatter_dim(w: Walker, eqn: Any, out: Layout, summed: list[tuple[str, ...]]) -> int | None:
    """The dimension a conv's partial sums are reduce-scattered onto because the caller asks for the result
    split there over exactly the summed axes (read at the output it flows to), or None.

    Measured on the keras-hub ResNet under FSDP (kernels split on their outputs over 'data', the batch over
    'data'): each kernel gradient, partial over the batch's axis and asked back in the kernel's split, is
    one reduce-scatter (f32[3,3,64,64] over 'data'), not an all-reduce and a slice.
    """
    if len(summed) != 1 or not summed[0]:
        return None
    axes = summed[0]
    if any(m in d for d in out.dims for m in axes):
        return None
    n = group_size(w, axes)
    for dim, size in enumerate(out.shape):
        if not out.dims[dim] and size % n == 0 and _asked_split(w, eqn.outvars[0], dim) == axes:
            return dim
    return None


def _regroup_axes(w: Walker, lhs: Layout, rhs: Layout, lf: int, ri: int, ro: int) -> tuple[str, ...]:
    """The idle mesh axes XLA moves a conv's contraction onto, or () when it gathers the input instead.

    It does when the input's features are split over the same axes as the kernel's outputs, the kernel's
    input features are whole, and the axes neither operand uses hold at least as many devices as that split (and
    divide the features): XLA's dot handler then prefers using every device to gathering the input.
    """
    split = lhs.dims[lf]
    if not split or rhs.dims[ri] or rhs.dims[ro] != split or lhs.unreduced or rhs.unreduced:
        return ()
    return _idle_regroup(w, lhs, rhs, lhs.shape[lf], split)


def _idle_regroup(w: Walker, lhs: Layout, rhs: Layout, size: int, split: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh axes neither operand uses, when they hold at least as many devices as ``split`` and divide
    ``size`` (the length of the dimension to move onto them)."""
    used = {m for d in (*lhs.dims, *rhs.dims) for m in d}
    idle = tuple(m for m in w.costs.mesh_sizes if m not in used)
    n = group_size(w, idle)
    if n < group_size(w, split) or size % n:
        return ()
    return idle


# Ops a kernel gradient passes through on its way to the step's output, its layout unchanged.
_PASS_THROUGH = frozenset({"add_any", "add", "convert_element_type", "mul", "neg", "copy", "copy_p"})


_PLACEMENTS = frozenset({"reshard", "sharding_constraint"})


def _placed_split(eqn: Any, dim: int) -> tuple[str, ...] | None:
    """The split a reshard / sharding constraint puts on dimension ``dim`` (None when it leaves it open)."""
    sh = eqn.params.get("sharding") or eqn.params.get("dst_sharding")
    entries = list(getattr(sh, "spec", None) or ())
    if dim >= len(entries):
        return () if getattr(sh, "spec", None) is not None else None
    e = entries[dim]
    if e is None:
        return ()
    if isinstance(e, str):
        return (e,)
    return tuple(e) if isinstance(e, tuple) else None  # UNCONSTRAINED: XLA's to choose


def _asked_split(w: Walker, var: Any, dim: int) -> tuple[str, ...] | None:
    """The split the caller asks for dimension ``dim`` of ``var``, read at the program output it flows to
    unchanged (through adds, casts and scalings), or None when it is not asked for."""
    for _ in range(8):
        asked = w.requested.get(id(var))
        if asked is not None:
            return asked[dim] if dim < len(asked) else None
        uses = w.uses.get(id(var), [])
        if len(uses) != 1:
            return None
        eqn = uses[0][0]
        if eqn.primitive.name in _PLACEMENTS:
            return _placed_split(eqn, dim)
        if eqn.primitive.name not in _PASS_THROUGH or eqn.outvars[0].aval.shape != var.aval.shape:
            return None
        var = eqn.outvars[0]
    return None


def _bytes(shape: tuple[int, ...], at: tuple[int, ...], split: tuple[str, ...], w: Walker) -> int:
    """Elements per device of ``shape`` with the dimensions ``at`` split over ``split`` (a size to compare)."""
    n = group_size(w, split)
    return math.prod(s // n if i in at else s for i, s in enumerate(shape))


def _adopt(
    w: Walker, out_aval: Any, free: Layout, other: Layout, pairs: list[tuple[int, int]], unsplit: tuple[int, ...]
) -> Layout:
    dims: list[tuple[str, ...]] = [()] * len(free.shape)
    for mine, theirs in pairs:
        d = other.dims[theirs]
        if d and free.shape[mine] % group_size(w, d) == 0:
            dims[mine] = d
    for i in unsplit:
        dims[i] = ()
    return Layout(free.axes, free.shape, free.mesh, tuple(dims))


@register(*WINDOW_REDUCTIONS)
def reduce_window(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    p = eqn.params
    n_ops = len(eqn.outvars)
    src = ins[0]
    if is_free(src):
        return [w.free(v.aval) for v in eqn.outvars]
    out_aval = eqn.outvars[0].aval
    start = len(w.ops)
    dims = list(src.dims)
    halos: list[tuple[int, list[int]]] = []
    uneven: list[tuple[int, Pieces, int]] = []  # axes kept split on uneven or dilated blocks: XLA's own exchange
    regroup: list[tuple[int, tuple[str, ...]]] = []  # of those, the result's axes XLA then keeps split on a prefix
    blocks: dict[int, int] = {}  # the even axes' blocks once their halos are exchanged (XLA's valid data)
    approx = []
    # Axes XLA holds split on padded blocks where explain's layout is whole (an interior pad's uneven result).
    padded = w.env.get(PaddedBlocks(eqn.invars[0]))
    split = [d or (padded.dims[i] if padded is not None else ()) for i, d in enumerate(src.dims)]
    local = [-(-s // group_size(w, split[i])) if split[i] else s for i, s in enumerate(src.shape)]
    for i, d in enumerate(split):
        if not d:
            continue
        window, stride, (low, high) = p["window_dimensions"][i], p["window_strides"][i], p["padding"][i]
        bdil, wdil = p["base_dilation"][i], p["window_dilation"][i]
        length, out_len, n = src.shape[i], int(out_aval.shape[i]), group_size(w, d)
        kept = _dividing_prefix(w, d, out_len) if bdil == 1 else ()
        plan = windowed_pieces(length, n, window, stride, wdil, bdil, low, high)
        if bdil == 1 and out_len % n == 0 and length % n == 0:
            halos.append((i, halo_pieces(length, n, out_len, window, stride, wdil, low)))
            if isinstance(plan, tuple):
                blocks[i] = plan[1]
        elif (
            isinstance(plan, tuple) and out_len >= n and (not src.dims[i] or out_len % n == 0) and not _selected(w, eqn)
        ):
            # Uneven blocks or a dilated base (an average pool's gradient: the window sum after the interior
            # pad): XLA keeps the axis split on padded blocks and exchanges the halos its partitioner computes
            # (measured: 17 padded rows over 2, a 2-row window: one row permuted, tests/test_conv_rules.py).
            uneven.append((i, *plan))
            dims[i] = d
        elif not src.dims[i]:
            # Padded blocks explain cannot follow through this window: XLA's way is not modelled, so the blocks
            # are gathered (as XLA does where it gives up on halos) and the op says so.
            approx.append(f"axis {i} (padded blocks) gathered; XLA may exchange halos instead")
            why = f"{eqn.primitive.name}: padded blocks gathered"
            local[i] = src.shape[i]
            for v in eqn.invars[:n_ops]:
                charge(w, eqn, phase, repeat, "all-gather", d, [math.prod(local) * itemsize(v.aval.dtype)], why)
        elif kept and isinstance(plan, tuple) and src.dims[i] and not _selected(w, eqn):
            # The result's blocks do not divide over the whole split, but over its major axes they do: XLA pools
            # padded blocks over the whole split (its halo exchange), then brings the result to the split over
            # those major axes (measured: 8 rows over (a, b) of (4, 2), a 2x2 stride-2 max pool to 4 rows: two
            # halo permutes, two result permutes and an all-reduce over 'b'; the result rows@a).
            uneven.append((i, *plan))
            regroup.append((i, kept))
            dims[i] = d
        elif kept:
            # The result's blocks do not divide over the whole split, but over its major axes they do: XLA
            # keeps the result split over those (measured: 16 rows over (a, b) pooled to 6 stay split over
            # 'a'; XLA pools padded blocks, permutes them and gathers over 'b', explain gathers the operand
            # over 'b' first: the same layout, other collectives).
            approx.append(f"axis {i} (uneven blocks) gathered over {d[len(kept) :]}; XLA may pool padded blocks")
            dims[i] = kept
            halos.append((i, halo_pieces(length, group_size(w, kept), out_len, window, stride, wdil, low)))
        else:
            approx.append(f"axis {i} (dilated or uneven blocks) gathered; XLA may exchange halos instead")
            dims[i] = ()
    held_dims = tuple(d if src.dims[i] else () for i, d in enumerate(dims))  # the padded blocks: not a layout
    if approx:
        for k, lay in enumerate(ins[:n_ops]):
            _bring(w, eqn, phase, repeat, k, lay, lay.with_dims(held_dims), "reduce_window split gathered")
    grown = _exchange_halos(w, eqn, phase, repeat, src.with_dims(held_dims), halos, eqn.invars[0].aval.dtype, blocks)
    local = [-(-s // group_size(w, dims[i])) if dims[i] else s for i, s in enumerate(src.shape)]
    for j, _ in halos:
        local[j] = grown[j]
    for i, pieces, block in uneven:  # after the even axes, in axis order (XLA exchanges one dimension at a time)
        why = f"{eqn.primitive.name}: halo exchange of padded blocks"
        for k, v in enumerate(eqn.invars[:n_ops]):
            if not is_free(ins[k]):
                _permute_rows(w, eqn, phase, repeat, dims[i], local, i, pieces, v.aval.dtype, why)
        local[i] = block
    for i, kept in regroup:
        _result_to_prefix(w, eqn, phase, repeat, dims, i, kept)
        dims[i] = kept
    outs = [w.relayout(v.aval, dims) for v in eqn.outvars]
    if approx:
        _mark(w, start, "; ".join(approx))
        # Peak: explain holds the gathered operands (twice where gathered along a minor dimension: the memory
        # walk's transposed copy) and computes the results whole along the gathered axes, where XLA computes
        # padded blocks (each device's rows plus halos) and only then all-reduces the result (measured: a
        # window-1 pool of rows@a over 8, stride 2 or 3: a permute and an all-reduce of the result, XLA's peak
        # 1.9-2.8 KB against explain's 8.5 KB).
        held = sum(_local_bytes(lay.with_dims(held_dims), v.aval.dtype) for lay, v in zip(ins[:n_ops], eqn.invars))
        made = sum(_local_bytes(o, v.aval.dtype) for o, v in zip(outs, eqn.outvars))
        # Collectives: XLA's padded blocks take a permute from each side's neighbour and one of the result's
        # pieces before its gather (measured: 2 permutes and an all-gather where explain gathers once).
        more, sent = _gradient_alternative(w, eqn, src, [i for i, d in enumerate(src.dims) if d and d != dims[i]])
        widen_bound(w, start, peak=2 * held + made, collectives=3 * len(approx) + more, sent=sent)
    return outs


def _result_to_prefix(
    w: Walker, eqn: Any, phase: str, repeat: int, dims: list[tuple[str, ...]], i: int, kept: tuple[str, ...]
) -> None:
    """Charge XLA's move of a window op's result from padded blocks over ``dims[i]`` to blocks over its major
    axes ``kept``, replicated over the rest (XLA's ``TileToPartialReplicateHaloExchange``, a compact halo exchange
    when the padded blocks hold rows the new ones do not, then ``ReplicatePartial`` over the rest: an all-reduce of
    the masked block where the block is at most half the group, else an all-gather)."""
    split, out_len = dims[i], int(eqn.outvars[0].aval.shape[i])
    n, groups = group_size(w, split), group_size(w, kept)
    r = n // groups
    src_block, dst_block = -(-out_len // n), -(-out_len // groups)
    local = [-(-int(s) // group_size(w, d)) if d else int(s) for s, d in zip(eqn.outvars[0].aval.shape, dims)]
    surplus = src_block * n // groups - dst_block
    for v in eqn.outvars:
        if surplus > 0:
            left = [surplus * (k // r) for k in range(n)]
            pieces = _compact_exchange(left, [-h for h in left], src_block, out_len)
            why = f"{eqn.primitive.name}: result moved to its blocks over {kept}"
            _permute_rows(w, eqn, phase, repeat, split, local, i, pieces, v.aval.dtype, why)
        whole = [dst_block if j == i else s for j, s in enumerate(local)]
        why = f"{eqn.primitive.name}: result replicated over {split[len(kept) :]}"
        block = [math.prod(whole) * itemsize(v.aval.dtype)]
        if dst_block <= r // 2:  # ReplicatePartial: a masked all-reduce where the block is at most half the group
            charge(w, eqn, phase, repeat, "all-reduce", split[len(kept) :], block, why)
        else:
            charge(w, eqn, phase, repeat, "all-gather", split[len(kept) :], block, why)


def _selected(w: Walker, eqn: Any) -> bool:
    """Whether a max pool's gradient (``select_and_scatter_add``) reads this pool's operand: its uneven blocks are
    then gathered as :func:`_gradient_alternative` prices (the pool and its gradient settled together)."""
    return any(u.primitive.name == "select_and_scatter_add" for u, _ in w.uses.get(id(eqn.invars[0]), []))


def _gradient_alternative(w: Walker, eqn: Any, src: Layout, axes: list[int]) -> tuple[int, float]:
    """(collectives, bytes) XLA's max pool gradient adds where it keeps an uneven pool's split (padded blocks)
    that explain gathers: its select-and-scatter's halo exchanges on those blocks and, on CPU / GPU, the pad's and
    slice's around it (:func:`_scatter_exchange`, :func:`_shift_pieces`), or the replicated operand and cotangent.
    Zero when no ``select_and_scatter_add`` reads the pool's operand (a forward pass, a sum pool).

    Measured on the deep run's draws (8 or 16 rows over 8, pooled by 2 or 3 to rows that do not divide): XLA
    keeps the rows split through the gradient, 7-11 permutes where explain gathers once.
    """
    uses = w.uses.get(id(eqn.invars[0]), [])
    if not any(u.primitive.name == "select_and_scatter_add" for u, _ in uses):
        return 0, 0.0
    p = eqn.params
    dtype_bytes = itemsize(eqn.invars[0].aval.dtype)
    out_shape = eqn.outvars[0].aval.shape
    more, sent = 0, 0.0
    for i in axes:
        n = group_size(w, src.dims[i])
        window, stride, (low, high) = p["window_dimensions"][i], p["window_strides"][i], p["padding"][i]
        length, out_len = src.shape[i], int(out_shape[i])
        row = math.prod(s for j, s in enumerate(src.shard_shape) if j != i) * dtype_bytes
        cot_row = math.prod(int(s) for j, s in enumerate(out_shape) if j != i) * dtype_bytes
        padded = low + length + high
        plan = _scatter_exchange(padded, n, out_len, window, stride, 0)
        around = [_shift_pieces(length, padded, n, -low), _shift_pieces(padded, length, n, low)] if low or high else []
        if plan is None or any(a is None for a in around):
            more += 2  # the operand and the cotangent replicated
            sent += (padded * row + out_len * cot_row) * 2
            continue
        op, cot, _, _ = plan
        pieces = [*op, *[q for a in around if a for q in a]]
        more += len(pieces) + len(cot)
        sent += sum(rows for rows, _ in pieces) * row + sum(rows for rows, _ in cot) * cot_row
    return more, sent


def _free_prefix(split: tuple[str, ...], held: set[str]) -> tuple[str, ...]:
    """The major mesh axes of ``split`` up to the first one in ``held``."""
    n = 0
    while n < len(split) and split[n] not in held:
        n += 1
    return split[:n]


def _dividing_prefix(w: Walker, split: tuple[str, ...], out_len: int) -> tuple[str, ...]:
    """The longest proper prefix of ``split`` (its major mesh axes) that divides a result of ``out_len``."""
    for k in range(len(split) - 1, 0, -1):
        if out_len % group_size(w, split[:k]) == 0:
            return split[:k]
    return ()


def _local_bytes(lay: Layout, dtype: Any) -> int:
    """Bytes of one device's block of ``lay``."""
    return math.prod(lay.shard_shape) * itemsize(dtype)


def _tdiv(a: int, b: int) -> int:
    """Integer division truncated toward zero (C++'s, which XLA's offset calculations use)."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b > 0) else -q


@dataclass
class _Halo:
    """One piece of a shard's window in XLA's compact exchange: from shard ``at`` (or padding), or its own."""

    my: int
    offset: int
    start: int
    limit: int
    at: int  # the shard it comes from; -1: padding


def _compact_exchange(left: list[int], right: list[int], size: int, base: int) -> Pieces:
    """The collective-permutes of XLA's compact halo exchange (``ExchangeHaloCompact``), used where a halo is
    longer than twice the block: each shard's window is cut at block boundaries, and the pieces other shards
    hold are sent by permutes that pair each source with one destination at a time, greedily (XLA's order)."""
    n = len(left)
    halos: list[list[_Halo]] = [[] for _ in range(n)]
    for k in range(n):
        start = k * size - left[k]
        at, limit = start, (k + 1) * size + right[k]
        while at < limit:
            first = at % size
            if at < 0 or at >= base:  # padding: nobody sends it
                rows = min(limit - at, -at) if at < 0 else limit - at
                halos[k].append(_Halo(k, at - start, first, first + rows, -1))
            else:
                rows = min(size - first, limit - at)
                halos[k].append(_Halo(k, at - start, first, first + rows, at // size))
            at += rows
    # Padding pieces longer than a block are cut to a block where other shards have data at that place.
    cut: list[list[_Halo]] = [[] for _ in range(n)]
    sends: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    nxt = [0] * n
    while any(nxt[k] < len(halos[k]) for k in range(n)):
        all_padding = all(halos[k][nxt[k]].at < 0 for k in range(n) if nxt[k] < len(halos[k]))
        for k in range(n):
            if nxt[k] >= len(halos[k]):
                continue
            h = halos[k][nxt[k]]
            piece = _Halo(h.my, h.offset, h.start, h.limit, h.at)
            cut[k].append(piece)
            if not all_padding and h.at < 0 and h.limit > size:
                piece.limit = size
                h.start, h.limit = 0, h.limit - size
            else:
                nxt[k] += 1
            if h.at >= 0 and h.at != k:
                sends[h.at].append((k, len(cut[k]) - 1))
    for k in range(n):
        sends[k].sort(key=lambda ab: cut[ab[0]][ab[1]].offset)
    by_src = [[HaloSend(dst, cut[dst][j].start, cut[dst][j].limit) for dst, j in queue] for queue in sends]
    return group_compact_sends(by_src, size)


def _valid_data(
    left: list[int], right: list[int], size: int, base: int, explicit_left: int, with_halo: int
) -> Pieces | None:
    """XLA's ``ExchangeHaloAndGetValidData``: the compact exchange where the largest halo exceeds twice the
    block with halos (None where that block is half the axis or more: XLA replicates), else :func:`.exchange_pieces`."""
    n = len(left)
    if explicit_left == left[0]:
        widest = size + max(a + b for a, b in zip(left, right))
        if widest == with_halo and max(max(left), max(right)) > 2 * with_halo:
            return None if widest * 2 >= n * size else _compact_exchange(left, right, size, base)
    return exchange_pieces(left, right, size)


def _shift_pieces(length: int, out_len: int, n: int, offset: int) -> Pieces | None:
    """Permutes of XLA's reshard of a pad or slice along an axis split ``n`` ways (a window of one): result
    position ``r`` reads input position ``r + offset`` (a pad's ``-low``, a slice's start); blocks are
    ``ceil(len / n)``."""
    s, o = -(-length // n), -(-out_len // n)
    left = [k * s - (k * o + offset) for k in range(n)]
    right = [(k + 1) * o + offset - (k + 1) * s for k in range(n)]
    return _valid_data(left, right, s, length, -offset, o)  # the window's low padding: -offset


TRIMMED = "trimmed"  # XLA drops the shards without output first (a result shorter than the split): not modelled


def windowed_pieces(
    length: int, n: int, window: int, stride: int, wdil: int, bdil: int, low: int, high: int
) -> tuple[Pieces, int] | None | str:
    """(collective-permutes, the block with halos) of XLA's halo exchange for a windowed op's operand along an axis
    split ``n`` ways, the result kept split: None where XLA gives up on halos and replicates the axis, or
    :data:`TRIMMED` where it first drops shards that compute nothing (a path not modelled here).

    XLA's SPMD partitioner (``ReshardAsWindowedInput``, which ``reduce-window`` and ``pad`` use): the windows are
    dealt out ``ceil(count / n)`` per shard, shard ``k``'s first needed operand position is
    ``(stride·per·k + bdil - 1 - low % bdil) // bdil`` past ``low // bdil`` positions of explicit padding, and
    every shard gets the largest halo any shard needs (:func:`_valid_data`).  Uneven blocks and a base dilation
    (a pad's interior padding, an average pool's gradient) keep the axis split: an average pool's gradient, 8
    pooled rows over 2 padded (1, 1, 1) to 17, moves nothing in the pad and one row in the window sum after it
    (measured, tests/test_conv_rules.py).
    """
    dilated = 1 + (window - 1) * wdil
    full = 1 + (length - 1) * bdil + low + high
    count = (full - dilated) // stride + 1
    per, s = -(-count // n), -(-length // n)
    explicit_left = _tdiv(low, bdil)
    if count < n and wdil == 1 and bdil == 1:
        if -(-(length + high) // s) < n or (-explicit_left) // s - count > 0:
            return TRIMMED
    if full < dilated or (stride != 1 and (stride * per) % bdil):
        return None
    low_in_shard = low - explicit_left * bdil  # C++'s remainder: the low padding left to each shard's window
    start = [(stride * per * k + bdil - 1 - low_in_shard) // bdil for k in range(n)]
    reach = stride * (per - 1) + dilated + bdil - 1 - low_in_shard
    limit = [(stride * per * k + reach) // bdil for k in range(n)]
    left = [s * k + explicit_left - start[k] for k in range(n)]
    right = [limit[k] - (s * k + s + explicit_left) for k in range(n)]
    with_halo = max(b - a for a, b in zip(start, limit))
    pieces = _valid_data(left, right, s, length, explicit_left, with_halo)
    return None if pieces is None else (pieces, with_halo)


def dilated_pad(
    w: Walker, eqn: Any, phase: str, repeat: int, src: Layout, axis: int, out_len: int, low: int, interior: int
) -> bool:
    """Charge XLA's halo permutes for a pad with interior padding along the split ``axis`` of ``src``
    (a window of one over the dilated operand: :func:`windowed_pieces`); False where XLA replicates the axis
    instead, or drops shards first (the caller gathers it)."""
    n = group_size(w, src.dims[axis])
    high = out_len - (src.shape[axis] - 1) * (interior + 1) - 1 - low
    plan = windowed_pieces(src.shape[axis], n, 1, 1, 1, interior + 1, low, high)
    if not isinstance(plan, tuple):
        return False
    pieces, _ = plan
    out = eqn.outvars[0]
    if out_len % n:
        # The result does not divide: XLA keeps it on padded blocks, which explain's layouts cannot hold.  Only
        # for window sums does the walk carry that split on (:class:`PaddedBlocks`); other readers gather it.
        users = w.uses.get(id(out), [])
        if (
            not users
            or id(out) in w.program_outputs
            or any(u.primitive.name not in WINDOW_REDUCTIONS for u, _ in users)
        ):
            return False
        key = PaddedBlocks(out)
        held = w.env.get(key, src.with_dims(tuple(() for _ in src.dims)))
        w.env[key] = _with(held, axis, src.dims[axis])
    why = "pad with interior padding: halo exchange along a split axis"
    dtype = eqn.invars[0].aval.dtype
    _permute_rows(w, eqn, phase, repeat, src.dims[axis], list(src.shard_shape), axis, pieces, dtype, why)
    return True


def _scatter_exchange(
    length: int, n: int, out_len: int, window: int, stride: int, low: int
) -> tuple[Pieces, Pieces, int, int] | None:
    """(operand permutes, cotangent permutes, operand block with halos, cotangent block with halos) of XLA's
    partitioned ``select-and-scatter`` along one axis split ``n`` ways, or None where it replicates.

    XLA's SPMD partitioner (``HandleSelectAndScatter``) does not exchange what each shard needs: it finds
    shard ``k``'s first and limit windows by linear formulas in ``k`` (a window shorter than the stride counts
    as the stride), and every shard gets the largest left and right halo any shard needs, of the cotangent and
    then of the operand.  So a pool whose blocks are not a multiple of the stride exchanges halos although
    each window lies in one block (measured: 16 rows over 2, a 1-row window of stride 3: one cotangent row and
    two plus one operand rows, three permutes; tests/test_primitive_rules.py's reduce_window draws).
    """
    s, so = -(-length // n), -(-out_len // n)
    size = max(window, stride)
    first = [_tdiv(s * k + low - size + stride, stride) for k in range(n)]
    limit = [_tdiv(s * k + s + low + stride - 1, stride) for k in range(n)]
    windows = max(b - a for a, b in zip(first, limit))
    block = (windows - 1) * stride + size
    cot_left = [so * k - first[k] for k in range(n)]
    cot = _valid_data(cot_left, [limit[k] - so * (k + 1) for k in range(n)], so, out_len, 0, windows)
    op = _valid_data(
        [s * k + low - stride * first[k] for k in range(n)],
        [stride * limit[k] - (s * k + s + stride + low - size) for k in range(n)],
        s,
        length,
        low,
        block,
    )
    if cot is None or op is None:
        return None
    return op, cot, block, windows


def _permute_rows(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    axes: tuple[str, ...],
    local: list[int],
    axis: int,
    pieces: Pieces,
    dtype: Any,
    why: str,
) -> None:
    """Charge one collective-permute per piece along ``axis`` of a block shaped ``local``.  A piece one device
    alone sends (XLA's one-way ``source_target_pairs={{3,4}}``, e.g. the one shard whose slice of the padded
    result straddles two blocks) still moves data and is charged: the compiled program runs it."""
    row = math.prod(s for i, s in enumerate(local) if i != axis) * itemsize(dtype)
    arrays = [rows * row for rows, senders in pieces if senders > 0]
    charge(w, eqn, phase, repeat, "collective-permute", axes, arrays, why)


@register("select_and_scatter_add")
def select_and_scatter_add(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A max pool's gradient: the cotangent scattered to each window's chosen input position.

    Along each split axis XLA exchanges the cotangent's and the operand's halos by its partitioner's linear
    formulas (:func:`_scatter_exchange`), not by what each shard needs.  On CPU and GPU, JAX lowers a padded
    window as ``pad`` → ``select-and-scatter`` (unpadded) → ``slice`` (XLA's CPU and GPU backends do not take
    the padding), and XLA reshards the padded operand and the sliced result across the uneven blocks of the
    padded length: their permutes too (:func:`_shift_pieces`).  Where XLA gives up on halos (a halo longer than
    a block reaching most of the axis), it replicates the operand and cotangent: gathered here too.
    """
    p = eqn.params
    source, operand = ins
    out_aval = eqn.outvars[0].aval
    ref = operand if not is_free(operand) else source
    if is_free(ref):
        return [w.free(out_aval)]
    dims = list(ref.dims) if ref is operand else [()] * len(out_aval.shape)
    expands = w.costs.profile.tiling != "tpu"  # JAX's CPU / GPU lowering pads outside the select-and-scatter
    start = len(w.ops)
    approx: list[str] = []
    plans: list[tuple[int, tuple[Pieces, Pieces, int, int] | None, Pieces, Pieces, int]] = []
    for i, d in enumerate(list(dims)):
        if not d:
            continue
        window, stride, (low, high) = p["window_dimensions"][i], p["window_strides"][i], p["padding"][i]
        length, n = operand.shape[i], group_size(w, d)
        out_len = int(eqn.invars[0].aval.shape[i])
        if not expands:  # the TPU lowering keeps the padding in the select-and-scatter
            low, high = 0, 0
            plan_low = p["padding"][i][0]
        else:
            plan_low = 0
        padded = low + length + high
        pad_in = _shift_pieces(length, padded, n, -low) if low or high else []
        pad_out = _shift_pieces(padded, length, n, low) if low or high else []
        plan = _scatter_exchange(padded, n, out_len, window, stride, plan_low)
        if length % n or out_len % n:
            approx.append(f"axis {i}: uneven blocks gathered; XLA may exchange halos of padded blocks instead")
            dims[i] = ()
            continue
        if pad_in is None or pad_out is None:
            approx.append(f"axis {i}: the pad's halos reach most of the axis; XLA gathers it another way")
            dims[i] = ()
            continue
        plans.append((i, plan, pad_in, pad_out, padded))
    # No halo exchange XLA can build along some axis (a halo reaching most of it): it replicates the padded
    # operand and the cotangent (an all-gather per split axis each), scatters whole, and slices the result back
    # to its split (free) before the slice's permutes (measured: 8 rows over 8, a 2-row SAME window).
    whole = any(plan is None for _, plan, _, _, _ in plans)
    if not is_free(operand):
        operand = _bring(w, eqn, phase, repeat, 1, operand, operand.with_dims(tuple(dims)), "select_and_scatter_add")
    src_dims = tuple(d if source.shape[i] % max(group_size(w, d), 1) == 0 else () for i, d in enumerate(dims))
    source = _bring(w, eqn, phase, repeat, 0, source, source.with_dims(src_dims), "select_and_scatter_add cotangent")
    op_dtype, src_dtype = eqn.invars[1].aval.dtype, eqn.invars[0].aval.dtype
    local = list(operand.shard_shape)
    for i, _, pad_in, _, padded in plans:  # the pad before the scatter (CPU / GPU): the operand's padded blocks
        _permute_rows(w, eqn, phase, repeat, dims[i], local, i, pad_in, op_dtype, "select_and_scatter_add: pad")
        local[i] = -(-padded // group_size(w, dims[i]))
    if expands:
        # The pad grows the whole axes locally, after its permutes (which carry the unpadded ones: measured,
        # [4, 16, 16, 4] rows@a over 8 with a SAME window: [4, 2, 16, 4] permutes); the later ones carry them padded.
        local = [s + lo + hi if not dims[i] else s for i, (s, (lo, hi)) in enumerate(zip(local, p["padding"]))]
    src_local = list(source.shard_shape)
    if whole:
        for i, _, _, _, _ in plans:
            if not is_free(source):
                src_local[i] = source.shape[i]
                why = "select_and_scatter_add: cotangent replicated"
                charge(w, eqn, phase, repeat, "all-gather", dims[i], [math.prod(src_local) * itemsize(src_dtype)], why)
            if not is_free(operand):
                local[i] *= group_size(w, dims[i])
                why = "select_and_scatter_add: operand replicated"
                charge(w, eqn, phase, repeat, "all-gather", dims[i], [math.prod(local) * itemsize(op_dtype)], why)
    for i, plan, _, _, _ in plans:
        if whole or plan is None:
            break
        op_pieces, cot_pieces, op_block, cot_block = plan
        if not is_free(source):
            why = "select_and_scatter_add: cotangent halo"
            _permute_rows(w, eqn, phase, repeat, dims[i], src_local, i, cot_pieces, src_dtype, why)
        src_local[i] = cot_block
        if not is_free(operand):
            _permute_rows(w, eqn, phase, repeat, dims[i], local, i, op_pieces, op_dtype, "select_and_scatter_add: halo")
        local[i] = op_block
    for i, _, _, _, padded in plans:  # the scatter's result, back to the padded blocks
        local[i] = -(-padded // group_size(w, dims[i]))
    for i, _, _, pad_out, _ in plans:  # the slice after it: the result's blocks of the unpadded length
        _permute_rows(
            w, eqn, phase, repeat, dims[i], local, i, pad_out, out_aval.dtype, "select_and_scatter_add: slice"
        )
        local[i] = -(-operand.shape[i] // group_size(w, dims[i]))
    if approx:
        _mark(w, start, "; ".join(approx))
    return [w.relayout(out_aval, dims)]
