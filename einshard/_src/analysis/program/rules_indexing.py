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

import functools
import math
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from ...core.layout import Layout
from ..cost import Collective, sent_bytes, wire_itemsize
from ..einsum.read import dtype_info
from .costing import DotResult, is_free
from .idle_axes import gather_route, over_idle_axes, resplit_onto
from .lookahead import MAX_STEPS, JaxprHome, Reach, counts_of, home_of, reach_cache
from .movement import (
    SentKind,
    charge,
    idle_slice_sum,
    itemsize,
    mark_approximate,
    mark_conflict,
    mark_gather_then_shift,
    mark_swap,
)
from .open_values import paired_axes
from .registry import register
from .report import OpBound
from .rules_structural import all_explicit, explicit_dims, merged_split, typed_dims
from .segment_memo import PlainTable, Recorder, note_asked, note_search, past_copy, unlogged
from .upstream import readers_agree
from .values import CARRIERS, ELEMENTWISE, REDUCTIONS, Partial

if TYPE_CHECKING:
    from .registry import WalkerLike as Walker  # the rules type against the protocol, not walker.py

__all__ = ["leaves_program"]


@register("dot_general")
def dot_general(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    dn = eqn.params["dimension_numbers"]
    summed = [w.summed.get(id(v), frozenset()) for v in eqn.invars[:2]]
    first = len(w.ops)
    ins, settled = _settle_passthrough_conflict(w, eqn, ins, repeat, phase)
    if not settled:
        ins = _at_asked_split(w, eqn, ins, repeat, phase)
    before = ins
    ins = _settle_contraction_conflict(w, eqn, ins, repeat, phase)
    lhs, rhs = match_contracting(ins[0], ins[1], dn, w.costs.mesh_sizes, summed)
    res = gathered_as_xla(w, lhs, rhs, dn, w.dtype(eqn), w.costs.dot(lhs, rhs, dn, w.dtype(eqn)))
    sums = frozenset(m for c in res.collectives if c.kind == "all-reduce" and c.tensor == "result" for m in c.axes)
    if sums:
        w.summed[id(eqn.outvars[0])] = sums
    colls = per_contracted_axis(w, res.collectives, lhs, dn)
    out_dims = res.out.dims
    pending: frozenset[str] = frozenset()
    share = 1
    if sums:
        out_dims, colls = scatter_to_consumers(w, eqn, res.out, colls, sums, (lhs, rhs))
        if out_dims == res.out.dims:  # summed whole: the partial buffer waits for its all-reduce
            out_dims, colls, share = sliced_for_consumer(w, eqn, res.out, colls, sums, (lhs, rhs))
            w.env[Partial(eqn.outvars[0])] = res.out.with_dims(out_dims, sums)
            stages = [c for c in colls if c.kind == "all-reduce" and c.tensor == "result"]
            if len(stages) == 1 and leaves_program(w, eqn.outvars[0]):
                # A gradient that only leaves the program: XLA sums it to the output's layout
                # (a reduce-scatter to an FSDP weight's split, an all-reduce to a replicated one).
                # It stays pending; the output's layout settles it.
                colls = tuple(c for c in colls if c is not stages[0])
                pending = frozenset(stages[0].axes)
    # (a result sliced for its consumer computes only its piece: ``share`` of the dot's work)
    flops = res.flops // share if share > 1 else res.flops
    time_s = (res.time_s - sum(c.time for c in res.collectives)) / share + sum(c.time for c in colls)
    idle = None if sums else over_idle_axes(w, eqn, [lhs, rhs], res.out, colls)
    if idle is not None and idle[-1].kind == "all-reduce":
        # XLA re-splits the operand's contraction onto the idle mesh axes (one collective-permute) and sums this
        # dot's partial products over them: the operand is never gathered whole.  The permute is a move of the
        # operand (XLA's CSE makes it once for every dot reading it, as q, k and v projections of one hidden
        # state), so it is charged as one (w.change); the all-reduce of this dot's own products is charged here,
        # per dot (measured: three such projections, one collective-permute then one tuple all-reduce of three).
        k = operand_index(idle[0])
        src = ins[k] if ins[k].dims == (lhs, rhs)[k].dims else (lhs, rhs)[k]
        onto = resplit_onto(src, tuple(colls[0].axes), tuple(idle[0].axes[len(colls[0].axes) :]))
        why = "dot operand's contracted split moved onto idle mesh axes"
        w.change(eqn, phase, src, onto, eqn.invars[k].aval.dtype, repeat, why)
        # (peak: XLA slices the operand's piece for its new split and permutes it, two buffers of ``onto``'s
        # block live at the dot, the operand never gathered: measured on (16, 32) @ (32, 64), both split over
        # 'b' on (4, 2), 11520 B; the whole gathered copy beside the shard said 15360 B)
        w.bind_sent(eqn, onto)
        time_s += idle[-1].time - sum(c.time for c in colls)
        colls = idle[-1:]
    else:
        for c in colls:
            if c.kind == "all-gather" and _names_operand(c):
                k = operand_index(c)
                lay = ins[k]
                dims = tuple(tuple(m for m in d if m not in c.axes) for d in lay.dims)
                w.bind_copy(eqn.invars[k], lay.with_dims(dims))
                w.bind_dot_copy(eqn, k, lay.with_dims(dims))
        grouped = (
            grouped_operand(lhs, rhs, res.out, dn, w.costs.mesh_sizes, [v.aval.dtype for v in eqn.invars[:2]])
            if any(c.kind == "all-gather" and _names_operand(c) for c in colls)
            else None  # (only an operand's gather is made within a group)
        )
        kept = tuple(
            c
            for c in colls
            if not w.already_moved(
                ins,
                c,
                as_move=True,
                group=grouped[1] if grouped and _names_operand(c) and operand_index(c) == grouped[0] else (),
            )
        )
        if idle is not None:
            # XLA moves the gathered operand onto the idle mesh axes, then gathers it over them (idle_axes.py):
            # the whole copy, which a later dot reading the value reuses (permute and gather alike).
            idle = idle if len(kept) == len(colls) else ()
            time_s += sum(c.time for c in idle) - sum(c.time for c in colls)
            colls = idle
        elif len(kept) != len(colls):
            # An operand another dot already brought to the same layout (an FSDP weight gathered for the
            # forward and again for the backward): XLA computes that gather once.
            time_s -= sum(c.time for c in colls if c not in kept)
            colls = kept
    result_bytes = math.prod(res.out.shard_shape) * itemsize(eqn.outvars[0].aval.dtype)
    routed = batch_split_via_idle(w, lhs, rhs, dn, colls, result_bytes)
    if routed is not colls:
        time_s += sum(c.time for c in routed) - sum(c.time for c in colls)
        colls = routed
        w.bind_sent(eqn, next(c.after for c in colls if c.after is not None))  # the permuted and gathered blocks
    out = w.relayout(eqn.outvars[0].aval, out_dims)
    since = len(w.ops)
    w.record(eqn, phase, res.expression, out, colls, flops, time_s, repeat)
    # Operands that disagree on a split (an all-to-all brings one to the other's): XLA may settle it upstream.
    moved = [int(c.tensor.split()[1]) - 1 for c in colls if c.kind == "all-to-all" and _names_operand(c)]
    for k in moved:
        w.bind_sent(eqn, ins[k])  # its send and receive buffers (memory.py)
    mark_conflict(w, eqn, since, moved)
    if settled:
        mark_conflict(w, eqn, first, settled)
    if ins is not before and sums and any(c.kind == "collective-permute" for c in colls):
        # The clash's product brought to its consumer's split: an all-reduce of one slice per idle group and a
        # permute, as XLA does on Auto axes (keras-hub OPT's, ELECTRA's and Phi-3's forwards); in ALBERT's
        # Explicit forward (its program under auto_axes) XLA all-reduces the whole product and slices it
        # instead (a reduce-scatter), for reasons not found: marked, bounded by the whole result.
        whole = float(math.prod(eqn.outvars[0].aval.shape) * itemsize(eqn.outvars[0].aval.dtype))
        mark_approximate(w, since, CONFLICT_SUM_NOTE, OpBound(len(colls) + 1, whole, whole))
    lone = one_sided_contraction(lhs, rhs, dn) if colls else ()  # (no collective: nothing to choose)
    if lone and len(w.ops) > since and not w.ops[since].approximate:
        mark_approximate(w, since, LONE_CONTRACTION_NOTE, _lone_contraction_bound(w, eqn, lone, colls))
    if pending:
        typed = typed_dims(eqn.outvars[0].aval)
        dname, size = dtype_info(eqn.outvars[0].aval.dtype)
        # (a 16-bit float XLA:CPU sums in f32: the all-reduce is converted before the slice, and XLA makes no
        # reduce-scatter of it: measured on the gradient of x.astype(bf16) @ y.astype(bf16).T, x[8@a, 8], y[8, 8@a])
        widened = wire_itemsize(dname, size, w.costs.profile.narrow_floats) != size
        if typed is not None and not widened and tuple(typed) != out.dims and pending & {m for d in typed for m in d}:
            # On Explicit axes the sum's type names its split (a weight gradient typed like the weight): XLA
            # reduce-scatters it there at the dot (measured: the gradient of dot_general(x[8@a, 16, 8],
            # y[16@a, 8, 24]) reduce-scatters y's gradient to [16@a, 8, 24], where explain all-reduced it).
            dst = w.relayout(eqn.outvars[0].aval, typed)
            w.change(
                eqn,
                phase,
                out.with_dims(out.dims, pending),
                dst,
                eqn.outvars[0].aval.dtype,
                repeat,
                "dot sum to its typed split",
            )
            return [dst]
    return [out.with_dims(out.dims, pending) if pending else out]


def _factors(dn: Any, lrank: int, rrank: int) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Each operand axis's factor in Shardy's sharding rule for a dot: ``("batch", k)`` and ``("contract", k)`` for
    the k-th paired axes (one factor on both sides), ``("lhs", i)`` / ``("rhs", j)`` for a side's free axis."""
    (lc, rc), (lb, rb) = dn
    lf: list[tuple[str, int]] = [("lhs", i) for i in range(lrank)]
    rf: list[tuple[str, int]] = [("rhs", j) for j in range(rrank)]
    for k, (i, j) in enumerate(zip(lb, rb)):
        lf[i] = rf[j] = ("batch", k)
    for k, (i, j) in enumerate(zip(lc, rc)):
        lf[i] = rf[j] = ("contract", k)
    return lf, rf


def passthrough_conflict(
    lhs: Layout,
    rhs: Layout,
    dn: Any,
    sizes: dict[str, int],
    typed: list[tuple[str, ...]] | None = None,
    asked: Sequence[tuple[str, ...]] | None = None,
) -> tuple[Layout, Layout] | None:
    """The operands' layouts after Shardy settles a mesh axis that they split along different factors both of which
    reach the result (a batch axis on one side and a free axis on the other, or two free axes); None where there is
    no such clash.

    Shardy's propagation (its aggressive strategy): each factor takes the split its operands agree on (one a prefix
    of the other: the longer; else their common prefix), and where factors claim one mesh axis the larger operand's
    factors are settled first (the left operand's where they are the same size; its own splits before the splits
    its factors bring from the other operand); a later factor keeps its split up to the first mesh axis already
    claimed.  Both operands are then brought to the factors' splits: a kept split lost is gathered, a mesh axis that
    moves to an axis of the operand is an all-to-all (measured on one-op programs, ``.compile().as_text()``:
    x[8, 8, 8@a] . y[8@a, 8, 8] (batch 0, contracting 1/1) keeps x's free split and all-gathers y; with
    y[8@a, 8, 64] XLA all-to-alls x to the batch split; x[16@(a,b), 8] . y[8, 64@a] gathers x whole;
    x[8@b, 8, 16@a] . y[8@a, 8, 8@b] gives [8, 16@a, 8@b], both gathered on the batch axis).  Contracted axes take
    no part here: a contracted split never wins against a free one (x[8@a, 16, 8] . y[16@a, 8, 24] gathers the
    larger y), as the analyzer prices it; where a kept factor claims one's mesh axis, the contracted split is cut
    before it.  ``typed``: the result's split as its type names it (Explicit axes): JAX's type, not the
    propagation, decides the result's factors (the gradient's g[8, 8@a, 24] . y[16@a, 8, 24] typed [8, 8@a, 16]
    gathers y, as the forward did, not g).  ``asked``: the split the caller asks of the value the result becomes
    (:func:`asked_of_result`: a weight gradient's ``out_shardings``), which XLA's propagation brings back to the
    dot before it settles the clash: a result factor it splits the way one operand does keeps that split, whatever
    the sizes (measured: attn[b, s, h@model, k] . g[b, s, d@model] -> [h, k, d], the same size, asked [h@model]
    gathers g, asked [d@model] gathers attn; (16, 32@model) . (16, 64@model) over the rows asked [32@model, 64]
    gathers the larger operand)."""
    if is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return None
    lf, rf = _factors(dn, len(lhs.dims), len(rhs.dims))
    where_l = {m: a for a, d in enumerate(lhs.dims) for m in d}
    where_r = {m: a for a, d in enumerate(rhs.dims) for m in d}
    kept = ("batch", "lhs", "rhs")
    clash = any(
        lf[where_l[m]] != rf[where_r[m]] and lf[where_l[m]][0] in kept and rf[where_r[m]][0] in kept
        for m in set(where_l) & set(where_r)
    )
    if not clash and (typed is None or _typed_as_operands(lhs, rhs, dn, typed)):
        # (a type the operands already give the result leaves the dot to the rules below: a contraction one
        # operand splits over the mesh axes the other's free axis takes is XLA's idle-axes route, not a gather)
        return None
    operands = ((lhs, lf), (rhs, rf))
    proposed: dict[tuple[str, int], list[tuple[str, ...]]] = {}
    for lay, factors in operands:
        for d, f in zip(lay.dims, factors):
            proposed.setdefault(f, []).append(d)
    order = sorted(range(2), key=lambda k: -math.prod(operands[k][0].shape))  # (stable: the left first on ties)
    final: dict[tuple[str, int], tuple[str, ...]] = {}
    claimed: set[str] = set()
    # The result's factors in its order: batch, the left's free axes, the right's.
    result = [("batch", k) for k in range(len(dn[1][0]))]
    result += [f for f in lf if f[0] == "lhs"] + [f for f in rf if f[0] == "rhs"]
    if typed is not None:
        for f, d in zip(result, typed):
            final[f] = tuple(d)
            claimed |= set(d)
    elif asked is not None:
        # Only a split one operand proposes for that factor (the ask chooses between the clashing operands; a
        # split neither has, or a whole factor, is left to the propagation's own order).
        for f, d in zip(result, asked):
            if d and tuple(d) in {tuple(p) for p in proposed.get(f, ())} and not set(d) & claimed:
                final[f] = tuple(d)
                claimed |= set(d)
    for k in order:
        lay, factors = operands[k]
        own = [a for a, f in enumerate(factors) if f[0] in kept and lay.dims[a]]
        brought = [a for a, f in enumerate(factors) if f[0] in kept and not lay.dims[a]]
        for a in own + brought:
            f = factors[a]
            if f in final:
                continue
            split = merged_split(proposed[f])
            mine = {m for b, d in enumerate(lay.dims) if b != a and factors[b][0] in kept for m in d}
            cut = next((i for i, m in enumerate(split) if m in claimed or m in mine), len(split))
            final[f] = split[:cut]
            claimed |= set(final[f])
    # Under a type alone (no clash), a contraction both operands split alike stays split: each device sums its partial product
    # and the sum lands on the type's split (a reduce-scatter: an FSDP weight's gradient typed like the weight,
    # x[B@data, d] . g[B@data, f] -> [d@data, f]); a free factor the type splits over those mesh axes takes its
    # split from the sum, not from the operands.
    summed = _shared_contractions(lhs, rhs, dn) if typed is not None and not clash else {}
    held = {m for d in summed.values() for m in d}
    out: list[Layout] = []
    for lay, factors in operands:
        dims = []
        for a, (d, f) in enumerate(zip(lay.dims, factors)):
            if f in summed:
                want = d
            elif f in final:
                want = final[f][: next((i for i, m in enumerate(final[f]) if m in held), len(final[f]))]
            else:  # a contracted axis: its split up to the first mesh axis a kept factor claims
                want = d[: next((i for i, m in enumerate(d) if m in claimed), len(d))]
            if lay.shape[a] % math.prod(sizes[m] for m in want):
                want = ()
            dims.append(want)
        out.append(lay.with_dims(tuple(dims)))
    return out[0], out[1]


def _result_type(eqn: Any) -> list[tuple[str, ...]] | None:
    """The dot's result split as its type names it on Explicit axes (:func:`.rules_structural.typed_dims`), a
    type that names no split included where an operand's type names one (x[16@(a,b), 32] . y typed P(None, None)
    gathers x); None where the types say nothing (Auto axes, or a program traced on unplaced arguments, every
    type whole: the planner's, whose candidate layouts are not the types)."""
    aval = eqn.outvars[0].aval
    typed = typed_dims(aval)
    if typed is not None or not all_explicit(aval) or getattr(getattr(aval, "sharding", None), "spec", None) is None:
        return typed
    operand_typed = any(explicit_dims(v.aval) for v in eqn.invars[:2] if hasattr(v, "aval") and not hasattr(v, "val"))
    return [()] * len(aval.shape) if operand_typed else None


def _typed_as_operands(lhs: Layout, rhs: Layout, dn: Any, typed: Sequence[tuple[str, ...]]) -> bool:
    """Whether each of the result's factors is split as its type says by the operands that carry it (a batch
    factor by both)."""
    (lc, rc), (lb, rb) = dn
    result: list[tuple[tuple[str, ...], ...]] = [(lhs.dims[i], rhs.dims[j]) for i, j in zip(lb, rb)]
    result += [(lhs.dims[i],) for i in range(len(lhs.dims)) if i not in lc and i not in lb]
    result += [(rhs.dims[j],) for j in range(len(rhs.dims)) if j not in rc and j not in rb]
    return len(result) == len(typed) and all(all(tuple(d) == tuple(t) for d in ds) for ds, t in zip(result, typed))


def _shared_contractions(lhs: Layout, rhs: Layout, dn: Any) -> dict[tuple[str, int], tuple[str, ...]]:
    """The contracted factors both operands split alike (the same mesh axes, in order), with that split."""
    (lc, rc), _ = dn
    return {
        ("contract", k): tuple(lhs.dims[i])
        for k, (i, j) in enumerate(zip(lc, rc))
        if lhs.dims[i] and lhs.dims[i] == rhs.dims[j]
    }


def _settle_passthrough_conflict(
    w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str
) -> tuple[list[Layout], list[int]]:
    """The operands after XLA settles a clash of two result factors over one mesh axis (:func:`passthrough_conflict`):
    each brought to its new layout, charged here; and which operands moved."""
    typed = _result_type(eqn)
    dn, sizes = eqn.params["dimension_numbers"], w.costs.mesh_sizes
    found = passthrough_conflict(ins[0], ins[1], dn, sizes, typed)
    if found is None:
        return ins, []
    # On Explicit axes the result's type settles the operands even where they do not clash: an operand split on
    # a factor the type leaves whole (or claims for another factor) is brought to it, directly (measured on
    # one-op programs: x[16@(a,b), 32] . y[8, 32] typed [16, 8] gathers x over (a, b); x[16, 32] . y[32@b, 8]
    # typed [16@b, 8] on (4, 2) gathers y over b, not through the idle 'a' as a clash of two operands is).
    clash = typed is None or passthrough_conflict(ins[0], ins[1], dn, sizes) is not None
    if typed is None:
        # Looked for on a clash only: the look-ahead reads the program past this dot (a stretch of layers the
        # segment memo records reads nothing after itself where no dot clashes: tests/test_segments.py).
        asked = asked_of_result(w, eqn.outvars[0])
        if asked is None:
            # No output or placement asks: an elementwise reader's partner split from a layout the user fixed (an
            # optimizer's moment read with the weight gradient) reaches the result first in Shardy's
            # elementwise-first pass, and chooses between the clashing operands as an ask does (measured: g[b, s, d@model] . y[b, s, h@model, k] ->
            # [d, h, k], transposed and read with v[h@model, k, d], gathers g, not y: test_dot_clash_readers).
            asked = _elementwise_reader_split(w, eqn.outvars[0], seeded=True)
        if asked is not None:
            found = passthrough_conflict(ins[0], ins[1], dn, sizes, None, asked) or found
    out = list(ins)
    moved = []
    why = (
        "dot operands split one mesh axis on two result factors" if clash else "dot operand brought to its typed result"
    )
    for k, lay in enumerate(found):
        if lay.dims == ins[k].dims:
            continue
        dtype = eqn.invars[k].aval.dtype
        steps = [replace(c, tensor=f"operand {k + 1}") for c in w.costs.reshard(ins[k], lay, dtype)]
        # A gather another dot already made of this value (the forward's, reused by the backward): XLA's CSE.
        reused = [c for c in steps if w.already_moved(ins, c)]
        if not steps or len(reused) < len(steps):
            via = gather_route(sizes, ins[k], lay, (found[1 - k],)) if clash else None
            if via is None:
                at = len(w.ops)
                w.change(eqn, phase, ins[k], lay, dtype, repeat, why)
                if not clash:
                    # Brought to its type from a split on another dimension over a group of another size: XLA
                    # may gather it whole first (measured on (4, 2): y[32@b, 8] for x[16, 32] . y typed
                    # [16@b, 8@a] is gathered whole, 1024 B, where explain slices first and gathers 256 B).
                    mark_swap(w, at, ins[k], lay.dims, dtype)
            else:
                # Through the idle mesh axes (idle_axes.gather_route): the permute is a move of the value that
                # another dot's contraction may have made already (CSE), the gather over them this dot's.
                w.change(eqn, phase, ins[k], via, dtype, repeat, f"{why}, re-split onto idle mesh axes")
                w.change(eqn, phase, via, lay, dtype, repeat, f"{why}, gathered over the idle mesh axes")
                w.bind_copy(eqn.invars[k], lay)  # (peak: the whole copy the dot reads, as a direct gather's)
                w.bind_dot_copy(eqn, k, lay)
            moved.append(k)
        out[k] = lay
    return out, moved


def contraction_conflict(lhs: Layout, rhs: Layout, dn: Any) -> tuple[int, Layout] | None:
    """Where both operands split contracted axes over the same mesh axes M but pair them differently (attention's
    output projection under tensor parallelism: o[b, s, h@model, k] . wo[h, k@model, d], the heads split on one
    side, the head width on the other): which operand XLA moves (0 lhs, 1 rhs) and the layout it moves it to;
    None where there is no such clash.

    XLA's partitioner (its base case for operands that partition their contracting dimensions alike, reached
    once the operands' other splits are grouped away) reshards the smaller operand to the larger's contracted
    split, its tie the right one, and all-reduces the partial products over M: one all-to-all of the smaller
    operand's shard, never a gather of either.  Measured on one-op programs (jax 0.10.2's XLA:CPU, Auto and
    Explicit alike, whether the moved operand is an argument or computed: the clash is settled at the dot):
    o[8, 8, 4@model, 8] . wo[4, 8@model, 32] all-to-alls wo (2048 B) and all-reduces the (8, 8, 32) product;
    o[2, 2, 4@model, 8] all-to-alls o; with o's batch over 'data' (o[8@data, 8, 4@model, 8]) o's shard is the
    smaller (1024 B against wo's 2048 B) and o is moved, though the whole o is the larger: the sizes compared
    are the shards (XLA compares the operands within a group of the devices their other splits share).  M must
    be used nowhere else by either operand (a free or batch axis over M is a clash of another kind), and no other
    contracted pair split alike: with one (x[8, 4@data, 8@model, 8] . y[4@data, 8, 8@model, 32] on (2, 4)) XLA
    all-reduces the product once over both mesh axes, where explain sums one contracted axis at a time
    (:func:`per_contracted_axis`); that clash is left to the analyzer's choice, marked approximate."""
    if is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return None
    (lc, rc), _ = dn
    differ = [(i, j) for i, j in zip(lc, rc) if tuple(lhs.dims[i]) != tuple(rhs.dims[j])]
    held = ({m for i, _ in differ for m in lhs.dims[i]}, {m for _, j in differ for m in rhs.dims[j]})
    shared = [(i, j) for i, j in zip(lc, rc) if lhs.dims[i] and (i, j) not in differ]  # a pair split alike
    if not differ or not held[0] or held[0] != held[1] or shared:
        return None
    paired = (set(lc), set(rc))
    for k, lay in enumerate((lhs, rhs)):
        if any(set(d) & held[0] for a, d in enumerate(lay.dims) if a not in paired[k]):
            return None
    shard = [math.prod(lay.shard_shape) for lay in (lhs, rhs)]
    moved = 0 if shard[0] < shard[1] else 1
    dims = list((lhs, rhs)[moved].dims)
    for i, j in differ:
        if moved == 0:
            dims[i] = rhs.dims[j]
        else:
            dims[j] = lhs.dims[i]
    return moved, (lhs, rhs)[moved].with_dims(tuple(dims))


def _settle_contraction_conflict(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """The operands after XLA settles a clash of contracted splits over one mesh axis (:func:`contraction_conflict`):
    the smaller moved to the larger's contracted split (an all-to-all), charged here."""
    found = contraction_conflict(ins[0], ins[1], eqn.params["dimension_numbers"])
    if found is None:
        return ins
    k, lay = found
    why = "dot operands split one mesh axis on different contracted axes"
    w.change(eqn, phase, ins[k], lay, eqn.invars[k].aval.dtype, repeat, why)
    out = list(ins)
    out[k] = lay
    return out


def free_contracted_clash(lhs: Layout, rhs: Layout, dn: Any) -> frozenset[str]:
    """Mesh axes one operand splits along a free axis and the other along a contracted axis (the weight gradient's
    x^T . dz under FSDP: dz[b, s, f@data], x[b@data, s, d]): the dot cannot keep both splits."""
    lf, rf = _factors(dn, len(lhs.dims), len(rhs.dims))
    found: set[str] = set()
    for (one, of), (other, otf) in (((lhs, lf), (rhs, rf)), ((rhs, rf), (lhs, lf))):
        free = {m for d, f in zip(one.dims, of) if f[0] in ("lhs", "rhs") for m in d}
        contracted = {m for d, f in zip(other.dims, otf) if f[0] == "contract" for m in d}
        found |= free & contracted
    return frozenset(found)


def asked_split_operands(
    lhs: Layout, rhs: Layout, dn: Any, sizes: dict[str, int], asked: Sequence[tuple[str, ...]]
) -> tuple[Layout, Layout] | None:
    """The operands XLA brings a dot's operands to where the split asked of its result (:func:`asked_of_result`)
    names a free axis of one operand with a mesh axis that operand splits a contracted axis over, while the other
    operand splits its own free axis over it; None where no asked split is so placed.

    XLA's propagation gives the dot's result the asked split first (it is carried back from the output through
    pass-through ops before the dot is settled), and the partitioner then computes the dot at that split: the
    operand owning the asked free axis has its contracted split moved onto it (one all-to-all), the other
    operand's clashing free split is gathered, and the result needs no sum and no move after.  Measured on
    x[8@data, 8, 32] . dz[8, 8, 128@data] contracting (b, s) asked [32@data, 128] (an FSDP weight's gradient):
    all-gather of dz (32768 B), all-to-all of x (2048 B), no reduce-scatter and no move of the gradient
    (tests/test_fsdp_gradient_rules.py), whatever the sizes (gathering x and moving the gradient after would be
    fewer bytes: the choice is the propagation's, not a cost)."""
    ops = [lhs, rhs]
    lf, rf = _factors(dn, len(lhs.dims), len(rhs.dims))
    factors = (lf, rf)
    result = [("batch", k) for k in range(len(dn[1][0]))]
    result += [f for f in lf if f[0] == "lhs"] + [f for f in rf if f[0] == "rhs"]
    if len(asked) != len(result):
        return None
    dims = [list(lhs.dims), list(rhs.dims)]
    for f, want in zip(result, asked):
        if not want or f[0] not in ("lhs", "rhs"):
            continue
        k = 0 if f[0] == "lhs" else 1
        axis = factors[k].index(f)
        if dims[k][axis]:
            continue  # already split: nothing for the ask to bring
        # The owner's contracted axis split exactly as asked, and the partner's free axis holding those mesh axes.
        contracted = [a for a, g in enumerate(factors[k]) if g[0] == "contract" and tuple(dims[k][a]) == tuple(want)]
        partner = [
            a for a, g in enumerate(factors[1 - k]) if g[0] in ("lhs", "rhs") and set(want) <= set(dims[1 - k][a])
        ]
        if len(contracted) != 1 or len(partner) != 1:
            continue
        if ops[k].shape[axis] % math.prod(sizes[m] for m in want):
            continue
        dims[k][contracted[0]] = ()
        dims[k][axis] = tuple(want)
        p = partner[0]
        dims[1 - k][p] = tuple(m for m in dims[1 - k][p] if m not in want)
    if tuple(dims[0]) == lhs.dims and tuple(dims[1]) == rhs.dims:
        return None
    return lhs.with_dims(tuple(dims[0])), rhs.with_dims(tuple(dims[1]))


# How many pass-through readers deep a dot's result is searched for a split partner (a bias add, then the residual).
ELEMENTWISE_READER_STEPS = 4
# Ops Shardy's op-priority propagation carries a sharding through in its first pass (element-wise: every factor
# passes through), before dots, reductions and gathers are propagated.
PASS_THROUGH = frozenset(ELEMENTWISE | CARRIERS | {"add_any"})
# id(jaxpr) -> (the jaxpr, held so its ids stay its values', the ids of its values that first pass reaches)
_SETTLED: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, frozenset[int]]]] = weakref.WeakKeyDictionary()
# id(jaxpr), whether its arguments are the program's -> (the jaxpr, the ids of its values seeded_in reaches)
_SEEDED: weakref.WeakKeyDictionary[Any, dict[tuple[int, bool], tuple[Any, frozenset[int]]]] = (
    weakref.WeakKeyDictionary()
)


def settled_by_elementwise(w: Walker, var: Any) -> bool:
    """Whether Shardy's elementwise-first pass gives ``var`` its split: it is an argument of its jaxpr or a placement's
    result (a sharding constraint: an Explicit program's reshard, an ``auto_axes`` region's entry), or made by
    pass-through ops (:data:`PASS_THROUGH`) from at least one such value.  A value a dot, a reduction, a broadcast
    or a gather makes is unsharded then (those are propagated after), and hands nothing to a dot's result in that
    pass (measured: the gelu derivative's factors, made from the up projection's result, leave the down
    projection's input gradient to its own operands; x_hat, made from the residual stream, does not)."""
    home = home_of(w.costs, var)
    if home is None:
        return not hasattr(var, "val")  # an argument (a loop body's carry too: it enters split); not a literal
    table = _SETTLED.setdefault(w.costs, {})
    hit = table.get(id(home.jaxpr))
    if hit is None or hit[0] is not home.jaxpr:
        hit = table[id(home.jaxpr)] = (home.jaxpr, settled_in(home.jaxpr))
    return id(var) in hit[1]


def settled_in(jaxpr: Any) -> frozenset[int]:
    """The ids of the values of ``jaxpr``'s equations that Shardy's elementwise-first pass splits
    (:func:`settled_by_elementwise`; its arguments and constants are too, and are not listed): a pure function of
    the jaxpr's structure, so the segment memo keys a copy's entering values by it (:func:`.segment_memo.plan_segments`)."""
    made = {id(o) for eqn in jaxpr.eqns for o in eqn.outvars}
    reached: set[int] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in PLACEMENTS or (
            eqn.primitive.name in PASS_THROUGH
            and any(not hasattr(x, "val") and (id(x) not in made or id(x) in reached) for x in eqn.invars)
        ):
            reached.update(id(o) for o in eqn.outvars)
    return frozenset(reached)


def _elementwise_reader_split(w: Walker, var: Any, seeded: bool = False) -> tuple[tuple[str, ...], ...] | None:
    """The split a dot's result takes from its elementwise readers' other operands, in ``var``'s axis order, or None.

    XLA's propagation (Shardy's op priority) settles elementwise ops before dots: an elementwise reader whose other
    operand of the result's shape is split, and split in that first pass (:func:`settled_by_elementwise`), hands
    that split to the dot's result (through a transpose or conversion that only carries it) before the dot's own
    operands settle it.  Measured on minimal programs (tests/test_fsdp_gradient_rules.py,
    tests/test_external_repros.py):

    - a gradient sum with the residual stream's cotangent: the input gradient dz . a^T of an FSDP MLP
      x + tanh(x @ a) @ b lands on the cotangent's batch split, dz all-to-all'd to it (8192 B), not gathered;
    - a layer norm's backward, which reads the input gradient dy twice (dy * x_hat for the scale's gradient, and
      dy * scale): x_hat's batch split reaches the dot, where explain moved the result and the norm's chain after;
    - the forward's residual add x + down(gelu(up(x))): x's batch split reaches the down projection, its FSDP
      weight gathered and the gelu output all-to-all'd from its f split, where explain gathered the gelu output.

    Readers whose partners are split differently leave it to the dot (None): which XLA's propagation takes first
    is its order, not a rule explain reproduces.  ``seeded``: only a partner whose split the pass carries from a
    layout the user fixed (:func:`_seeded_dims`), walked yet or not."""
    # Breadth-first over the pass-through readers (axes mapped through transposes), a few steps deep: the first
    # pass reaches the dot from wherever a split partner meets the chain (the residual add after the bias add).
    frontier: list[tuple[Any, tuple[int, ...]]] = [(var, tuple(range(len(getattr(var.aval, "shape", ())))))]
    found: set[tuple[tuple[str, ...], ...]] = set()
    for _ in range(ELEMENTWISE_READER_STEPS):
        ahead: list[tuple[Any, tuple[int, ...]]] = []
        for v, axis_of in frontier:  # axis_of[i]: var's axis that is v's i
            shape = getattr(v.aval, "shape", None)
            for user, k in w.uses.get(id(v), []):
                name, out = user.primitive.name, user.outvars[0]
                if name == "transpose":
                    ahead.append((out, _transposed(user, axis_of)))
                    continue
                if name not in PASS_THROUGH or getattr(out.aval, "shape", None) != shape:
                    continue
                split: tuple[tuple[str, ...], ...] = ()
                for j, other in enumerate(user.invars):
                    # Whether ``other`` is settled is a fact of the program's structure: the segment memo keys a
                    # copy by it where ``other`` enters the copy or is read past it (segment_memo.plan_segments).
                    if j != k and not hasattr(other, "val") and settled_by_elementwise(w, other):
                        if seeded:
                            theirs = _seeded_dims(w, other, shape) or ()
                        else:
                            theirs = _partner_split(w, user, k, v, only=j)
                        split = theirs if any(theirs) else split
                if any(split):
                    dims: list[tuple[str, ...]] = [() for _ in range(len(getattr(var.aval, "shape", ())))]
                    for i, d in enumerate(split):
                        dims[axis_of[i]] = tuple(d)
                    found.add(tuple(dims))
                else:
                    ahead.append((out, axis_of))
        frontier = ahead
        if found or not frontier:
            break
    return found.pop() if len(found) == 1 else None


def _seeded_dims(
    w: Walker, var: Any, shape: Any, steps: int = 2 * ELEMENTWISE_READER_STEPS
) -> tuple[tuple[str, ...], ...] | None:
    """The split Shardy's elementwise-first pass carries to ``var`` (of ``shape``) from a layout the user fixed (a
    program argument, a placement: :func:`seeded_in`), or None.  A value walked already has it as its layout (the
    walk lays pass-through ops out as that pass does); one not walked yet is followed back through the
    pass-through equations that make it (same-shaped operands that pass settles: Adafactor's
    ``0.9 * v + 0.1 * g * g`` takes the moment v's split): the optimizer's update comes after every gradient, yet
    its moments' splits reach the gradients' dots first.  A loop body's arguments are not seeds (their splits are
    the loop's propagation's: a backward scan's residual read with its input gradient hands the dot nothing,
    tests/test_fsdp_gradient_rules.py).

    Stopping at a walked value keeps the look-back inside what the segment memo keys: a layer's residual stream
    entering it is read there (its layout is in the copy's key, its being seeded in the copy's structure), never
    followed back through the layers before it (tests/test_block_memo.py)."""
    lay = w.env.get(var)
    if lay is not None:
        seeded = is_seeded(w, var)
        if not seeded or is_free(lay) or lay.unreduced or tuple(lay.shape) != tuple(shape):
            return None
        return lay.dims
    home = home_of(w.costs, var)
    if home is None or steps <= 0:
        return None
    eqn = home.jaxpr.eqns[home.position[id(var)]]
    if eqn.primitive.name not in PASS_THROUGH or eqn.primitive.name == "transpose":
        return None  # (a transpose moves the split: not followed; an unwalked placement's layout is not known yet)
    _looked_back_past_copy(w, var)
    for x in eqn.invars:
        if hasattr(x, "val") or getattr(x.aval, "shape", None) != shape or not settled_by_elementwise(w, x):
            continue
        dims = _seeded_dims(w, x, shape, steps - 1)
        if dims is not None and any(dims):
            return dims
    return None


def _looked_back_past_copy(w: Walker, var: Any) -> None:
    """Leave the copy the segment memo records where the look-back follows a value the program makes after it: how
    that value is made is the program's structure past the copy, which its key does not hold."""
    rec = getattr(w.uses, "rec", None)
    if isinstance(rec, Recorder) and not rec.why and rec.made_at.get(id(var), -1) >= rec.copy.stop:
        rec.leave("the look-back of a dot's elementwise reader past the copy")


def is_seeded(w: Walker, var: Any) -> bool:
    """Whether Shardy's elementwise-first pass carries a split the user fixed to ``var``: a program argument or a
    placement's result (``w.pinned``), or made by pass-through ops from a same-shaped such value
    (:func:`seeded_in`): a fact of the program's structure."""
    if id(var) in w.pinned:
        return True
    home = home_of(w.costs, var)
    if home is None:
        return False  # a loop body's argument (its split is the loop's propagation's), or a literal
    table = _SEEDED.setdefault(w.costs, {})
    top = bool(home.jaxpr.invars) and id(home.jaxpr.invars[0]) in w.pinned
    hit = table.get((id(home.jaxpr), top))
    if hit is None or hit[0] is not home.jaxpr:
        hit = table[(id(home.jaxpr), top)] = (home.jaxpr, seeded_in(home.jaxpr, top))
    return id(var) in hit[1]


def seeded_in(jaxpr: Any, arguments: bool) -> frozenset[int]:
    """The ids of the values of ``jaxpr``'s equations that Shardy's elementwise-first pass splits from a layout the
    user fixed: placements' results, and the results of pass-through ops (a transpose, which moves the split,
    aside) with a same-shaped operand that is one or (``arguments``: the program's own jaxpr) an argument.  A pure
    function of the jaxpr, so the segment memo keys a copy's entering values by it (:func:`.segment_memo.plan_segments`)."""
    made = {id(o) for eqn in jaxpr.eqns for o in eqn.outvars}
    reached: set[int] = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in PLACEMENTS:
            reached.update(id(o) for o in eqn.outvars)
            continue
        if name not in PASS_THROUGH or name == "transpose":
            continue
        for o in eqn.outvars:
            shape = getattr(o.aval, "shape", None)
            if any(
                not hasattr(x, "val")
                and getattr(x.aval, "shape", None) == shape
                and (id(x) in reached or (arguments and id(x) not in made))
                for x in eqn.invars
            ):
                reached.add(id(o))
    return frozenset(reached)


def _at_asked_split(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """The operands brought to the split asked of the dot's result where a free split clashes with a contracted
    one (:func:`asked_split_operands`), each move charged here (once per value and target: the gathered cotangent
    is shared with the input-gradient dot reading it, XLA's CSE).  On Explicit axes the result's type decides."""
    lhs, rhs = ins
    if typed_dims(eqn.outvars[0].aval) is not None or is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return ins
    dn = eqn.params["dimension_numbers"]
    if not free_contracted_clash(lhs, rhs, dn):
        return ins  # (looked past the dot only on such a clash: the segment memo's stretches read nothing after)
    asked = asked_of_result(w, eqn.outvars[0])
    if asked is None:
        asked = _elementwise_reader_split(w, eqn.outvars[0])
    if asked is None:
        # A reader's partner not walked yet whose split the elementwise-first pass carries from a layout the user
        # fixed: an optimizer's moment (0.9 * mu + 0.1 * g) asks the weight gradient for mu's split before the dot
        # settles, as at a clash of two result factors (_settle_passthrough_conflict).
        asked = _elementwise_reader_split(w, eqn.outvars[0], seeded=True)
    if asked is None:
        return ins
    found = asked_split_operands(lhs, rhs, dn, w.costs.mesh_sizes, asked)
    if found is None:
        return ins
    why = "dot operands brought to the split asked of its result"
    for k, lay in enumerate(found):
        w.change(eqn, phase, ins[k], lay, eqn.invars[k].aval.dtype, repeat, why)
    return list(found)


def asked_of_result(w: Walker, var: Any) -> tuple[tuple[str, ...], ...] | None:
    """The split the caller asks of what ``var`` becomes, in ``var``'s own axis order, or None.

    Followed, as XLA's sharding propagation brings an output's sharding back, through the single reader of each
    value that only carries it (a transpose, its axes mapped back; a dtype conversion; a copy), a gradient sum of
    the same shape, a piece placed into a stacked whole (:func:`requested_dims`), to a program output the caller
    lays out (``report(out_specs=)``: a weight gradient's ``out_shardings``) or a placement (an ``auto_axes``
    region's exit, an Explicit program's reshard)."""
    return _asked(w, var, True)


def _adds_unit_axes(eqn: Any, v: Any) -> bool:
    """Whether a ``broadcast_in_dim`` of ``v`` only adds axes of size 1 (an expand-dims: the value repeated
    nowhere)."""
    at = tuple(eqn.params["broadcast_dimensions"])
    shape, out = tuple(v.aval.shape), tuple(eqn.outvars[0].aval.shape)
    return all(int(out[d]) == int(n) for d, n in zip(at, shape)) and all(
        int(out[d]) == 1 for d in range(len(out)) if d not in at
    )


# Why a dot whose contraction clash is settled and whose product then moves is approximate (the report says so).
CONFLICT_SUM_NOTE = (
    "operands split one mesh axis on different contracted axes, the product then brought to its consumer's split: "
    "XLA all-reduces one slice and permutes it, or all-reduces the whole product and slices it"
)
# Why a dot whose contraction only one operand splits is approximate (the report's first line names it).
LONE_CONTRACTION_NOTE = (
    "one operand splits a contracted axis over mesh axes the other does not use, or uses on another contracted "
    "axis: XLA either gathers it, or slices or all-to-alls the other to its split and all-reduces the product, by "
    "a heuristic of its own (group sizes, idle mesh axes)"
)


def one_sided_contraction(lhs: Layout, rhs: Layout, dn: Any) -> tuple[int, ...]:
    """The operands (0: lhs, 1: rhs) that split a contracted axis over mesh axes M where their partner does not
    split the paired axis over M alike, and uses M nowhere else or only on contracted axes.

    (A partner using M on a free or batch axis -- FSDP's ``b@data d, d@data f`` -- is XLA's usual gather, not
    marked.)  Both operands split over one mesh axis on different contracted pairs (``a@x b, b@x a c``): XLA
    all-to-alls one to the other's split and all-reduces the product (measured on (8, 8) x (8, 8, 8)); the dot
    rule settles that clash before it asks this (:func:`contraction_conflict`).

    XLA's partitioner then has two ways, and its choice does not follow the bytes or time explain prices
    (measured on one-op programs: ``(8, 64) @ (64, 8)`` with the contraction split 8 ways all-reduces the
    product, split 4 ways over one axis of a (4, 2) mesh it gathers the operand, split over both it all-reduces;
    the analyzer, by its α–β time, gathers all three): gather the split operand (the analyzer's usual answer),
    or slice the whole one locally and all-reduce the partial products.
    """
    if is_free(lhs) or is_free(rhs):
        return ()
    (lc, rc), _ = dn
    contracted = (set(lc), set(rc))
    # Mesh axes each operand uses on its free and batch axes (a partner's use there decides XLA's way).
    elsewhere = tuple(
        {m for a, d in enumerate(lay.dims) if a not in contracted[k] for m in d} for k, lay in enumerate((lhs, rhs))
    )
    out: list[int] = []
    for i, j in zip(lc, rc):
        for k, split, paired in ((0, lhs.dims[i], rhs.dims[j]), (1, rhs.dims[j], lhs.dims[i])):
            # (split over other mesh axes than the paired axis, wholly or in part: x[d@b] . y[d@(a, b)])
            if split and tuple(split) != tuple(paired) and not set(split) & elsewhere[1 - k] and k not in out:
                out.append(k)
    return tuple(out)


def _lone_contraction_bound(w: Walker, eqn: Any, lone: tuple[int, ...], colls: tuple[Any, ...]) -> Any:
    """XLA's other way drops explain's collectives and moves at most the split operands whole (gathered or
    all-to-all'd) and the result whole (all-reduced, once per contracted axis): per operand and for the result,
    a collective either way."""
    from .report import OpBound

    dtype = eqn.outvars[0].aval.dtype
    dname, size = dtype_info(dtype)
    wire = wire_itemsize(dname, size, w.costs.profile.narrow_floats)
    whole = sum(math.prod(int(s) for s in eqn.invars[k].aval.shape) for k in lone)
    whole += math.prod(int(s) for s in eqn.outvars[0].aval.shape)
    (lc, _), _ = eqn.params["dimension_numbers"]
    own = sum(c.array_bytes for c in colls)
    # (peak: explain's gathered buffers, which XLA's other way does not hold, or XLA's whole ones)
    return OpBound(len(colls) + len(lone) + len(lc) + 1, float(own + whole * wire), float(own + whole * wire))


def operand_index(c: Any) -> int:
    """The operand (0: lhs, 1: rhs) a collective named ``operand k`` moves."""
    return int(c.tensor.split()[1]) - 1


def _names_operand(c: Any) -> bool:
    tensor = getattr(c, "tensor", "")
    return tensor.startswith("operand ") and tensor.split()[1].isdigit()


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

    The search (:func:`_walk_consumers`) is precomputed once per value (:func:`_consumer_reach`: its course is the
    program's structure but where an already laid-out operand can stop it or decide it), so each costing tests only
    those points (:func:`_search_reach`), whatever the program's depth; the answer is the walk's.
    """
    reach = reach_of(w.costs, var)
    if reach is None or len(out.dims) != len(reach.steps[0][1]):
        counts_of(w.costs).walked += 1
        return _walk_consumers(w, var, out, sums)
    return _search_reach(w, reach, out, sums)


def reach_of(costs: Any, var: Any) -> Reach | None:
    """``var``'s precomputed look-ahead (:func:`_consumer_reach`), built once per traced program (None: walked)."""
    cache = reach_cache(costs)
    reach = cache.get(id(var), _UNSEEN)
    if reach is _UNSEEN or (reach is not None and reach.var is not var):
        home = home_of(costs, var)
        reach = cache[id(var)] = _consumer_reach(home, var) if home is not None else None
    return reach


_UNSEEN: Any = object()


def _lands(
    splits: Sequence[tuple[str, ...]],
    axis_of: tuple[int, ...],
    out: Layout,
    sums: frozenset[str],
    used: set[str],
    sizes: dict[str, int],
) -> list[tuple[str, ...]] | None:
    """The sum's split where a consumer asks axis ``i`` of the value split over ``splits[i]``: the first split
    over summed mesh axes, free in the sum, that divides the sum's axis it maps onto (None: none)."""
    for i, split in enumerate(splits):
        axis = axis_of[i] if i < len(axis_of) else -1
        if axis < 0 or not split or not set(split) <= sums or set(split) & used:
            continue
        if out.shape[axis] % math.prod(sizes[m] for m in split) == 0:
            return [split if a == axis else d for a, d in enumerate(out.dims)]
    return None


def _lands_at_dot(
    eqn: Any,
    k: int,
    partner: Layout,
    axis_of: tuple[int, ...],
    out: Layout,
    sums: frozenset[str],
    used: set[str],
    sizes: dict[str, int],
) -> list[tuple[str, ...]] | None:
    """The sum's split where a consumer dot pairs an axis of the value (operand ``k``) with one of a laid-out
    ``partner``: an axis it contracts, or else a batch axis (XLA's propagation carries a batch axis's split from one
    operand to the other as it does a contracted one's: attention's backward, whose output projection's input
    gradient is summed to the heads' split of ``v``, measured on keras-hub's Falcon, BLOOM, GPT-NeoX, DeBERTa,
    RoFormer and ESM-2 under tensor parallelism)."""
    mine, theirs = paired_axes(eqn, k)
    for i, j in zip(mine, theirs):
        split = partner.dims[j]
        axis = axis_of[i]
        if axis < 0 or not split or not set(split) <= sums or set(split) & used:
            continue
        if out.shape[axis] % math.prod(sizes[m] for m in split) == 0:
            return [split if a == axis else d for a, d in enumerate(out.dims)]
    return None


def _walk_consumers(w: Walker, var: Any, out: Layout, sums: frozenset[str]) -> list[tuple[str, ...]] | None:
    """:func:`consumer_split`'s search, walked: breadth-first through the consumers of ``var`` (each path
    followed, as XLA's propagation reaches a value from each side).  The definition :func:`_consumer_reach` and
    :func:`_search_reach` compute in two halves (tests/test_lookahead.py checks that they agree)."""
    sizes = w.costs.mesh_sizes
    used = {m for d in out.dims for m in d}
    frontier: list[tuple[Any, tuple[int, ...]]] = [(var, tuple(range(len(out.dims))))]
    summed_with: set[int] = set()  # values reached through a gradient sum
    while frontier:
        v, axis_of = frontier.pop(0)  # axis_of[i]: the dot result's axis that is v's axis i
        asked = w.requested.get(id(v)) if id(v) in summed_with else None
        if asked is not None:
            # A program output the caller asks split, reached through a gradient sum (a tied embedding's
            # gradient: the head's dot plus the lookups' scatter-adds): the dot's sum lands split there, a
            # reduce-scatter.  (A dot whose own result leaves the program stays pending: dot_general.)
            found = _lands(asked, axis_of, out, sums, used, sizes)
            if found is not None:
                return found
        for eqn, k in w.uses.get(id(v), ()):
            name = eqn.primitive.name
            if name in ELEMENTWISE_PARTNERED:
                # An elementwise consumer whose other full-size operand splits an axis over the summed mesh
                # axes (a residual add after an expert sum or a row-parallel dot): the sum lands split like it,
                # a reduce-scatter (measured: x[t@data] + sum(a[e@data], 0) is one reduce-scatter in XLA).
                found = _lands(_partner_split(w, eqn, k, v), axis_of, out, sums, used, sizes)
                if found is not None:
                    return found
            if name in GRADIENT_SUMS and len(w.uses.get(id(v), ())) == 1:
                if getattr(eqn.outvars[0].aval, "shape", None) == getattr(v.aval, "shape", None):
                    summed_with.add(id(eqn.outvars[0]))
                    frontier.append((eqn.outvars[0], axis_of))
            elif name == "transpose":
                frontier.append((eqn.outvars[0], _transposed(eqn, axis_of)))
            elif name in REDUCTIONS and all(int(v.aval.shape[a]) == 1 for a in eqn.params.get("axes", ())):
                # A sum over size-1 axes only (a gradient's reshape to [t, k, 1] summed back): a reshape.
                frontier.append((eqn.outvars[0], _size_one_summed(eqn, axis_of)))
            elif name in CARRIERS or _elementwise_alone(w, eqn, k):
                frontier.append((eqn.outvars[0], axis_of))
            elif name == "split":
                # The pieces of a cut (a concatenated kernel's gradient cut back into each gate's): a piece's
                # asked split is the whole's on every axis but the cut one (measured: x_t @ concat(W_i) in a scan's
                # gradient, W FSDP: XLA reduce-scatters each trip's whole kernel-gradient partial to the rows'
                # split its pieces' accumulators ask, tests/test_scan_unscattered_sums.py).
                frontier.extend((piece, _cut(eqn, axis_of)) for piece in eqn.outvars)
            elif name == "broadcast_in_dim":
                # A sum broadcast along new axes (a gradient of a reduction: d/dx sum(x, 0)): its axes keep
                # their place among the result's (measured: grad of sum(sum(a*b, 0)**2), b split on its columns,
                # XLA reduce-scatters sum(a*b, 0) to the columns' split, explain all-reduced it).
                frontier.append((eqn.outvars[0], _broadcast(eqn, v, axis_of)))
            elif name == "reshape":
                frontier.append((eqn.outvars[0], _reshaped(eqn, v, axis_of)))
            elif name in PLACEMENTS:
                # A placement asks for its layout outright: the exit of a jax.sharding.auto_axes region
                # (out_sharding=, or the transpose of its entry: a weight gradient resharded to the weight's
                # FSDP split) takes the sum split there, a reduce-scatter, as XLA compiles it.
                found = _lands(placement_dims(eqn), axis_of, out, sums, used, sizes)
                if found is not None:
                    return found
            elif name == "dot_general" and k < 2:
                partner = w.env.get(eqn.invars[1 - k])
                if partner is None or is_free(partner) or partner.unreduced:
                    continue
                found = _lands_at_dot(eqn, k, partner, axis_of, out, sums, used, sizes)
                if found is not None:
                    return found
    return None


def _transposed(eqn: Any, axis_of: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(axis_of[p] for p in eqn.params["permutation"])


def _cut(eqn: Any, axis_of: tuple[int, ...]) -> tuple[int, ...]:
    """A split's pieces' axes: the whole's, but for the cut axis, which maps to none (a piece's split there is
    not the whole's)."""
    cut = int(eqn.params["axis"])
    return tuple(-1 if i == cut else a for i, a in enumerate(axis_of))


def _broadcast(eqn: Any, v: Any, axis_of: tuple[int, ...]) -> tuple[int, ...]:
    at = eqn.params["broadcast_dimensions"]
    shape = eqn.outvars[0].aval.shape
    placed = [-1] * len(shape)
    for i, d in enumerate(at):
        if int(shape[d]) == int(v.aval.shape[i]):
            placed[d] = axis_of[i]
    return tuple(placed)


def _padded(eqn: Any, axis_of: tuple[int, ...]) -> tuple[int, ...]:
    """A pad's result's axes: its operand's, but for a padded one, which maps to none (a split there is not the
    operand's)."""
    return tuple(a if tuple(cfg) == (0, 0, 0) else -1 for a, cfg in zip(axis_of, eqn.params["padding_config"]))


def _reshaped(eqn: Any, v: Any, axis_of: tuple[int, ...]) -> tuple[int, ...]:
    mapped = _reshape_axes(tuple(v.aval.shape), tuple(eqn.outvars[0].aval.shape))
    return tuple(-1 if i < 0 else axis_of[i] for i in mapped)


def _elementwise_shape_ok(eqn: Any, k: int) -> bool:
    """:func:`_elementwise_alone` but for the layouts: an elementwise op whose result has operand ``k``'s shape."""
    if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1:
        return False
    return tuple(getattr(eqn.invars[k].aval, "shape", ())) == tuple(getattr(eqn.outvars[0].aval, "shape", ()))


def _size_one_summed(eqn: Any, axis_of: tuple[int, ...]) -> tuple[int, ...]:
    """The result's axes of a sum over size-1 axes only (a reshape in effect): the others keep their place."""
    dropped = set(eqn.params["axes"])
    return tuple(a for i, a in enumerate(axis_of) if i not in dropped)


def _consumer_reach(home: JaxprHome, var: Any) -> Reach | None:
    """:func:`_walk_consumers`'s search from ``var``, once, as the program's structure makes it.

    ``var`` is made at position ``p`` and searched for while that equation is stepped: a value made at ``p`` or
    later is not laid out yet (the walk binds a jaxpr's values in order), so every read of its layout finds
    nothing (an elementwise op with only such other operands is followed; a dot with such a partner asks
    nothing).  The points that read a value made before ``p`` (an argument, a weight, an activation) are kept as
    checks, made in each costing; the steps below an elementwise op such a check may stop carry its condition.
    None where the search takes more than :data:`~.lookahead.MAX_STEPS` steps (then it is walked each time).
    """
    here = home.made_at(var)
    uses = home.uses

    def laid_out_before(v: Any) -> bool:  # may have a layout when ``var`` is searched for (literals too: read them)
        return home.made_at(v) < here

    def others_bound(eqn: Any, k: int) -> bool:
        return any(j != k and not hasattr(o, "val") and laid_out_before(o) for j, o in enumerate(eqn.invars))

    steps: list[tuple[Any, tuple[int, ...], tuple[int, ...]]] = [(var, tuple(range(len(var.aval.shape))), ())]
    checks: list[tuple[int, int, str, Any, int, int]] = []
    summed_by: dict[int, list[int]] = {}
    conditions = 0
    at = 0
    while at < len(steps):
        if len(steps) > MAX_STEPS:
            return None
        v, axis_of, conds = steps[at]
        consumers = uses.get(id(v), ())
        for c, (eqn, k) in enumerate(consumers):
            name = eqn.primitive.name
            if name in ELEMENTWISE_PARTNERED and others_bound(eqn, k):
                checks.append((at, c, "partner", eqn, k, -1))
            if name in GRADIENT_SUMS and len(consumers) == 1:
                if getattr(eqn.outvars[0].aval, "shape", None) == getattr(v.aval, "shape", None):
                    summed_by.setdefault(id(eqn.outvars[0]), []).append(at)
                    steps.append((eqn.outvars[0], axis_of, conds))
            elif name == "transpose":
                steps.append((eqn.outvars[0], _transposed(eqn, axis_of), conds))
            elif name in REDUCTIONS and all(int(v.aval.shape[a]) == 1 for a in eqn.params.get("axes", ())):
                steps.append((eqn.outvars[0], _size_one_summed(eqn, axis_of), conds))
            elif name in CARRIERS:
                steps.append((eqn.outvars[0], axis_of, conds))
            elif _elementwise_shape_ok(eqn, k):
                # Followed unless another operand is laid out split (an elementwise op is none of the kinds below).
                if others_bound(eqn, k):
                    checks.append((at, c, "alone", eqn, k, conditions))
                    steps.append((eqn.outvars[0], axis_of, (*conds, conditions)))
                    conditions += 1
                else:
                    steps.append((eqn.outvars[0], axis_of, conds))
            elif name == "split":
                steps.extend((piece, _cut(eqn, axis_of), conds) for piece in eqn.outvars)
            elif name == "broadcast_in_dim":
                steps.append((eqn.outvars[0], _broadcast(eqn, v, axis_of), conds))
            elif name == "reshape":
                steps.append((eqn.outvars[0], _reshaped(eqn, v, axis_of), conds))
            elif name in PLACEMENTS:
                checks.append((at, c, "placement", eqn, k, -1))
            elif name == "dot_general" and k < 2 and laid_out_before(eqn.invars[1 - k]):
                checks.append((at, c, "dot", eqn, k, -1))
        at += 1
    steps_of: dict[int, list[int]] = {}
    for i, (v, _, _) in enumerate(steps):
        steps_of.setdefault(id(v), []).append(i)
    return Reach(
        var,
        tuple(steps),
        tuple(checks),
        {i: tuple(s) for i, s in summed_by.items()},
        {i: tuple(s) for i, s in steps_of.items()},
        conditions,
    )


def _search_reach(w: Walker, reach: Reach, out: Layout, sums: frozenset[str]) -> list[tuple[str, ...]] | None:
    """:func:`_walk_consumers`'s answer from ``reach`` (:func:`_checked_reach`), counted (:mod:`.lookahead`)."""
    found, taken = _checked_reach(w, reach, out, sums)
    counts = counts_of(w.costs)
    counts.searches += 1
    counts.steps += taken
    counts.most = max(counts.most, taken)
    return found


def _checked_reach(
    w: Walker, reach: Reach, out: Layout, sums: frozenset[str]
) -> tuple[list[tuple[str, ...]] | None, int]:
    """:func:`_walk_consumers`'s answer from ``reach``: its checks made in its order, a step skipped where a check on
    its path stopped the walk there; and how many steps and checks it took.

    While the segment memo records a stretch and the stretch is still closed (:mod:`.segment_memo`), the walk's
    reads are what decides whether its tape may be replayed elsewhere (a look-ahead past the stretch leaves it):
    the steps are then taken one by one with the walk's reads, until the recording leaves the stretch (from then
    on only the checks are made), or until the steps go past the stretch's horizon where what is left of the
    search reads nothing of the stretch (``segment_memo.past_copy``: the rest is answered unlogged, and the
    stretch's tape keeps that answer, which a replay elsewhere checks against its own).
    """
    steps, checks = reach.steps, reach.checks
    passed: dict[int, bool] = {}  # condition -> whether its elementwise op was followed
    taken = 0
    at = c = 0
    while _recording(w) and at < len(steps):
        if past_copy(w, reach, at):
            with unlogged(w):
                found, more = _rest_of_reach(w, reach, out, sums, at, c, passed)
            note_search(w, reach, at, out, sums, passed, found)
            return found, taken + more
        first = c
        while c < len(checks) and checks[c][0] == at:
            c += 1
        if _live(reach, passed, at):
            taken += 1
            v = steps[at][0]
            if _summed(reach, passed, at):
                found = _check(w, reach, out, sums, passed, at, "asked", None, -1, -1)
                if found is not None:
                    return found, taken
            w.uses.get(id(v), ())  # the walk's read of its consumers (past the stretch's horizon: it leaves)
            for _, _, kind, eqn, k, cond in checks[first:c]:
                found = _check(w, reach, out, sums, passed, at, kind, eqn, k, cond)
                if found is not None:
                    return found, taken
        at += 1
    found, more = _rest_of_reach(w, reach, out, sums, at, c, passed)
    return found, taken + more


def _live(reach: Reach, passed: dict[int, bool], at: int) -> bool:
    """Whether step ``at`` is taken: every elementwise op on its path was followed."""
    return all(passed.get(c, False) for c in reach.steps[at][2])


def _summed(reach: Reach, passed: dict[int, bool], at: int) -> bool:
    """Whether step ``at`` is reached through a gradient sum already visited (the walk's ``summed_with``)."""
    return any(q < at and _live(reach, passed, q) for q in reach.summed_by.get(id(reach.steps[at][0]), ()))


def _check(
    w: Walker,
    reach: Reach,
    out: Layout,
    sums: frozenset[str],
    passed: dict[int, bool],
    at: int,
    kind: str,
    eqn: Any,
    k: int,
    cond: int,
) -> list[tuple[str, ...]] | None:
    """One check of ``reach`` at step ``at`` (its layouts read now): the split it lands the sum at, if any."""
    sizes = w.costs.mesh_sizes
    used = {m for d in out.dims for m in d}
    v, axis_of, _ = reach.steps[at]
    if kind == "asked":
        asked = w.requested.get(id(v))
        return None if asked is None else _lands(asked, axis_of, out, sums, used, sizes)
    if kind == "partner":
        return _lands(_partner_split(w, eqn, k, v), axis_of, out, sums, used, sizes)
    if kind == "alone":
        passed[cond] = _elementwise_alone(w, eqn, k)
        return None
    if kind == "placement":
        return _lands(placement_dims(eqn), axis_of, out, sums, used, sizes)
    partner = w.env.get(eqn.invars[1 - k])
    if partner is None or is_free(partner) or partner.unreduced:
        return None
    return _lands_at_dot(eqn, k, partner, axis_of, out, sums, used, sizes)


def _rest_of_reach(
    w: Walker, reach: Reach, out: Layout, sums: frozenset[str], at: int, c: int, passed: dict[int, bool]
) -> tuple[list[tuple[str, ...]] | None, int]:
    """The search of ``reach`` from step ``at`` on (its checks from ``c`` on; ``passed``: the conditions decided so
    far): the checks in visit order, with the steps a requested output is visited at (asked before the step's
    consumers are read, as the walk does); the answer and how many checks it took."""
    requested, steps_of = w.requested, reach.steps_of
    # Which of the values visited are asked for, tested below without the recording tables' logging: logged here
    # for those in a recorded copy's horizon (the segment memo keeps them with its tape).
    note_asked(w, steps_of)
    # (from the smaller side: a planner asks a layout of every gradient, and a deep model's copies each search)
    if len(requested) <= len(steps_of):
        asked_at = sorted(s for i in requested for s in steps_of.get(i, ()) if s >= at)
    else:
        asked = requested.keys()  # (its view: a membership test no recording table logs, as the iteration above)
        asked_at = sorted(s for i, found in steps_of.items() if i in asked for s in found if s >= at)
    todo = [(s, -1, "asked", None, -1, -1) for s in asked_at] + list(reach.checks[c:])
    if asked_at:
        todo.sort(key=lambda t: (t[0], t[1]))
    taken = 0
    for s, _, kind, eqn, k, cond in todo:
        if not _live(reach, passed, s) or (kind == "asked" and not _summed(reach, passed, s)):
            continue
        taken += 1
        found = _check(w, reach, out, sums, passed, s, kind, eqn, k, cond)
        if found is not None:
            return found, taken
    return None, taken


def rest_of_reach(
    w: Walker, reach: Reach, out: Layout, sums: frozenset[str], at: int, passed: dict[int, bool]
) -> list[tuple[str, ...]] | None:
    """The answer of ``reach``'s search from step ``at`` on (``passed``: the conditions decided before it), for the
    segment memo's check of a replayed stretch (``segment_memo.searches_hold``); not counted."""
    c = next((i for i, chk in enumerate(reach.checks) if chk[0] >= at), len(reach.checks))
    return _rest_of_reach(w, reach, out, sums, at, c, dict(passed))[0]


def _recording(w: Walker) -> bool:
    """Whether the segment memo records the stretch being walked and it is still closed: its tables are then
    logging ones (segment_memo.RecordingTable, whose recorder says why the stretch left, once it has).  Any
    table of another kind than a plain dict counts as recording: the walk's reads are then made."""
    if type(w.uses) is dict or type(w.uses) is PlainTable:  # (PlainTable: the memo's table, not recording)
        return False
    rec = getattr(w.uses, "rec", None)
    return rec is None or not getattr(rec, "why", "")


def _elementwise_alone(w: Walker, eqn: Any, k: int) -> bool:
    """An elementwise op whose result is laid out as operand ``k`` (its other operands are constants or
    unsplit scalars and broadcasts): a partial sum's consumers are looked for through it (``x ** 2``,
    ``2 * x``)."""
    if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1:
        return False
    shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    if tuple(getattr(eqn.invars[k].aval, "shape", ())) != shape:
        return False
    for j, other in enumerate(eqn.invars):
        if j == k or hasattr(other, "val"):
            continue
        lay = w.env.get(other)
        if lay is not None and not is_free(lay) and any(lay.dims):
            return False
    return True


# Elementwise consumers whose other operands' layouts decide a partial sum's split (rules_structural.elementwise's
# primitives with two or more operands; cumulative ops read along an axis and are not among them).  add_any, the
# sum of a gradient's contributions, is XLA's add once lowered: its other contribution's split asks as an add's.
ELEMENTWISE_PARTNERED = frozenset(
    {"add", "add_any", "sub", "mul", "div", "max", "min", "pow", "atan2", "rem", "select_n"}
)


def _partner_split(w: Walker, eqn: Any, k: int, v: Any, only: int = -1) -> tuple[tuple[str, ...], ...]:
    """The split of the most sharded other operand of ``eqn`` (operand ``only`` where given) that has ``v``'s shape
    (none: all whole)."""
    shape = tuple(getattr(v.aval, "shape", ()))
    best: tuple[tuple[str, ...], ...] = ()
    for j, other in enumerate(eqn.invars):
        theirs = tuple(getattr(getattr(other, "aval", None), "shape", ()))
        # Same shape, or broadcast to it from size-1 axes (a [t, 1] normaliser): its splits where sizes agree.
        if j == k or (only >= 0 and j != only) or hasattr(other, "val") or len(theirs) != len(shape):
            continue
        if any(a != b and a != 1 for a, b in zip(theirs, shape)):
            continue
        lay = w.env.get(other)
        if lay is None or is_free(lay) or lay.unreduced:
            continue
        dims = tuple(d if a == b else () for d, a, b in zip(lay.dims, theirs, shape))
        if sum(len(d) for d in dims) > sum(len(d) for d in best):
            best = dims
    return best


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
    w: Walker,
    eqn: Any,
    out: Layout,
    colls: tuple[Any, ...],
    sums: frozenset[str],
    operands: tuple[Layout, Layout] | None = None,
) -> tuple[tuple[tuple[str, ...], ...], tuple[Any, ...]]:
    """A dot's result all-reduce becomes a reduce-scatter where a consumer takes the sum split (see above).

    Where the mesh axes neither operand uses hold at least as many devices as the sum (``operands``' idle
    axes), XLA spreads the work over them instead, as it does for a convolution (rules_windows): each idle
    group computes the slice of the result its devices own, all-reduces that slice over the summed axes
    (1/n of the result) and permutes it onto the split (one collective-permute of 1/n).  Measured:
    x[b, s, h@model] · wo[h@model, d] consumed by a dot contracting d against w1[d@model, f] on (data=4,
    model=2): all-reduce f32[8,8,16] + collective-permute f32[8,8,16] (tests/test_dot_consumer_sums.py).
    """
    dims = consumer_split(w, eqn.outvars[0], out, sums)
    if dims is None:
        dims = _typed_sum_split(w, eqn, out, sums)
    if dims is None:
        dims = _asked_sum_split(w, eqn, out, sums)
    if dims is None:
        return out.dims, colls
    scattered = {m for d in dims for m in d} - {m for d in out.dims for m in d}
    drop = [c for c in colls if c.kind == "all-reduce" and c.tensor == "result" and set(c.axes) <= scattered]
    if not drop:
        return out.dims, colls
    pending = out.with_dims(out.dims, frozenset(m for c in drop for m in c.axes))
    dst = w.relayout(eqn.outvars[0].aval, dims)
    summed = tuple(m for c in drop for m in c.axes)
    if operands is not None and _idle_devices(w, operands) >= math.prod(w.costs.mesh_sizes[m] for m in summed):
        block = math.prod(dst.shard_shape) * itemsize(eqn.outvars[0].aval.dtype)
        n = math.prod(w.costs.mesh_sizes[m] for m in summed)
        return dst.dims, tuple(c for c in colls if c not in drop) + idle_slice_sum(w, summed, n, block)
    moved = w.costs.reshard(pending, out.with_dims(dst.dims), eqn.outvars[0].aval.dtype)
    # (peak: the whole partial this sum is scattered from, held beside the whole sum XLA:CPU's all-reduce writes
    # before it slices each device's piece: memory._whole_sum_beside)
    w.env[Partial(eqn.outvars[0])] = pending
    return dst.dims, tuple(c for c in colls if c not in drop) + tuple(moved)


def _asked_sum_split(w: Walker, eqn: Any, out: Layout, sums: frozenset[str]) -> list[tuple[str, ...]] | None:
    """The split the caller asks of what the dot's sum becomes (:func:`asked_of_result`), where it becomes a program
    output only through ops that place it (a layer's weight gradient broadcast and padded into the stacked
    gradient) or leaves a call body toward one: XLA's propagation brings the output's split back to the dot, which
    reduce-scatters there (measured: FSDP on a decoder of remat'd layers slicing stacked weights, every layer's
    weight gradient reduce-scattered; explain all-reduced them).  A sum that is itself the output stays pending
    (dot_general: the output's layout settles it)."""
    var = eqn.outvars[0]
    if leaves_program(w, var):
        return None
    asked = asked_of_result(w, var)
    if asked is None:
        return None
    return _lands(asked, tuple(range(len(out.dims))), out, sums, {m for d in out.dims for m in d}, w.costs.mesh_sizes)


def _typed_sum_split(w: Walker, eqn: Any, out: Layout, sums: frozenset[str]) -> list[tuple[str, ...]] | None:
    """On Explicit axes a dot's result type names its split (jax.grad types a cotangent like its primal): where
    it splits an axis over the summed mesh axes, XLA sums the partial products there at the dot, as it does for a
    consumer asking that split (measured: the input gradient of two projections of x[b, s, d@M] on (4, 2), each
    partial sum all-reduced a slice per idle group and permuted onto d@M; tests/test_primitive_rules_core.py).
    Not a 16-bit float XLA:CPU sums in f32: it converts the whole sum before any slice (dot_general's note)."""
    typed = typed_dims(eqn.outvars[0].aval)
    if typed is None or out.unreduced or len(typed) != len(out.dims):
        return None
    dname, size = dtype_info(eqn.outvars[0].aval.dtype)
    if wire_itemsize(dname, size, w.costs.profile.narrow_floats) != size:
        return None
    if not any(set(d) & sums for d in typed):
        return None
    return [tuple(d) for d in typed]


_CARRIER_CHAIN_LIMIT = 16  # carriers followed from one dot's result (such chains are a few ops long)


def sliced_for_consumer(
    w: Walker,
    eqn: Any,
    out: Layout,
    colls: tuple[Any, ...],
    sums: frozenset[str],
    operands: tuple[Layout, Layout],
) -> tuple[tuple[tuple[str, ...], ...], tuple[Any, ...], int]:
    """A dot's summed result sliced to an elementwise consumer's split before its all-reduce (XLA's propagation).

    Where an elementwise consumer's other operand splits an axis the dot's result keeps whole over mesh axes that
    neither the sum nor either operand uses, XLA gives the dot's result that split: each device slices its
    (replicated there) operands locally, computes its piece of the partial sum and all-reduces only that piece
    (measured: x[64, 16@b] - einsum('etd,ed->td', a[8@a, 64, 16], ones) on (a=4, b=2) all-reduces f32[64, 8],
    not f32[64, 16]; tests/test_explain_partial_sums.py).  A reduction's sum is not sliced so (measured: XLA
    all-reduces sum(a, 0) whole there), and on Explicit axes the result's type decides its split instead.
    Returns the result's split, its collectives and how many pieces the slice cuts the result into.
    """
    if typed_dims(eqn.outvars[0].aval) is not None or out.unreduced:
        return out.dims, colls, 1
    sizes = w.costs.mesh_sizes
    taken = set(sums) | {m for lay in operands for d in lay.dims for m in d} | {m for d in out.dims for m in d}
    dims = list(out.dims)
    # Through the carriers that keep every element (einsum's transpose of its dot's result, a dtype conversion).
    frontier: list[tuple[Any, tuple[int, ...]]] = [(eqn.outvars[0], tuple(range(len(out.dims))))]
    for _ in range(_CARRIER_CHAIN_LIMIT):
        if not frontier:
            break
        v, axis_of = frontier.pop(0)  # axis_of[i]: the dot result's axis that is v's axis i
        for user, k in w.uses.get(id(v), ()):
            name = user.primitive.name
            if name in CARRIERS:
                frontier.append((user.outvars[0], _transposed(user, axis_of) if name == "transpose" else axis_of))
            if name not in ELEMENTWISE_PARTNERED:
                continue
            for j, split in enumerate(_partner_split(w, user, k, v)):
                i = axis_of[j] if j < len(axis_of) else -1
                if i < 0 or not split or dims[i] or set(split) & taken:
                    continue
                if out.shape[i] % math.prod(sizes[m] for m in split) == 0:
                    dims[i] = split
                    taken |= set(split)
    if tuple(dims) == out.dims:
        return out.dims, colls, 1
    piece = math.prod(sizes[m] for d in dims for m in d) // max(1, math.prod(sizes[m] for d in out.dims for m in d))
    sliced = []
    for c in colls:
        if c.kind != "all-reduce" or c.tensor != "result":
            sliced.append(c)
            continue
        block = c.array_bytes // piece
        sent = sent_bytes("all-reduce", c.group_size, block)
        t = w.costs.profile.collective_time("all-reduce", c.group_size, sent, block)
        sliced.append(replace(c, bytes=int(sent), array_bytes=int(block), time=t))
    return tuple(dims), tuple(sliced), piece


def _idle_devices(w: Walker, operands: tuple[Layout, Layout]) -> int:
    """Devices along the mesh axes neither of a dot's operands splits anything over."""
    used = {m for lay in operands for d in lay.dims for m in d}
    return math.prod(size for m, size in w.costs.mesh_sizes.items() if m not in used)


def grouped_operand(
    lhs: Layout, rhs: Layout, out: Layout, dn: Any, sizes: dict[str, int], dtypes: Sequence[Any]
) -> tuple[int, tuple[str, ...]] | None:
    """The operand XLA's partitioner groups a dot on when both operands split free (non-contracting) factors that
    the result splits alike (x[b@data, s, d] . w[d@data, f@model] -> [b@data, s, f@model]): which (0 lhs, 1 rhs)
    and the mesh axes of its free splits; None where not both do (or a batch factor is split: grouped on first).

    XLA partitions such a dot in groups over the chosen operand's free splits (its
    ``LhsIsBestMatchForNonContractingPartitioning``: the lhs where ``p_lhs * shard(rhs) < p_rhs * shard(lhs)``, the
    products of the free splits' mesh sizes and the operands' shard bytes, else the rhs).  The other operand is
    resharded before the grouping, a move of the value XLA makes once for every dot (its reshard cache); the
    grouped operand's own moves (w's gather over 'data' above, the rhs grouped over 'model') are made within the
    group, shared only with the same move made in the same grouping, never with the value's move made outside a
    group (measured on jax 0.10.2's XLA:CPU, (4, 2) mesh: that forward and the input gradient g[b@data, s, f@model]
    . w gather w twice where x's shard is twice w's, once where four times; our decoder's FSDP+TP MLP gate and up
    projections and unembedding under remat gather their weight three times (forward, recomputed forward, input
    gradient), the q, k, v projections, their shard a quarter of the hidden state's, twice)."""
    if is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return None
    (lc, rc), (lb, rb) = dn
    if any(lhs.dims[i] for i in lb) or any(rhs.dims[j] for j in rb):
        return None
    free = (
        [i for i in range(len(lhs.dims)) if i not in lc and i not in lb],
        [j for j in range(len(rhs.dims)) if j not in rc and j not in rb],
    )
    at = (len(lb), len(lb) + len(free[0]))
    if len(out.dims) != at[1] + len(free[1]):
        return None
    ops = (lhs, rhs)
    parts = [math.prod(sizes[m] for i in free[k] for m in ops[k].dims[i]) for k in (0, 1)]
    into = [math.prod(sizes[m] for d in out.dims[at[k] : at[k] + len(free[k])] for m in d) for k in (0, 1)]
    if min(parts) <= 1 or parts != into:
        return None
    nbytes = [math.prod(ops[k].shard_shape) * getattr(dtypes[k], "itemsize", 4) for k in (0, 1)]
    k = 0 if parts[0] * nbytes[1] < parts[1] * nbytes[0] else 1
    return k, tuple(m for i in free[k] for m in ops[k].dims[i])


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
    return slice_whole_partner(lhs, rhs, dn, sizes)


def slice_whole_partner(lhs: Layout, rhs: Layout, dn: Any, sizes: dict[str, int]) -> tuple[Layout, Layout]:
    """Slice a whole (replicated) operand to its partner's contracted split where XLA's partitioner does.

    XLA groups the devices by the split operand's other (batch and free) splits, and within a group, the whole
    operand's and the result's group replicated, it slices the whole operand to the contracted split and
    all-reduces the partial products when the split operand has more elements than the result (its base case's
    "partition the contracting dimension" test, per group: both sides divide by the same group count), else it
    gathers the split operand.  Only where the split operand's splits cover every mesh axis (partially
    replicated, XLA's base case declines and gathers; idle_axes.py prices that).  Measured on one-op programs:
    x[8@a, 32@b] . w[32, 10] all-reduces the (8, 10) product over 'b', . w[32, 64] gathers x.
    """
    if is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return lhs, rhs
    (lc, rc), (lb, rb) = dn
    mesh = {m for m, n in sizes.items() if n > 1}
    out_size = math.prod(lhs.shape[i] for i in lb)
    out_size *= math.prod(s for i, s in enumerate(lhs.shape) if i not in lc and i not in lb)
    out_size *= math.prod(s for j, s in enumerate(rhs.shape) if j not in rc and j not in rb)
    for k, (split, whole, mine, theirs) in enumerate(((lhs, rhs, lc, rc), (rhs, lhs, rc, lc))):
        used = {m for d in split.dims for m in d}
        if any(whole.dims) or not any(split.dims[i] for i in mine) or not mesh <= used:
            continue
        if math.prod(split.shape) <= out_size:
            return lhs, rhs  # XLA gathers the split operand: the analyzer's usual answer
        dims = list(whole.dims)
        for i, j in zip(mine, theirs):
            dims[j] = split.dims[i]
        sliced = whole.with_dims(tuple(dims))
        return (lhs, sliced) if k == 0 else (sliced, rhs)
    return lhs, rhs


def xla_gathered_operand(lhs: Layout, rhs: Layout, dn: Any, sizes: dict[str, int]) -> int | None:
    """The operand (0: lhs, 1: rhs) XLA's partitioner gathers where it splits a contracted axis and its partner is
    whole (:func:`slice_whole_partner`'s base case declining): its splits leave a mesh axis idle, or it has no more
    elements than the result.  None where that is not the case (the partner is split, neither operand splits a
    contracted axis, or XLA slices the partner)."""
    if is_free(lhs) or is_free(rhs) or lhs.unreduced or rhs.unreduced:
        return None
    (lc, rc), (lb, _) = dn
    mesh = {m for m, n in sizes.items() if n > 1}
    for k, (split, whole, mine) in enumerate(((lhs, rhs, lc), (rhs, lhs, rc))):
        if any(whole.dims) or not any(split.dims[i] for i in mine):
            continue
        if not mesh <= {m for d in split.dims for m in d}:
            return k
        out_size = math.prod(lhs.shape[i] for i in lb)
        out_size *= math.prod(s for i, s in enumerate(lhs.shape) if i not in lc and i not in lb)
        out_size *= math.prod(s for j, s in enumerate(rhs.shape) if j not in rc and j not in dn[1][1])
        return k if math.prod(split.shape) <= out_size else None
    return None


def gathered_as_xla(w: Walker, lhs: Layout, rhs: Layout, dn: Any, dtype: Any, res: DotResult) -> DotResult:
    """``res``, or where XLA gathers the operand that splits a contraction against a whole partner
    (:func:`xla_gathered_operand`) and the analyzer summed partial products instead, the gather and the dot of
    the gathered operand.

    The analyzer ranks by α–β time, which counts the compute a gathered operand duplicates; XLA's partitioner
    chooses by its base case, which does not (measured on one-op programs, x[8@data, 16, 64@model] . w[64, n],
    w whole: XLA gathers x for every n, the analyzer summed the (8, 16, n) product from n = 256 on; with x's
    rows whole, 'data' idle, XLA gathers x[16, 64@model] . w[64, 24], the analyzer summed)."""
    k = xla_gathered_operand(lhs, rhs, dn, w.costs.mesh_sizes)
    if k is None or not any(c.kind == "all-reduce" and c.tensor == "result" for c in res.collectives):
        return res
    split = (lhs, rhs)[k]
    mine = dn[0][k]
    gathered = split.with_dims(tuple(() if i in mine else d for i, d in enumerate(split.dims)))
    moves = tuple(replace(c, tensor=f"operand {k + 1}", operand=k) for c in w.costs.reshard(split, gathered, dtype))
    done = w.costs.dot(gathered, rhs, dn, dtype) if k == 0 else w.costs.dot(lhs, gathered, dn, dtype)
    return DotResult(
        done.out,
        moves + done.collectives,
        done.flops,
        done.time_s + sum(c.time for c in moves),
        res.expression,
    )


def batch_split_via_idle(
    w: Walker, lhs: Layout, rhs: Layout, dn: Any, colls: tuple[Any, ...], result_bytes: int
) -> tuple[Any, ...]:
    """``colls``, or where the analyzer all-to-alls an operand's contracted split ``M`` onto a batch axis its partner
    splits over ``M`` and the idle mesh axes ``U`` (used by neither operand) have at least ``|M|`` devices, XLA's
    route there: a collective-permute and an all-gather, no all-to-all.

    The attention backward under tensor parallelism: the output's cotangent do[b, q, h, k@model] (computed against
    wo[h, k@model, d]) meets v[b, t, h@model, k] in ds = do . v^T, the heads a batch axis split on v, the head width
    contracted and split on do.  XLA brings do to v's batch split; with ``|U| >= |M|`` it slices do's batch axis
    over ``|M|`` of the idle devices (local: do is replicated there), permutes the blocks so the batch axis is over
    ``M`` and the contracted axis over those idle devices (the shard / ``|M|``), and gathers the contracted axis
    over them (to the shard it would have all-to-all'd); with fewer idle devices, the all-to-all.  Measured on
    einsum('bqhk,bthk->bhqt') of do[8, 8, 4, 8@model] and v[8, 8, 4@model, 8], do an argument or computed:
    (4, 2) permute 2048 B, all-gather 4096 B over groups of 2 'data' devices; (8, 2) the same; (4, 4) permute
    512 B, all-gather 2048 B; (2, 4) one all-to-all (tests/test_dot_batch_split_via_idle.py).  An output's split
    asked of a free axis is reached by an all-to-all as the analyzer makes it (the weight gradient o^T . dy)."""
    a2a = [c for c in colls if c.kind == "all-to-all"]
    if len(a2a) != 1 or len(colls) != 1 or not _names_operand(a2a[0]):
        return colls
    c = a2a[0]
    k = operand_index(c)
    if k not in (0, 1) or c.before is None or c.after is None:
        return colls
    own, partner = (lhs, rhs)[k], (lhs, rhs)[1 - k]
    if is_free(own) or is_free(partner) or own.unreduced or partner.unreduced or c.before.dims != own.dims:
        return colls
    (lc, rc), (lb, rb) = dn
    contracted, batch, partner_batch = (lc, rc)[k], (lb, rb)[k], (lb, rb)[1 - k]
    moved = tuple(c.axes)
    changed = [a for a, (x, y) in enumerate(zip(c.before.dims, c.after.dims)) if tuple(x) != tuple(y)]
    if len(changed) != 2:
        return colls
    src = [a for a in changed if a in contracted and tuple(c.before.dims[a]) == moved and not c.after.dims[a]]
    dst = [a for a in changed if a in batch and not c.before.dims[a] and tuple(c.after.dims[a]) == moved]
    if len(src) != 1 or len(dst) != 1:
        return colls
    if tuple(partner.dims[partner_batch[list(batch).index(dst[0])]]) != moved:
        return colls  # the partner's batch split is not where the operand is brought
    sizes = w.costs.mesh_sizes
    used = {m for lay in (lhs, rhs) for d in lay.dims for m in d}
    idle = tuple(m for m in sizes if m not in used and sizes[m] > 1)
    n_moved, n_idle = math.prod(sizes[m] for m in moved), math.prod(sizes[m] for m in idle)
    if not idle or n_idle < n_moved or n_idle % n_moved:
        return colls
    profile = w.costs.profile
    shard = c.array_bytes  # the operand's block, before and after alike (the all-to-all's buffer)
    permuted = shard // n_moved
    why = "operand's contracted split brought to the partner's batch split through idle mesh axes"
    group = n_moved * n_moved
    permute = replace(
        c,
        kind="collective-permute",
        axes=moved + idle,
        group_size=group,
        bytes=int(sent_bytes("collective-permute", group, permuted)),
        array_bytes=int(permuted),
        time=profile.collective_time("collective-permute", group, permuted, permuted),
        why=why,
    )
    if result_bytes < shard:
        sent = sent_bytes("all-reduce", n_moved, result_bytes)
        summed = Collective(
            "all-reduce",
            idle,
            n_moved,  # (|M| of the idle devices, as the gather's)
            int(sent),
            int(result_bytes),
            profile.collective_time("all-reduce", n_moved, sent, result_bytes),
            "result",
            f"{why}; the partner sliced alike, the partial products summed over {n_moved} of them",
        )
        return (permute, summed)
    sent = sent_bytes("all-gather", n_moved, shard)
    gather = replace(
        c,
        kind="all-gather",
        axes=idle,
        group_size=n_moved,  # (|M| of the idle devices: a group within U where U is the larger)
        bytes=int(sent),
        array_bytes=int(shard),
        time=profile.collective_time("all-gather", n_moved, sent, shard),
        why=f"{why}, then gathered over {n_moved} of them",
    )
    return (permute, gather)


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
            sent = sent_bytes("all-reduce", n, c.array_bytes)
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
    pairs = list(zip(op_batch, idx_batch))
    lookup_split = {m for i, d in enumerate(operand.dims) if sizes[i] == 1 and i not in op_batch for m in d}
    idx_batch_split = {m for _, ib in pairs for m in indices.dims[ib]}
    crossed = any(
        set(operand.dims[ob]) & set(indices.dims[ib2])
        for k, (ob, _) in enumerate(pairs)
        for j, (_, ib2) in enumerate(pairs)
        if k != j
    )
    if crossed and not idx_batch_split & lookup_split:
        # A mesh axis splits one batch axis of the operand and another of the indices (logits split along
        # the batch, labels along the sequence): XLA moves the operand to the indices' batch splits (one
        # all-to-all), measured.
        target = list(operand.dims)
        for ob, ib in pairs:
            target[ob] = indices.dims[ib]
        placed = {m for ob, _ in pairs for m in target[ob]}
        target = [d if k in op_batch else tuple(m for m in d if m not in placed) for k, d in enumerate(target)]
        moved_operand = operand.with_dims(tuple(target))
        w.change(
            eqn, phase, operand, moved_operand, dtype, repeat, "gather batch axes: the operand follows the indices"
        )
        operand = moved_operand
    batch_dims = {}
    for ob, ib in pairs:
        if set(indices.dims[ib]) & lookup_split and not operand.dims[ob]:
            # The indices' batch split names the table's lookup split (labels split along the batch over the
            # mesh axis that splits the logits' vocabulary): that part is a masked lookup (step 2); the rest
            # of the split the operand takes by a local slice (measured: labels over (data, model), logits'
            # vocabulary over model: the labels gathered over model, one reduce-scatter).
            rest = tuple(m for m in indices.dims[ib] if m not in lookup_split)
            if rest and not set(rest) & {m for d in operand.dims for m in d}:
                operand = operand.with_dims(tuple(rest if k == ob else d for k, d in enumerate(operand.dims)))
            batch_dims[ib] = indices.dims[ib]
            continue
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
    # 3. indices split over a mesh axis that splits an axis the lookup keeps whole (token ids split over the
    #    axis a table's features are split over): XLA gathers the indices along it and the result keeps the
    #    table's split (measured on [16, 16@a] and [16, 64@a] tables by 8 to 128 ids split over a, the ids
    #    smaller or larger than the result).
    kept_split = {m for i, d in enumerate(operand.dims) if i not in indexed and i not in op_batch for m in d}
    clash = {m for k, d in enumerate(indices.dims) if k not in batch_dims for m in d} & kept_split
    idle = set(w.costs.mesh_sizes) - {m for d in operand.dims + indices.dims for m in d}
    idle_start = len(w.ops)
    idle_clash = bool(clash) and any(w.costs.mesh_sizes[m] > 1 for m in idle)
    if idle_clash and not masked and not op_batch and not batch_dims:
        routed = _lookup_over_idle_axes(w, eqn, phase, repeat, operand, indices, tuple(sorted(clash)), offset_dims)
        if routed is not None:
            return [routed]
    if clash and not idle_clash:
        # (With idle mesh axes XLA moves the indices onto them instead and gathers the result there (a
        # permute, two all-gathers): not modelled; the result's second use of the axis is gathered below.)
        keep = tuple(
            d if k in batch_dims else tuple(m for m in d if m not in clash) for k, d in enumerate(indices.dims)
        )
        why = "gather: the indices meet the table's kept split"
        w.change(eqn, phase, indices, indices.with_dims(keep), indices_dtype(eqn), repeat, why)
        if fills(eqn):
            # mode="fill": XLA computes each index's in-bounds mask (one byte each) on the indices' split and
            # gathers it too (measured: a second all-gather of 8 bytes for 8 ids).
            axes = tuple(m for d in indices.dims for m in d if m in clash)
            charge(w, eqn, phase, repeat, "all-gather", axes, [math.prod(indices.shape[:-1])], "gather: fill mask")
        indices = indices.with_dims(keep)
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
    start = len(w.ops)
    approx_note = ""
    if set(masked) & idx_used and op_batch:
        # A lookup with batching axes (take_along_axis: a label lookup in logits split along the vocabulary
        # over a mesh axis that splits the labels too): priced as the indices gathered (below); measured,
        # XLA may move the operand onto free mesh axes instead (a collective-permute, then an all-reduce).
        approx_note = (
            "a batched lookup split like its operand: XLA may move the operand instead of gathering the indices"
        )
    elif set(masked) & idx_used:
        plan = choose_lookup(w, operand, indices, masked, wanted, out_aval, indices_dtype(eqn))
        approx_note = plan.note if plan.close else ""
        if plan.move in ("move table", "move indices"):
            table_used = {m for d in operand.dims for m in d}
            moved = tuple(m for m in w.costs.mesh_sizes if m in masked or not {m} & (idx_used | table_used))
            _record_lookup(w, eqn, phase, repeat, plan, moved, w.relayout(out_aval, wanted))
            free_axes = tuple(m for m in moved if m not in masked)
            w.env[Partial(eqn.outvars[0])] = moved_partial(w, out_aval, wanted, masked, free_axes, plan)
            if approx_note:
                mark_approximate(w, start, approx_note, plan.bound)
            return [w.relayout(out_aval, wanted)]
        if plan.move == "gather table":
            shared = tuple(m for m in masked if m in idx_used)
            whole = operand.with_dims(tuple(tuple(m for m in d if m not in shared) for d in operand.dims))
            w.change(eqn, phase, operand, whole, dtype, repeat, "gather: the table gathered where the indices split")
            operand = whole
            masked = tuple(m for m in masked if m not in shared)
            wanted = result_dims(indices, batch_dims)
    gathered_indices = bool(set(masked) & idx_used)
    if gathered_indices:
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
    if masked and gathered_indices and set(masked) - idx_used:
        # A table split over more mesh axes than the indices share: every device looked up every index of
        # its piece, and XLA sums the whole result over the table's split at once and slices its own piece
        # (all-reduce + dynamic-slice: one reduce-scatter), measured; not one sum per mesh axis.
        piece = math.prod(out.shard_shape) * itemsize(dtype)
        if wanted != dims:
            out = w.relayout(out_aval, wanted)
        kind: SentKind = "reduce-scatter" if out.dims != dims else "all-reduce"
        summed_at = len(w.ops)
        charge(w, eqn, phase, repeat, kind, masked, [piece], "masked gather from a sharded table", out)
        if kind == "reduce-scatter" and not approx_note:
            # Measured both ways: with no layout asked of the result, XLA may keep it whole (an all-reduce,
            # no slice) instead of slicing it back to the indices' split.
            approx_note = "a masked lookup's sum: XLA may all-reduce the result whole instead of reduce-scattering it"
            # XLA's other choice sends the whole result and holds it twice (the partial and the summed buffers)
            # where explain holds pieces (measured: a [16, 16] lookup, table rows over (a, b), ids over b).
            whole = math.prod(out_aval.shape) * itemsize(dtype)
            mark_approximate(w, summed_at, approx_note, OpBound(1, float(whole), float(2 * whole)))
            approx_note = ""
    elif masked:
        pending = out.with_dims(out.dims, frozenset(masked))
        w.env[Partial(eqn.outvars[0])] = out  # the masked partial lookup is held next to its sum (memory.py)
        if wanted != dims:
            # (a mesh axis that wanted names twice keeps its first use, as above, where its gather was paid)
            out = w.relayout(out_aval, wanted)
        w.change(eqn, phase, pending, out, dtype, repeat, "masked gather from a sharded table")
    if idle_clash:
        # XLA moves the table's kept split off the indices' axis onto the idle ones instead (a permute and an
        # all-gather of the table), looks up there and gathers the result over them (measured: a (2, 32) table,
        # features over 'data', ids (8, 8) batch over 'data' of (4, 2): permute + all-gather of the table, an
        # all-gather of the result over 'model', where explain gathers the result over 'data'): not modelled, so
        # the op says so.  Bounded by XLA's whole route: the table permuted and gathered, the indices gathered, the
        # result gathered and moved to its asked split (an all-to-all, measured with a (64, 32) table): five
        # collectives, each moving at most the whole value.
        table, ids, result = (math.prod(v.aval.shape) * itemsize(v.aval.dtype) for v in (*eqn.invars[:2], *eqn.outvars))
        note = IDLE_AXES_LOOKUP_NOTE + (f"; {approx_note}" if approx_note else "")
        mark_approximate(w, idle_start, note, OpBound(5, float(2 * table + ids + 2 * result), float(table)))
    elif approx_note:
        mark_approximate(w, start, approx_note)
    return [out]


# One collective of a lookup moved onto the idle mesh axes: (kind, group size, buffer bytes, mesh axes).
IdleStep = tuple[SentKind, int, int, tuple[str, ...]]


def _lookup_over_idle_axes(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    table: Layout,
    indices: Layout,
    clash: tuple[str, ...],
    offset_dims: tuple[int, ...],
) -> Layout | None:
    """A plain lookup (no batching axes, the indexed axis whole) whose indices split over mesh axes ``clash`` that
    split an axis of the table the lookup keeps too, with idle mesh axes ``U`` (used by neither): XLA moves one
    side's ``clash`` split onto ``U`` (a collective-permute, then an all-gather over the rest where ``U`` has fewer
    devices), looks up there and all-gathers the result over ``U``.  Which side turns on the split XLA's
    propagation gave the result before partitioning the gather (measured on (4, 2) and (2, 4) meshes, tables
    (2, 32), (2, 64) and (64, 32) with columns over 'data', ids (8, 8) batch over 'data';
    tests/test_lookup_idle_axes.py):

    * none asked of it (its readers' other operands are made by gathers or dots, or absent): the result keeps the
      table's split; the *indices* move (keras-hub BERT's segment embedding), and a ``mode="fill"`` lookup's
      in-bounds mask is all-gathered over ``clash`` whole, for the select on the result's split;
    * the indices' split asked of it (an output's sharding, or an elementwise reader whose other operand the
      first propagation pass splits: :func:`_elementwise_reader_split`): the cheaper by the buffers moved of the
      *table* moved (the result lands on the indices' split) and the indices moved then the result all-to-all'd
      over ``clash`` to it (a (64, 32) table: the indices move).

    None where the route does not apply (the idle devices do not divide the moved split)."""
    sizes = w.costs.mesh_sizes
    used = {m for lay in (table, indices) for d in lay.dims for m in d}
    idle = tuple(m for m in sizes if m not in used and sizes[m] > 1)
    n_clash, n_idle = math.prod(sizes[m] for m in clash), math.prod(sizes[m] for m in idle)
    ways = math.gcd(n_clash, n_idle)  # how many ways the moved split fits on the idle devices
    if ways <= 1:
        return None
    out_aval = eqn.outvars[0].aval
    dtype = out_aval.dtype
    kept = [i for i in range(len(table.shape)) if i not in set(eqn.params["dimension_numbers"].collapsed_slice_dims)]
    batch_out = [d for d in range(len(out_aval.shape)) if d not in offset_dims]

    def result(ids_dims: Sequence[tuple[str, ...]], table_dims: Sequence[tuple[str, ...]]) -> Layout:
        dims: list[tuple[str, ...]] = [()] * len(out_aval.shape)
        for out_dim, op_dim in zip(offset_dims, kept):
            dims[out_dim] = tuple(table_dims[op_dim])
        for out_dim, idx_dim in zip(batch_out, range(len(indices.shape) - 1)):
            dims[out_dim] = tuple(ids_dims[idx_dim])
        return w.relayout(out_aval, dims)

    drop = lambda dims: [tuple(m for m in d if m not in clash) for d in dims]  # noqa: E731
    at_table = result(drop(indices.dims), table.dims)  # the indices' clash split dropped
    at_indices = result(indices.dims, drop(table.dims))  # the table's
    if len({m for d in at_table.dims for m in d}) != sum(len(d) for d in at_table.dims):
        return None  # (a mesh axis on two result axes: not measured)
    piece = lambda lay: math.prod(lay.shard_shape) * itemsize(dtype)  # noqa: E731
    rest = n_clash // ways  # the moved split's devices the idle ones do not cover: gathered over the clash axes
    index_bytes = math.prod(indices.shard_shape) * itemsize(indices_dtype(eqn))
    table_bytes = math.prod(table.shard_shape) * itemsize(dtype)
    # (kind, group size, buffer bytes, mesh axes) in program order; the result, looked up on the moved split, is
    # gathered over the idle axes into the target's piece.
    move_indices: list[IdleStep] = [("collective-permute", 2, index_bytes, clash + idle)]
    move_table: list[IdleStep] = [("collective-permute", 2, table_bytes, clash + idle)]
    if rest > 1:
        move_indices.append(("all-gather", rest, index_bytes * rest, clash))
        move_table.append(("all-gather", rest, table_bytes * rest, clash))
    move_indices.append(("all-gather", ways, piece(at_table), idle))
    move_table.append(("all-gather", ways, piece(at_indices), idle))
    moved_back: IdleStep = ("all-to-all", n_clash, piece(at_indices), clash)  # the rows to the indices' split
    res = eqn.outvars[0]
    asked = asked_of_result(w, res)
    if asked is None:
        asked = _elementwise_reader_split(w, res)
    note, bound = "", None
    if asked is not None and tuple(map(tuple, asked)) == tuple(at_indices.dims):
        # Ranked by the bytes each way sends (measured: 6 tables and meshes, the table moved where it is small).
        by_indices = [*move_indices, moved_back]
        cost_table, cost_indices = _sent(move_table), _sent(by_indices)
        steps, other = (move_table, by_indices) if cost_table <= cost_indices else (by_indices, move_table)
        what, out = ("table" if steps is move_table else "indices"), at_indices
        if max(cost_table, cost_indices) <= CLOSE * max(min(cost_table, cost_indices), 1.0):
            note = f"{IDLE_AXES_CLOSE_NOTE} ({cost_table:.0f} B against {cost_indices:.0f} B sent)"
            bound = between(_plain(steps), _plain(other))
    else:
        steps, what, out = move_indices, "indices", at_table
        if fills(eqn):
            # mode="fill": the in-bounds mask (a byte per index) is made on the indices' split and selected on
            # the result's: gathered over the clash axes (measured: pred[8, 8] for ids (8@data, 8)).
            ids_rest = math.prod(sizes[m] for d in indices.dims[:-1] for m in d if m not in clash)
            steps.insert(0, ("all-gather", n_clash, math.prod(indices.shape[:-1]) // ids_rest, clash))
        if asked is None and not w.uses.get(id(res)) and id(res) not in w.program_outputs:
            # The result leaves the body it is made in (``jnp.take`` is a call of its own): its readers outside
            # are not this walk's (a call's body is walked alone and replayed by structure: walker.walk_call).
            # XLA's other way lands the result on the indices' split, and the reader's move of it (an all-to-all,
            # charged there) is not made either.
            note, bound = IDLE_AXES_UNSEEN_NOTE, between(_plain([*steps, moved_back]), _plain(move_table))
    colls = []
    for kind, n, array, axes in steps:
        sent = sent_bytes(kind, n, array)
        t = w.costs.profile.collective_time(kind, n, sent, array)
        colls.append(Collective(kind, axes, n, int(sent), int(array), t, "operand 1", f"lookup: the {what} moved"))
    whose = {"table": "table's", "indices": "indices'"}[what]
    why = f"lookup: the {whose} split moved onto the idle mesh axes (the indices split where the table keeps its split)"
    start = len(w.ops)
    w.record(eqn, phase, why, out, tuple(colls), 0.0, sum(c.time for c in colls), repeat)
    if note:
        mark_approximate(w, start, note, bound)
    return out


def _sent(steps: Sequence[IdleStep]) -> float:
    return sum(sent_bytes(kind, n, array) for kind, n, array, _ in steps)


def _plain(steps: Sequence[IdleStep]) -> tuple[tuple[SentKind, int, int], ...]:
    return tuple((kind, n, array) for kind, n, array, _ in steps)


IDLE_AXES_CLOSE_NOTE = (
    "a lookup whose indices split where the table keeps its split, its result asked on the indices' split: XLA "
    "moves the table or the indices onto the idle mesh axes by its own cost estimate, and the two are close"
)


IDLE_AXES_UNSEEN_NOTE = (
    "a lookup whose indices split where the table keeps its split, its result read outside its call: where a "
    "reader there meets a value split like the indices in XLA's first propagation pass, XLA moves the table onto "
    "the idle mesh axes instead of the indices"
)


IDLE_AXES_LOOKUP_NOTE = (
    "indices split over a mesh axis that splits an axis the lookup keeps whole, with idle mesh axes: XLA may move "
    "the table's split onto the idle axes and gather the result there instead"
)


# How XLA's SPMD partitioner runs a lookup whose table is split along the indexed axis over mesh axes the
# indices are split over too (an FSDP embedding table, vocabulary over 'data', looked up by tokens split over
# 'data'): each device can only look up the rows it holds, so one side has to move.  Measured on one-op
# programs (tests/test_lookup_rules.py), it does one of four things:
#
# * "move indices": the indices' split moves onto mesh axes neither uses (a collective-permute, plus an
#   all-gather where those axes are fewer devices than the shared split), each device looks up its rows under a
#   mask, the result is all-reduced over the table's split and brought back to the indices' split (a slice and
#   a collective-permute) — the FSDP (data=4, model=2) case;
# * "move table": the table's split moves onto the free axes instead (a collective-permute of the table's
#   piece, plus an all-gather where they are fewer devices), the masked result is all-reduced there;
# * "gather table": with no free axes, the table is all-gathered along the shared axes;
# * "gather indices": with no free axes, the indices are all-gathered and the masked result all-reduced whole,
#   then sliced (a reduce-scatter).
#
# XLA picks by its own estimate of each way's cost; explain estimates them with the buffers each moves (what
# the HLO prints) and takes the cheapest.  Where the runner-up is within CLOSE of the cheapest, XLA's estimate
# may pick it instead: the op is marked approximate (the report's first line says so, with the bound).
LookupMove = Literal["move indices", "move table", "gather table", "gather indices"]
CLOSE = 1.5


@dataclass(frozen=True)
class LookupPlan:
    """One way to run a masked lookup whose indices split over the table's indexed split, and what it moves."""

    move: LookupMove
    cost: float  # the buffers its collectives move (bytes, as XLA prints them)
    steps: tuple[tuple[SentKind, int, int], ...]  # (kind, group size, buffer bytes) in program order
    close: bool = False  # another way costs within CLOSE of it: XLA may take that one
    note: str = ""
    bound: OpBound | None = None  # where close: how far XLA's other way is from this one (:func:`between`)
    memory: int = 0  # the largest buffer set one of its ops touches (:func:`dry_run_memory`); 0: not ranked by it


def between(chosen: tuple[tuple[SentKind, int, int], ...], other: tuple[tuple[SentKind, int, int], ...]) -> OpBound:
    """How far XLA is from ``chosen`` where it runs ``other`` instead (two ways of one op, each a sequence of
    (kind, group size, buffer bytes)): the collectives as a multiset of kinds (the larger of those added and
    those dropped), the bytes sent the same way, and the larger of the buffers either way moves (its peak)."""
    from collections import Counter

    def kinds(steps: tuple[tuple[SentKind, int, int], ...]) -> Counter[str]:
        return Counter(k for k, n, _ in steps if n > 1)

    def sent(steps: tuple[tuple[SentKind, int, int], ...]) -> Counter[tuple[SentKind, int, int]]:
        return Counter((k, n, b) for k, n, b in steps if n > 1)

    a, b = sent(chosen), sent(other)
    added = sum(sent_bytes(k, n, x) * c for (k, n, x), c in (b - a).items())
    dropped = sum(sent_bytes(k, n, x) * c for (k, n, x), c in (a - b).items())
    collectives = max(sum((kinds(chosen) - kinds(other)).values()), sum((kinds(other) - kinds(chosen)).values()))
    # Peak: the buffers either way moves, as the default bound has it (report.default_bound): the lookup's
    # own peak gap is the memory walk's (tests/test_lookup_rules.py's LOOKUP_MEMORY), not the choice's.
    peak = max(sum(x for _, n, x in steps if n > 1) for steps in (chosen, other))
    return OpBound(collectives, float(max(added, dropped)), float(peak))


# Memories within this ratio leave XLA's choice to its communication estimate (and so to explain's CLOSE).
MEMORY_CLOSE = 1.1


def dry_run_memory(gathered: list[tuple[int, int]], lookup: tuple[int, int, int], summed: int) -> int:
    """The memory cost XLA's SPMD partitioner gives one way of partitioning a gather (its dry run,
    ``EvaluatePartitionCost``): the most bytes any one of the way's gathers or collectives touches, operands
    plus result (an all-reduce: its operand only, it sums in place).

    ``gathered``: each all-gather's (piece, gathered) bytes; ``lookup``: the local gather's (table, indices,
    result) bytes; ``summed``: the all-reduced buffer's bytes (0: none)."""
    return max([piece + full for piece, full in gathered] + [sum(lookup), summed])


def lookup_plans(
    table_piece: int, index_piece: int, result_piece: int, shared: int, free: int, rest: int
) -> tuple[LookupPlan, ...]:
    """The ways XLA can run the lookup, priced (pure arithmetic; see above).

    ``table_piece``/``index_piece``/``result_piece``: per-device bytes of the table, the indices and the result
    in the indices' split; ``shared``: devices of the split the table and the indices share; ``free``: devices of
    the mesh axes neither uses; ``rest``: devices of the table's indexed split the indices do not share.
    """
    plans: list[LookupPlan] = []
    table_steps: list[tuple[SentKind, int, int]]
    index_steps: list[tuple[SentKind, int, int]]
    if free > 1:
        g = math.gcd(free, shared)  # how many ways the moved split fits on the free devices
        gather = shared // g
        table_steps = [("collective-permute", 2, table_piece)]
        index_steps = [("collective-permute", 2, index_piece)]
        if gather > 1:
            table_steps.append(("all-gather", gather, table_piece * gather))
            index_steps.append(("all-gather", gather, index_piece * gather))
        table_steps.append(("all-reduce", g * rest, result_piece))
        # The summed result is split the moved way; where that is coarser than the indices' split it is sliced
        # before it moves back.  All-reduce + dynamic-slice is a reduce-scatter only where each device keeps
        # 1/n of the sum (n: the devices summing); a bigger piece is an all-reduce whose result is cut, as the
        # HLO reader reads it (einshard.testing.hlo) and as the bytes are: the whole buffer is summed.
        summed: SentKind = "reduce-scatter" if gather == shared * rest else "all-reduce"
        index_steps += [(summed, shared * rest, result_piece * gather), ("collective-permute", 2, result_piece)]
        if rest == 1:
            # Measured: only a table split wholly along the shared axes moves (a table split over more
            # axes than the indices share keeps its split; the indices move).
            plans.append(LookupPlan("move table", sum(b for _, _, b in table_steps), tuple(table_steps)))
        plans.append(LookupPlan("move indices", sum(b for _, _, b in index_steps), tuple(index_steps)))
    else:
        # XLA's partitioner dry-runs each way and ranks them by (memory, communication): the largest buffer set
        # one of its gathers or collectives touches first (:func:`dry_run_memory`), the bytes sent second
        # (an all-reduce sends its buffer twice).  So a table as large as the result is gathered rather than
        # the result all-reduced whole (its buffers are smaller by the gathered indices), and a table twice
        # the result is not (measured: t[16@b, 16@a] looked up by 8 ids split over b: XLA gathers the ids).
        whole = table_piece * shared
        index_steps = [
            ("all-gather", shared, index_piece * shared),
            # (1/shared of the sum kept: a reduce-scatter only where all the summing devices share the split)
            ("reduce-scatter" if rest == 1 else "all-reduce", shared * rest, result_piece * shared),
        ]
        sent_table = (shared - 1) / shared * whole
        sent_index = (shared - 1) / shared * index_piece * shared + 2 * result_piece * shared
        if rest == 1:  # as for moving it: only a table split wholly along the shared axes is gathered
            memory = dry_run_memory(
                gathered=[(table_piece, whole)], lookup=(whole, index_piece, result_piece), summed=0
            )
            plans.append(LookupPlan("gather table", sent_table, (("all-gather", shared, whole),), memory=memory))
        memory = dry_run_memory(
            gathered=[(index_piece, index_piece * shared)],
            lookup=(table_piece, index_piece * shared, result_piece * shared),
            summed=result_piece * shared,
        )
        plans.append(LookupPlan("gather indices", sent_index, tuple(index_steps), memory=memory))
    # Stable: ties go to the first listed (measured: the table moves).  The moved ways (free mesh axes) carry no
    # memory estimate (0): they are ranked by the bytes they move, as measured (tests/test_lookup_rules.py).
    ranked = sorted(plans, key=lambda p: (p.memory, p.cost))
    best = ranked[0]
    if len(ranked) == 1:
        return (best,)
    runner = ranked[1]
    # Near ties: XLA's own estimate may rank them the other way.  Where memory ranks (no free axes) the buffers
    # are the partitioner's own shapes, so only a memory tie within MEMORY_CLOSE leaves the choice open.
    memory_tie = runner.memory <= MEMORY_CLOSE * best.memory
    if memory_tie and runner.cost <= CLOSE * max(best.cost, 1.0):
        note = (
            f"a lookup split like its table: explain takes '{best.move}' ({best.cost:.0f} B), "
            f"XLA may '{runner.move}' ({runner.cost:.0f} B)"
        )
        return (replace(best, close=True, note=note, bound=between(best.steps, runner.steps)), runner)
    return (best, runner)


def choose_lookup(
    w: Walker,
    table: Layout,
    indices: Layout,
    masked: tuple[str, ...],
    wanted: list[tuple[str, ...]],
    out_aval: Any,
    idx_dtype: Any,
) -> LookupPlan:
    """The cheapest way (:func:`lookup_plans`) to run a lookup whose indices share the table's indexed split."""
    sizes = w.costs.mesh_sizes
    idx_used = {m for d in indices.dims for m in d}
    table_used = {m for d in table.dims for m in d}
    shared = math.prod(sizes[m] for m in masked if m in idx_used)
    rest = math.prod(sizes[m] for m in masked if m not in idx_used)
    free = math.prod(n for m, n in sizes.items() if m not in idx_used and m not in table_used)
    split = math.prod(sizes[m] for d in wanted for m in d)
    table_piece = math.prod(table.shard_shape) * itemsize(out_aval.dtype)
    index_piece = math.prod(indices.shard_shape) * itemsize(idx_dtype)
    result_piece = math.prod(out_aval.shape) // max(split, 1) * itemsize(out_aval.dtype)
    return lookup_plans(table_piece, index_piece, result_piece, shared, free, rest)[0]


def _record_lookup(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    plan: LookupPlan,
    axes: tuple[str, ...],
    out: Layout,
    what: str = "masked lookup",
) -> None:
    """Record a moved lookup's collectives over ``axes`` (the shared and free mesh axes; a group may be part
    of them: each is priced by its own size)."""
    colls = []
    for kind, n, array in plan.steps:
        if n <= 1:
            continue
        sent = sent_bytes(kind, n, array)
        t = w.costs.profile.collective_time(kind, n, sent, array)
        colls.append(Collective(kind, axes, n, int(sent), int(array), t, "operand 1", f"lookup: {plan.move}"))
    why = f"{what}, {plan.move} (the table is split where the indices are)"
    w.record(eqn, phase, why, out, tuple(colls), 0.0, sum(c.time for c in colls), repeat)


def moved_partial(
    w: Walker,
    out_aval: Any,
    wanted: list[tuple[str, ...]],
    masked: tuple[str, ...],
    free_axes: tuple[str, ...],
    plan: LookupPlan,
) -> Layout:
    """The layout of a moved lookup's partial result, held next to its sum while XLA all-reduces it (memory.py).

    "move indices": each device looks up the indices moved onto the free axes, so its partial result is split
    the moved way (the shared split's mesh axes replaced by as many free ones as it fits on: the gcd of the two),
    larger than the result's piece where the free devices are fewer; "move table": the result's own piece."""
    if plan.move != "move indices":
        return w.relayout(out_aval, wanted)
    sizes = w.costs.mesh_sizes
    shared = math.prod(sizes[m] for m in masked if any(m in d for d in wanted))
    ways = math.gcd(math.prod(sizes[m] for m in free_axes), shared)
    dims = [tuple(m for m in d if m not in masked) for d in wanted]
    at = next((k for k, d in enumerate(wanted) if set(d) & set(masked)), None)
    if at is not None:
        taken: tuple[str, ...] = ()
        for m in free_axes:
            if ways % (math.prod(sizes[a] for a in taken) * sizes[m]) == 0:
                taken += (m,)
        dims[at] = dims[at] + taken
    return w.relayout(out_aval, dims)


def fills(eqn: Any) -> bool:
    """Whether a gather or scatter drops out-of-bounds indices (``mode="fill"``): XLA masks them."""
    return "FILL" in str(eqn.params.get("mode", "")).upper()


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
    combining = adds or eqn.primitive.name.replace("_", "-") in COMBINING_SCATTERS
    owned = set() if is_free(operand) else {m for d in operand.dims for m in d}
    indexed_by, stray = _indices_split(updates, indices, by_index, set(idx_batch))
    clamped = "CLIP" in str(eqn.params.get("mode", "")).upper()
    if not clamped:
        # Indices split where their updates are split otherwise: measured on a lookup's gradient (the scatter-add
        # of jnp.take's transpose), where XLA gathers them once more only in mode "clip" (the scatter clamps its
        # indices itself: a value of its own); in the other modes they are the forward's, gathered already.
        stray = set()
    if not is_free(updates) and not is_free(indices):
        extra = {m for d in indexed_by for m in d} - {m for d in updates.dims for m in d}
        if extra and combining and not extra & owned:
            # Indices split along an axis the updates are whole on: each device scatters the updates its
            # indices pick (sliced locally) and XLA combines the devices' results (measured: x.at[i@a].add(u)
            # and .max(u), x and u whole: one all-reduce of x), as for updates split there.
            updates = updates.with_dims(indexed_by)
        else:
            stray |= extra
        if stray:
            # An overwrite, a result split over the indices' mesh axes, or updates that use them elsewhere:
            # XLA gathers the indices (measured: x.at[i@a].set(u), .add(u) into x[16@a, 16] or x[16, 16@a], and
            # the gradient of jnp.take(t[16@a, 16], i[8@a], axis=1): one all-gather of i).
            keep = tuple(tuple(m for m in d if m not in stray) for d in indices.dims)
            why = "scatter: indices split where the updates are not"
            # (Clamped, they are a value of their own, which no earlier move of the indices is: XLA's CSE shares
            # none with the forward's gathers of them, measured on jnp.take(t, i, mode='clip')'s gradient, its
            # forward and transpose calls inlined as XLA inlines them: the moves are not the walker's to reuse.)
            source = indices.with_dims(indices.dims) if clamped else indices
            w.change(eqn, phase, source, indices.with_dims(keep), eqn.invars[1].aval.dtype, repeat, why)
            indices = indices.with_dims(keep)
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
    if is_free(operand) and adds:
        # A window axis the caller asks split (the gradient of a table split on its features, returned in
        # the table's layout) is added into that piece only: each device keeps its slice of the updates
        # (measured: the sum runs on the piece, not on the whole table).
        want = asked_of_table(w, eqn.outvars[0]) or ()
        for o in op_window if len(want) == rank else ():
            ask = want[o]
            if ask and not dims[o] and not set(ask) & (used | set(split)):
                dims[o] = ask
                used |= set(ask)
    clash = tuple(m for m in split if m in used)
    if not is_free(operand):
        # The updates line up with the result: their window axes take the result's split (an update split
        # along a window axis the result keeps whole, or splits otherwise, moves: measured, u[8, 16@a] into
        # x[16@a, 16] is one all-gather of the updates, u[8@a, 16] into x[16, 16@a] one all-to-all); their
        # scatter axes give up the mesh axes that split the result too (each device writes the rows it holds
        # from every update: measured, x[16@a].at[i[8]].add(u[8@a]) gathers the updates), and the indices
        # are gathered with them (XLA lines them up with the updates' split first: whole indices too).
        target = [tuple(m for m in d if m not in clash) if k in scatter_axes else d for k, d in enumerate(updates.dims)]
        for u, o in zip(window, op_window):
            target[u] = dims[o] if updates.shape[u] == out_aval.shape[o] else ()
        before = updates
        if tuple(target) != updates.dims:
            moved_updates = updates.with_dims(tuple(target))
            w.change(eqn, phase, updates, moved_updates, updates_dtype(eqn), repeat, "scatter: updates line up")
            updates = moved_updates
        if clash:
            _gather_indices(w, eqn, phase, repeat, before, indices, by_index, clash)
        split = tuple(m for m in split if m not in clash)
    split = tuple(m for m in split if m not in used)
    dims = w.settle_repeats(eqn, phase, out_aval, dims, repeat, "scatter result split twice over a mesh axis")
    out = w.relayout(out_aval, dims)
    if adds and is_free(operand) and not split and not idx_batch:
        _scatter_over_idle_axes(w, eqn, phase, repeat, out, updates, indices, window)
    if split and adds and is_free(operand) and not idx_batch:
        # (the window axes the updates cover whole: not the indexed one, a window of size 1 there)
        whole_window = [o for u, o in zip(window, op_window) if updates.shape[u] == out_aval.shape[o]]
        summed = _scatter_sum_over_idle_axes(w, eqn, phase, repeat, dims, updates, indices, split, whole_window)
        if summed is not None:
            return [summed]
    if split and adds and is_free(operand):
        moved = _moved_scatter_add(w, eqn, phase, repeat, updates, indices, split, dims, window, op_window)
        if moved is not None:
            return [moved]
        whole = _summed_whole(w, eqn, phase, repeat, out, updates, split, window, op_window)
        if whole is not None:
            return [whole]
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
        w.env[Partial(eqn.outvars[0])] = out  # the partial buffer waits for its all-reduce (memory.py)
        return [out.with_dims(out.dims, pending)]
    if split and combining and not adds:
        # scatter-max / -min / -mul of split updates: as for an add, each device scatters its share into its
        # copy (the identity where it has no update) and XLA combines the copies with the scatter's own
        # combiner: one all-reduce of the whole result over the updates' split (measured: x.at[i].max(u) of
        # updates split over a, indices whole or split alike: one all-reduce of x's piece, no gather).  Not a
        # pending sum: an all-reduce with max / min / multiply cannot be carried through linear ops.
        piece = math.prod(out.shard_shape) * itemsize(out_aval.dtype)
        charge(w, eqn, phase, repeat, "all-reduce", split, [piece], "scatter combining split updates", out)
        w.env[Partial(eqn.outvars[0])] = out  # each device's copy is held next to the combined one (memory.py)
        return [out]
    if split:
        # A non-additive scatter needs every update on every device: gather them, and their indices.
        _gather_scatter_axes(w, eqn, phase, repeat, updates, indices, scatter_axes, by_index, split)
    return [out]


def _scatter_over_idle_axes(
    w: Walker, eqn: Any, phase: str, repeat: int, out: Layout, updates: Layout, indices: Layout, window: tuple[int, ...]
) -> None:
    """The transpose of a lookup moved onto the idle mesh axes (:func:`_lookup_over_idle_axes`): updates split along
    their window over mesh axes ``C`` that split the indices too, other mesh axes idle.  XLA scatters with the
    indices the lookup moved onto the idle axes (its CSE: the forward's permute and gather), the updates sliced
    alike, and all-reduces the result over the idle devices they cover (measured: the gradient of a (2, 32) table,
    features over 'data', by ids (8@data, 8) on (4, 2): one all-reduce of the table's piece over 'model')."""
    sizes = w.costs.mesh_sizes
    on_window = {m for u in window for m in updates.dims[u]}
    clash = tuple(m for d in indices.dims[:-1] for m in d if m in on_window)
    used = {m for lay in (updates, indices) for d in lay.dims for m in d}
    idle = tuple(m for m in sizes if m not in used and sizes[m] > 1)
    ways = math.gcd(math.prod(sizes[m] for m in clash), math.prod(sizes[m] for m in idle)) if clash else 1
    if ways <= 1:
        return
    piece = math.prod(out.shard_shape) * itemsize(eqn.outvars[0].aval.dtype)
    sent = sent_bytes("all-reduce", ways, piece)
    t = w.costs.profile.collective_time("all-reduce", ways, sent, piece)
    why = "scatter-add with the indices moved onto the idle mesh axes: the pieces summed over them"
    coll = Collective("all-reduce", idle, ways, int(sent), int(piece), t, "result", why)
    w.record(eqn, phase, why, out, (coll,), 0.0, t, repeat)


def _scatter_sum_over_idle_axes(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    dims: list[tuple[str, ...]],
    updates: Layout,
    indices: Layout,
    split: tuple[str, ...],
    op_window: Sequence[int],
) -> Layout | None:
    """A scatter-add into zeros (a lookup's gradient) whose updates' scatter axes split over mesh axes ``C`` (their
    sum pending over ``C``), asked back in a layout that splits one window axis the updates cover whole
    (``op_window``; not the indexed one, whose gradient :func:`_moved_scatter_add` moves) over ``C`` (a table split along its features), with idle
    mesh axes ``U``: XLA does not reduce-scatter the whole table over ``C``.  It
    either slices the updates' window axis over the idle devices (``g = gcd(|C|, |U|)`` ways), scatters into that
    piece, all-reduces it over ``C`` and slices and permutes it to the asked piece (the transpose of the table
    moved onto ``U``), or all-to-alls the updates to the asked split and scatters with the indices the lookup moved
    onto ``U``, all-reducing over them (the transpose of the indices moved): the cheaper by the bytes sent
    (measured, the gradient of sum((t[i] + x) ** 2): a (2, 32) table on (4, 2), (2, 4), (2, 2, 2) the first, a
    (64, 32) table on (4, 2) the second; tests/test_lookup_idle_axes.py).  None where it does not apply."""
    out_aval = eqn.outvars[0].aval
    want = asked_of_table(w, eqn.outvars[0])
    if want is None or len(want) != len(dims) or any(dims):
        return None
    asked = [o for o, d in enumerate(want) if d]
    if len(asked) != 1 or asked[0] not in op_window or set(want[asked[0]]) != set(split):
        return None
    sizes = w.costs.mesh_sizes
    used = {m for lay in (updates, indices) for d in lay.dims for m in d}
    idle = tuple(m for m in sizes if m not in used and sizes[m] > 1)
    n_split = math.prod(sizes[m] for m in split)
    ways = math.gcd(n_split, math.prod(sizes[m] for m in idle))
    if ways <= 1 or out_aval.shape[asked[0]] % n_split:
        return None
    whole = math.prod(out_aval.shape) * itemsize(out_aval.dtype)
    update_bytes = math.prod(updates.shard_shape) * itemsize(updates_dtype(eqn))
    by_table: list[IdleStep] = [
        ("all-reduce", n_split, whole // ways, split),
        ("collective-permute", 2, whole // n_split, split + idle),
    ]
    by_indices: list[IdleStep] = [
        ("all-to-all", n_split, update_bytes, split),
        ("all-reduce", ways, whole // n_split, idle),
    ]
    cost_table, cost_indices = _sent(by_table), _sent(by_indices)
    steps, other = (by_table, by_indices) if cost_table <= cost_indices else (by_indices, by_table)
    out = w.relayout(out_aval, [tuple(d) for d in want])
    colls = []
    for kind, n, array, axes in steps:
        sent = sent_bytes(kind, n, array)
        t = w.costs.profile.collective_time(kind, n, sent, array)
        colls.append(Collective(kind, axes, n, int(sent), int(array), t, "result", "scatter-add over the idle axes"))
    what = "the table's pieces" if steps is by_table else "the updates moved to the asked split"
    why = f"scatter-add of a lookup moved onto the idle mesh axes: {what} summed"
    start = len(w.ops)
    w.record(eqn, phase, why, out, tuple(colls), 0.0, sum(c.time for c in colls), repeat)
    if max(cost_table, cost_indices) <= CLOSE * max(min(cost_table, cost_indices), 1.0):
        note = f"{IDLE_SCATTER_CLOSE_NOTE} ({cost_table:.0f} B against {cost_indices:.0f} B sent)"
        mark_approximate(w, start, note, between(_plain(steps), _plain(other)))
    return out


IDLE_SCATTER_CLOSE_NOTE = (
    "a lookup's gradient asked split where its updates are summed, with idle mesh axes: XLA sums the table's "
    "pieces there or moves the updates to the asked split by its own cost estimate, and the two are close"
)


def _indices_split(
    updates: Layout, indices: Layout, by_index: dict[int, int], batching: set[int]
) -> tuple[tuple[tuple[str, ...], ...], set[str]]:
    """The updates' split with the indices' split on the scatter axes the updates are whole on (and the same
    length), where those mesh axes are free in the updates; and the indices' other mesh axes that their
    updates' scatter axes do not share (split otherwise, or used elsewhere in the updates)."""
    dims = list(updates.dims)
    used = {m for d in dims for m in d}
    stray: set[str] = set()
    for k, u in by_index.items():
        d = indices.dims[k]
        if k in batching or not d or d == dims[u]:
            continue
        if dims[u] or indices.shape[k] != updates.shape[u] or set(d) & used:
            stray |= set(d) - set(dims[u])
            continue
        dims[u] = d
        used |= set(d)
    return tuple(dims), stray


def _gather_scatter_axes(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    updates: Layout,
    indices: Layout,
    scatter_axes: list[int],
    by_index: dict[int, int],
    axes: tuple[str, ...],
) -> Layout:
    """Gather a scatter's updates along their scatter axes over ``axes``, and their indices with them (XLA lines
    the indices up with the updates' split first: measured, whole indices are gathered too)."""
    whole = updates.with_dims(
        tuple(tuple(m for m in d if m not in axes) if k in scatter_axes else d for k, d in enumerate(updates.dims))
    )
    w.change(eqn, phase, updates, whole, updates_dtype(eqn), repeat, "scatter of split updates")
    _gather_indices(w, eqn, phase, repeat, updates, indices, by_index, axes)
    return whole


def _gather_indices(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    updates: Layout,
    indices: Layout,
    by_index: dict[int, int],
    axes: tuple[str, ...],
) -> None:
    """Gather a scatter's indices over ``axes``, split first like the updates' scatter axes they index."""
    if not is_free(indices):
        idx_split = indices.with_dims(
            tuple(updates.dims[by_index[k]] if k in by_index else () for k in range(len(indices.shape)))
        )
        own = w.env.get(eqn.invars[1]) if not hasattr(eqn.invars[1], "val") else None
        if own is not None and own.dims == idx_split.dims and not own.unreduced:
            # Split so already: the value's own layout, so that its gather is made once for every reader
            # (change()'s memo, XLA's CSE: the gradient's lookup at the same indices reuses it).
            idx_split = own
        elif _indices_take_updates_split(w, eqn, idx_split):
            # The split is the value's own from here on: a later reader (the gradient's gather of the cotangent
            # at these indices) reads them split, and their gather here is made once (XLA's CSE).
            idx_split = w.relay(eqn.invars[1], idx_split)
        idx_whole = idx_split.with_dims(tuple(tuple(m for m in d if m not in axes) for d in idx_split.dims))
        w.change(eqn, phase, idx_split, idx_whole, eqn.invars[1].aval.dtype, repeat, "scatter: the updates' indices")


def _indices_take_updates_split(w: Walker, eqn: Any, split: Layout) -> bool:
    """Whether XLA's propagation gives a scatter's indices the split of the updates' scatter axes as their own.

    Shardy's scatter rule shares a factor between the updates' scatter axes and the indices' batch axes, so a
    computed index array (``x.at[i]``'s broadcast of ``i``, whole so far: any split of it is a local slice)
    takes the updates' split, and every reader sees it split: measured, the gradient of ``x.at[i].add(u)`` with
    ``x[16@a, 16]``, ``u[8@a, 16]``, ``i`` whole: the forward gathers the indices once (as explain did) and the
    backward's masked gather of the cotangent at them sums its result onto their split (a reduce-scatter) where
    explain all-reduced it whole.  Not for an argument or a placed value (its split is the user's), a program
    output, or a value another op has read already or an elementwise reader wants laid out otherwise
    (:func:`.upstream.readers_agree`)."""
    value = eqn.invars[1]
    if hasattr(value, "val") or id(value) in w.pinned or id(value) in w.program_outputs:
        return False
    lay = w.env.get(value)
    if lay is None or is_free(lay) or lay.unreduced or any(lay.dims) or not any(split.dims):
        return False
    if home_of(w.costs, value) is None:  # a call body's argument: the caller's value, laid out there
        return False
    return readers_agree(w, value, split.dims, {id(eqn)})


# Scatters whose combiner XLA applies across devices to updates split along their scatter axes (an all-reduce
# with that combiner); a plain scatter (overwrite) is not associative and gathers its updates instead.
COMBINING_SCATTERS = frozenset({"scatter-max", "scatter-min", "scatter-mul"})


# Adds of two same-shaped values: a gradient summed over several uses (a table looked up twice, T5's shared
# embedding): the layout asked of the sum is asked of each addend (XLA propagates the sharding both ways).
GRADIENT_SUMS = frozenset({"add_any", "add"})


def requested_dims(w: Walker, var: Any) -> tuple[tuple[str, ...], ...] | None:
    """The layout the caller asks for the program output ``var`` becomes (``report(out_specs=)``), if any.

    Followed through the ops that carry a value to the output unchanged but for its dtype, through gradient
    sums (:data:`GRADIENT_SUMS`), through a nested call's results (:func:`~.registry.call_rule` hands the call's
    requested layouts to its body), and through a piece placed into a stacked whole: a broadcast that only adds
    unit axes, then a pad along them (the transpose of a layer's slice of stacked weights: the layer's weight
    gradient at its row of the stacked gradient, asked the stacked one's split on the axes it keeps; measured,
    FSDP on a decoder whose unrolled layers slice stacked weights: XLA reduce-scatters each layer's weight gradient).
    """
    return _asked(w, var, False)


def _asked(w: Walker, var: Any, transposes: bool) -> tuple[tuple[str, ...], ...] | None:
    """The split asked of what ``var`` becomes along its chain (:func:`_ask_chain`), kept with the copy the segment
    memo records where the chain leaves the copy (a layer's weight gradient reaches the stacked gradient's output
    through every later layer's gradient sum, past any horizon): answered unlogged and kept with the tape, which
    another copy replays where its own answer is alike (:func:`asks_hold`); a chain within the copy is read through
    the walk's tables, as any look-ahead."""
    chain = _ask_chain(w, var, transposes)
    rec = getattr(w.uses, "rec", None)
    if not isinstance(rec, Recorder) or rec.why:
        return _ask_answer(w, chain, False)
    copy = rec.copy
    if all(i in copy.tokens for i in chain.ids):
        return _ask_answer(w, chain, True)
    if chain.placed is None and not chain.returned:
        return None  # (only what the program returns is asked for: a chain reaching none is asked nothing, ever)
    answer = _ask_answer(w, chain, False)
    tok = copy.tokens.get(id(var))
    if tok is None or tok[0] != "i":
        rec.leave("the layout asked of a value past the copy")
    else:
        rec.asks.append((tok, transposes, answer))
    return answer


def asks_hold(asks: Sequence[tuple[Any, bool, Any]], copy: Any, w: Walker) -> bool:
    """Whether the layouts asked of ``copy``'s values past itself are those a tape's walk found (SegmentTape.asks)."""
    answers, chains = w.asked_answers, w.costs.ask_chains
    for tok, transposes, answer in asks:
        var = copy.value(tok)
        chain = chains.get((id(var), transposes))
        if chain is None or chain.var is not var:
            chain = _ask_chain(w, var, transposes)
        got = answers.get(chain.signature, _UNSEEN)
        if got is _UNSEEN:
            got = answers[chain.signature] = _ask_answer(w, chain, False)
        if got != answer:
            return False
    return True


@dataclass(frozen=True)
class _AskChain:
    """The values a layout asked of ``var`` is looked for at, in order: each one's id and axis map (its axis ``j``
    is ``var``'s ``axis_of[j]``, -1: none), and the split a placement reading the last one asks (None: none)."""

    var: Any
    ids: tuple[int, ...]
    axes: tuple[tuple[int, ...], ...]
    placed: Sequence[tuple[str, ...]] | None
    # (place, id) of those the walking jaxpr returns, in order: the only ones a layout may be asked of (the caller
    # lays out its outputs; a call body's walk is asked of its results)
    returned: tuple[tuple[int, int], ...]
    # What the answer is a function of besides the layouts asked: the chains of two copies' values to one output
    # have one signature (asks_hold answers them once per walk).
    signature: Hashable


def _ask_chain(w: Walker, var: Any, transposes: bool) -> _AskChain:
    """The chain :func:`asked_of_result` (``transposes``: followed, their axes mapped back) and
    :func:`requested_dims` (a transpose ends it) look along: through the single reader of each value that only
    carries it to the output, found once per value (read plainly: a recording keeps the answer, not the reads)."""
    table = w.costs.ask_chains
    hit = table.get((id(var), transposes))
    if hit is not None and hit.var is var:
        return hit
    uses_get = functools.partial(dict.get, w.uses)
    rank = len(getattr(var.aval, "shape", ()))
    v, axis_of = var, tuple(range(rank))
    ids: list[int] = []
    axes: list[tuple[int, ...]] = []
    placed = None
    home = home_of(w.costs, var)  # (None: an argument; any value along its chain may then be asked of)
    outs = None if home is None else {id(o) for o in home.jaxpr.outvars}
    returned: list[tuple[int, int]] = []
    for _ in range(MAX_STEPS):
        if outs is None or id(v) in outs:
            returned.append((len(ids), id(v)))
        ids.append(id(v))
        axes.append(axis_of)
        uses: Any = uses_get(id(v), [])
        if len(uses) != 1:
            break
        user, k = uses[0]
        name = user.primitive.name
        if name in PLACEMENTS:
            placed = placement_dims(user) or None  # an Explicit program's reshard, an auto_axes exit
            break
        if name == "transpose":
            if not transposes:
                break
            axis_of = _transposed(user, axis_of)
        elif name == "broadcast_in_dim" and k == 0 and _adds_unit_axes(user, v):
            axis_of = _broadcast(user, v, axis_of)
        elif name == "pad" and k == 0:
            axis_of = _padded(user, axis_of)
        elif name not in CARRIERS | GRADIENT_SUMS or getattr(user.outvars[0].aval, "shape", None) != getattr(
            v.aval, "shape", None
        ):
            break
        v = user.outvars[0]
    signature = (
        tuple((i, axes[n]) for n, i in returned),
        None if placed is None else (tuple(placed), axes[-1]),
        rank,
    )
    chain = _AskChain(var, tuple(ids), tuple(axes), placed, tuple(returned), signature)
    table[(id(var), transposes)] = chain
    return chain


def _ask_answer(w: Walker, chain: _AskChain, logged: bool) -> tuple[tuple[str, ...], ...] | None:
    """The split asked along ``chain``: the first of its values the caller lays out, else its placement's, in
    ``chain.var``'s axis order.  ``logged``: read through the walk's tables value by value (a recording logs them);
    else only the values a layout may be asked of are looked up."""
    requested = w.requested
    first = -1
    if logged:
        for n, i in enumerate(chain.ids):
            w.uses.get(i)  # (the walk's read of its reader)
            if requested.get(i) is not None:
                first = n
                break
    else:
        first = next((n for n, i in chain.returned if dict.get(requested, i) is not None), -1)
    rank = len(chain.axes[0])
    if first >= 0:
        asked: Any = dict.get(requested, chain.ids[first])
        return _mapped_back(asked, chain.axes[first], rank)
    return None if chain.placed is None else _mapped_back(chain.placed, chain.axes[-1], rank)


def _mapped_back(asked: Sequence[tuple[str, ...]], axis_of: tuple[int, ...], rank: int) -> tuple[tuple[str, ...], ...]:
    """The split ``asked`` of a value whose axis ``j`` is the searched value's ``axis_of[j]`` (-1: none of its own),
    in the searched value's axis order (an axis nothing asks of: whole)."""
    dims: list[tuple[str, ...]] = [() for _ in range(rank)]
    for j, d in enumerate(asked):
        if j < len(axis_of) and axis_of[j] >= 0:
            dims[axis_of[j]] = tuple(d)
    return tuple(dims)


def asked_of_table(w: Walker, var: Any) -> tuple[tuple[str, ...], ...] | None:
    """The split asked of a scatter-add's result (a lookup table's gradient): a program output's
    (:func:`requested_dims`), else the split an elementwise reader's partner carries from a layout the user fixed
    (:func:`_elementwise_reader_split`, seeded): the optimizer's moment in ``0.9 * mu + 0.1 * g`` reaches the
    gradient in Shardy's elementwise-first pass before the scatter settles it, as an output's sharding does
    (measured: an FSDP table's momentum or Adam step moves its scatter-add as its gradient returned split does,
    tests/test_fsdp_gradient_rules.py)."""
    want = requested_dims(w, var)
    return want if want is not None else _elementwise_reader_split(w, var, seeded=True)


# Primitives whose result reads the split asked of it (:func:`asked_of_table`): a call's body result they make is
# handed the ask its readers outside make (jnp.take's transpose is a scatter-add inside a nested jit).
_READS_ITS_ASK = frozenset({"scatter-add", "scatter_add"})
# id(jaxpr) -> (the jaxpr, held so its ids stay its values', the ids of its results a _READS_ITS_ASK op makes)
_ASK_READERS: weakref.WeakKeyDictionary[Any, dict[int, tuple[Any, frozenset[int]]]] = weakref.WeakKeyDictionary()


def asked_of_call_result(w: Walker, outer: Any, inner: Any, body: Any) -> tuple[tuple[str, ...], ...] | None:
    """The split asked of a call's result ``outer`` that the call hands to its body's ``inner``: a program
    output's (:func:`requested_dims`), and, where ``inner`` is made by an op that reads its ask (a scatter-add:
    :func:`asked_of_table`), the one the readers outside make of it."""
    want = requested_dims(w, outer)
    if want is not None:
        return want
    table = _ASK_READERS.setdefault(w.costs, {})
    hit = table.get(id(body))
    if hit is None or hit[0] is not body:
        made = frozenset(id(o) for e in body.eqns if e.primitive.name in _READS_ITS_ASK for o in e.outvars)
        hit = table[id(body)] = (body, made)
    return _elementwise_reader_split(w, outer, seeded=True) if id(inner) in hit[1] else None


def _moved_scatter_add(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    updates: Layout,
    indices: Layout,
    split: tuple[str, ...],
    dims: list[tuple[str, ...]],
    window: tuple[int, ...],
    op_window: list[int],
) -> Layout | None:
    """The transpose of a moved lookup (:func:`lookup_plans`): a scatter-add into zeros whose result is asked
    for split along the scattered axis over the very mesh axes its updates are split over (an FSDP embedding
    table's gradient).  XLA mirrors the forward's way: "move indices" moves the updates onto the free axes (a
    collective-permute, plus an all-gather where they are fewer devices), adds them into each device's piece of
    the table and all-reduces that piece over the free axes; "move table" sums the piece where the table moved
    and permutes it back.  Measured on one-op programs (tests/test_lookup_rules.py).  None: not that case, or
    the cheapest way is to gather (the caller's pending sum is then reduce-scattered where it is asked)."""
    out_aval = eqn.outvars[0].aval
    want = asked_of_table(w, eqn.outvars[0])
    if want is None or len(want) != len(dims) or is_free(updates) or is_free(indices):
        return None
    scattered = scattered_axes(out_aval.shape, updates.shape, window, op_window)
    table_split = tuple(m for i in scattered for m in want[i])
    if not table_split or set(table_split) != set(split):
        return None
    sizes = w.costs.mesh_sizes
    used = {m for d in updates.dims for m in d} | {m for d in indices.dims for m in d} | {m for d in want for m in d}
    free_axes = tuple(m for m in sizes if m not in used)
    shared = math.prod(sizes[m] for m in split)
    free = math.prod(sizes[m] for m in free_axes)
    if free <= 1:
        return None
    table = w.relayout(out_aval, want)
    table_piece = math.prod(table.shard_shape) * itemsize(out_aval.dtype)
    update_piece = math.prod(updates.shard_shape) * itemsize(out_aval.dtype)
    index_piece = math.prod(indices.shard_shape) * itemsize(indices_dtype(eqn))
    # The forward's choice, priced as the forward's pieces: the cotangent is the lookup's result.
    plan = lookup_plans(table_piece, index_piece, update_piece, shared, free, 1)[0]
    g = math.gcd(free, shared)
    gather = shared // g
    indices_moved: list[tuple[SentKind, int, int]] = []
    # The updates move as the forward's indices did; in mode "clip" the indices move again with them (the
    # scatter clamps them itself: a value of its own, not the forward's moved one), measured: jnp.take(t[64@a,
    # 32], i[8@a, 8], mode="clip")'s gradient on (4, 2) permutes and gathers the s32[2, 8, 1] ids twice, in
    # mode "fill" once.
    moved_pieces = [update_piece, index_piece] if "CLIP" in str(eqn.params.get("mode", "")).upper() else [update_piece]
    for piece in moved_pieces:
        indices_moved.append(("collective-permute", 2, piece))
        if gather > 1:
            indices_moved.append(("all-gather", gather, piece * gather))
    indices_moved.append(("all-reduce", g, table_piece))
    table_moved: list[tuple[SentKind, int, int]] = [
        ("all-reduce", g, table_piece * gather),
        ("collective-permute", 2, table_piece),
    ]
    steps, other = (indices_moved, table_moved) if plan.move == "move indices" else (table_moved, indices_moved)
    start = len(w.ops)
    moved = replace(plan, steps=tuple(steps))
    axes = tuple(m for m in sizes if m in split or m in free_axes)
    _record_lookup(w, eqn, phase, repeat, moved, axes, table, "scatter-add into the table's pieces")
    # Each device's scatter into its piece of the table is a partial sum, held next to the all-reduced piece
    # (measured: XLA:CPU's wrapped_scatter and all-reduce buffers, both the table's piece).
    w.env[Partial(eqn.outvars[0])] = table
    if plan.close:
        # The other way is the forward's runner-up, mirrored: the bound is the difference between the two.
        mark_approximate(w, start, plan.note, between(tuple(steps), tuple(other)))
    return table


def _summed_whole(
    w: Walker,
    eqn: Any,
    phase: str,
    repeat: int,
    out: Layout,
    updates: Layout,
    split: tuple[str, ...],
    window: tuple[int, ...],
    op_window: list[int],
) -> Layout | None:
    """A scatter-add into zeros asked split along its scattered axis over some, not all, of the mesh axes its
    updates are split over (a table t[16@b] looked up by ids split over (a, b), its gradient in t's layout):
    each device adds its updates into the whole table, and XLA all-reduces the whole table over all of those
    axes, then slices its piece (measured: one all-reduce of f32[16, 16] over 8 devices; not the dot's
    reduce-scatter over b and all-reduce over a, which the pending sum would be).  The table's rows over the
    updates' own mesh axis would need every device's updates: the scatter runs on the whole table.  None: not
    that case."""
    out_aval = eqn.outvars[0].aval
    want = asked_of_table(w, eqn.outvars[0])
    if want is None or len(want) != len(out.dims):
        return None
    scattered = scattered_axes(out_aval.shape, updates.shape, window, op_window)
    asked = {m for i in scattered for m in want[i]}
    if not asked or not asked < set(split):
        return None
    piece = math.prod(out.shard_shape) * itemsize(out_aval.dtype)
    result = w.relayout(out_aval, want)
    charge(w, eqn, phase, repeat, "all-reduce", split, [piece], "scatter-add summed whole, then sliced", result)
    w.env[Partial(eqn.outvars[0])] = out  # each device's whole partial table, held next to its sum (memory.py)
    return result


def scattered_axes(
    shape: tuple[int, ...], update_shape: tuple[int, ...], window: tuple[int, ...], op_window: list[int]
) -> list[int]:
    """The operand axes a scatter writes at indexed points: those its windows do not span whole.

    Inserted axes, and window axes of size 1 on a longer axis too: a scalar index per row (Equinox's
    ``weight[token]`` under ``vmap``) gathers with a full index vector and ``slice_sizes=(1, d)``, no axis
    collapsed, and its transpose scatters windows ``(1, d)`` with nothing inserted; both are lookups of rows."""
    spanned = {o for u, o in zip(window, op_window) if update_shape[u] == shape[o]}
    return [i for i in range(len(shape)) if i not in spanned]


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
    # An update at a constant offset that lies inside one block of the split is written by the devices that
    # hold that block: nothing of the operand is gathered there (measured: x[16@a, 16@b] updated by
    # u[16@(a,b), 8] at (i, 0) on (4, 2) only gathers u over b, to x's rows; at 8 columns of a 4-way split, two
    # blocks, XLA gathers the columns).
    cut = [i for i in cut if not _inside_one_block(w, eqn, operand, update, i)]
    if not any(update.shape[i] != 1 for i in cut):
        cut = []
    if cut and not is_free(operand):
        dims = list(operand.dims)
        whole = operand
        for i in reversed(cut):
            # each step from the one before (the walker follows it to the value: a dynamic_slice of the same
            # value gathered alike reuses the copy, as XLA's CSE does in this op's gradient)
            dims[i] = ()
            gathered = operand.with_dims(tuple(dims))
            w.change(eqn, phase, whole, gathered, out_aval.dtype, repeat, "dynamic_update_slice cuts a split axis")
            whole = gathered
        w.bind_copy(eqn.invars[0], whole)  # the gathered copy is live while the update is written
        if not is_free(update):
            # Along a dimension the update spans whole and the operand leaves whole, the update's split is
            # the write's, as an elementwise operand's is: the operand is sliced to it (free), not the update
            # gathered (measured: x[16, 16@a] updated by u[16@b, 8] at (i, 0) on (4, 2) gathers x's columns only,
            # 1024 B, and the result is [16@b, 16@a]).
            # (not on a mesh axis the operand splits: the result keeps the operand's split, x[16, 16@a] by
            # u[16@a, 8] gathers both)
            lined, used = list(whole.dims), {m for d in operand.dims for m in d}
            for i, (d, a, b) in enumerate(zip(update.dims, update.shape, operand.shape)):
                if a == b and d and not lined[i] and not used & set(d):
                    lined[i], used = d, used | set(d)
            if tuple(lined) != whole.dims:
                whole = whole.with_dims(tuple(lined))
            want = tuple(d if a == b else () for d, a, b in zip(whole.dims, update.shape, operand.shape))
            if want != update.dims:
                at = len(w.ops)
                w.change(eqn, phase, update, update.with_dims(want), out_aval.dtype, repeat, "update lines up")
                mark_gather_then_shift(w, at, update, want, out_aval.dtype)
        # The result takes the split the operand and the update merge to (_update_target: the operand's along the
        # cut axes); where that is the operand's, the written copy is sliced back locally.  Where they disagree
        # along an axis the update spans, the written copy is moved there (measured: x[16@b, 16@a] updated by
        # u[16@(a,b), 8] at (i, 0) on (4, 2) writes at [16@b, 16] and XLA brings the result to [16, 16@a], by a
        # whole gather: marked where that turns on the device order, movement.mark_swap).
        target = _update_target(operand, update) if not is_free(update) else operand.dims
        if target == operand.dims:
            return [w.relayout(out_aval, operand.dims)]
        written = w.relayout(out_aval, whole.dims)
        out = written.with_dims(target)
        at = len(w.ops)
        w.change(
            eqn, phase, written, out, out_aval.dtype, repeat, "dynamic_update_slice: the result to its merged split"
        )
        mark_swap(w, at, written, target, out_aval.dtype)
        return [out]
    target = _update_target(operand, update)
    # XLA's partitioner writes the update at the finer of the operand's split and the result's (Shardy's merge,
    # _update_target), and the result is brought to the merge after the write; a result whole everywhere is
    # written whole (measured: x[16@a, 16@b] updated by u[16@b, 16] writes at x's split, the update sliced and
    # permuted there, and gathers the result to [16, 16@b]; x[16@a, 16] by u[16, 16@b] writes at [16@a, 16@b]).
    work = target
    if is_split(target) and split_ways(w, operand.dims) > split_ways(w, target):
        work = operand.dims
    # An update as large as its operand replaces all of it (XLA's simplifier drops the write and the operand):
    # only the update moves, to the split the two merged to (measured: x[16@b, 16] updated by u[16@(a,b), 16]
    # all-gathers u whole, and nothing of x).
    if work != operand.dims and update.shape != operand.shape:
        # Where the update spans the operand the two meet dimension by dimension (_update_target): the
        # operand is sliced locally to a finer split, gathered off one they do not share.
        w.change(eqn, phase, operand, operand.with_dims(work), out_aval.dtype, repeat, "operand lines up")
    if not is_free(update):
        want = tuple(d if a == b else () for d, a, b in zip(work, update.shape, operand.shape))
        if want != update.dims:
            at = len(w.ops)
            w.change(eqn, phase, update, update.with_dims(want), out_aval.dtype, repeat, "update lines up")
            mark_gather_then_shift(w, at, update, want, out_aval.dtype)
    out = w.relayout(out_aval, work)
    if work != target:
        moved = out.with_dims(target)
        w.change(eqn, phase, out, moved, out_aval.dtype, repeat, "dynamic_update_slice: the result to its merged split")
        out = moved
    return [out]


def _inside_one_block(w: Walker, eqn: Any, operand: Layout, update: Layout, i: int) -> bool:
    """Whether the update of ``eqn`` (a dynamic_update_slice) lies inside one block of ``operand``'s split along
    axis ``i``: its offset there a literal (XLA clamps it into the operand, as here), its extent within one block."""
    start = eqn.invars[2 + i]
    if not hasattr(start, "val"):
        return False  # a run-time offset: the update lands anywhere
    length, size = int(operand.shape[i]), int(update.shape[i])
    ways = split_ways(w, (operand.dims[i],))
    if length % ways:
        return False
    block = length // ways
    first = min(max(int(start.val), 0), length - size)
    return first // block == (first + size - 1) // block


def is_split(dims: tuple[tuple[str, ...], ...]) -> bool:
    return any(dims)


def split_ways(w: Walker, dims: tuple[tuple[str, ...], ...]) -> int:
    """How many blocks a split makes (the product of its mesh axes' sizes)."""
    return math.prod(w.costs.mesh_sizes[m] for d in dims for m in d)


def _update_target(operand: Layout, update: Layout) -> tuple[tuple[str, ...], ...]:
    """The result's split of an update that cuts no split axis of its operand, as XLA's propagation merges them:
    along an axis the update spans, the operand and the update are one dimension of an elementwise op
    (:func:`.rules_structural.merged_split`: the longer split where one extends the other, measured: a whole
    (16, 16) operand updated by a (16, 16) update split over a keeps the update's split, no collective; only
    the prefix they share where they differ, measured: x[16@b, 16] and u[16@(a,b), 8] give a whole result, both
    gathered), where the added mesh axes are free in the operand; along an axis it cuts, the operand's split
    (an update split there is gathered: it lands anywhere)."""
    # The dimensions the merge leaves shorter first (they free their mesh axes: x[16, 16@a] updated by u[16@a, 16@b]
    # drops a from the columns and the rows take it, [16@a, 16], u gathered over b only, 256 B; measured), then
    # those it extends, where the added mesh axes are free.
    dims = list(operand.dims)
    longer = []
    for i, (d, u, a, b) in enumerate(zip(operand.dims, update.dims, update.shape, operand.shape)):
        if a != b or u == d:
            continue
        merged = merged_split([d, u])
        if len(merged) > len(d):
            longer.append((i, merged))
        else:
            dims[i] = merged
    used = {m for d in dims for m in d}
    for i, merged in longer:
        added = set(merged) - set(dims[i])
        if not added & used:
            used |= added
            dims[i] = merged
    return tuple(dims)
