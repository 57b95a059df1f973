"""Layout rules for control flow and explicit placement: scan, shard_map and its collectives, constraints.

``sharding_constraint``/``reshard``/``device_put`` bring a value to the layout
they name.  A ``reshard`` into an Auto region (``jax.sharding.auto_axes``, JAX's
documented route for non-explicit code on Explicit meshes) leaves the Auto
axes to XLA: the value keeps its split there, it is not replicated.  Inside a
``shard_map`` body every collective is written out and priced on the local
block it moves.  A ``scan`` body's cost counts once per iteration.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ...core.collectives import CollectiveKind
from ...core.layout import Layout
from ..cost import RING_BYTES, Collective
from ..einsum.plan import side_string
from ..einsum.read import spec_partitions
from .costing import is_free
from .lookahead import MAX_STEPS, home_of
from .movement import APPROXIMATE, idle_slice_sum
from .registry import WalkerLike, inherit, register
from .report import OpBound, default_bound
from .rules_indexing import consumer_split
from .rules_loops import invariant_values
from .rules_structural import typed_dims
from .values import dtype_itemsize

__all__ = ["MANUAL_COLLECTIVES", "scan_body", "scan_counts", "scan_groups"]

MANUAL_COLLECTIVES: dict[str, CollectiveKind] = {
    "psum": "all-reduce",
    "psum2": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "psum_scatter": "reduce-scatter",
    "ppermute": "collective-permute",
    "all_to_all": "all-to-all",
}


def _entry_dims(entry: Any) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@register("sharding_constraint", "reshard", "device_put")
def constraint(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    sh = eqn.params.get("sharding") or eqn.params.get("dst_sharding")
    if isinstance(sh, (list, tuple)):
        sh = sh[0] if sh else None
    spec = getattr(sh, "spec", None)
    if spec is None:
        return ins[: len(eqn.outvars)]
    src = ins[0]
    aval = eqn.outvars[0].aval
    # Auto axes of a reshard's target mesh are XLA's to choose (an auto_axes region): keep the value's split there.
    mesh = getattr(sh, "mesh", None)
    auto: set[str] = set()
    if eqn.primitive.name == "reshard" and mesh is not None:
        types = getattr(mesh, "axis_types", ())
        auto = {n for n, t in zip(mesh.axis_names, types) if "Auto" in str(t)}
    entries = list(spec)
    dims: list[tuple[str, ...]] = []
    for i in range(len(aval.shape)):
        e = entries[i] if i < len(entries) else None
        if e is not None and "UNCONSTRAINED" in str(e).upper() and not isinstance(e, (str, tuple)):
            dims.append(src.dims[i] if i < len(src.dims) else ())
            continue
        dims.append(_entry_dims(e))
    if auto and not is_free(src):
        taken = {m for d in dims for m in d}
        dims = [d + tuple(m for m in s if m in auto and m not in taken) for d, s in zip(dims, src.dims)]
    dst = w.relayout(aval, dims)
    if is_free(src):
        return [dst]
    src = _dot_made_at_placement(w, eqn, src, dst, repeat, phase)
    w.change(eqn, phase, src, dst, aval.dtype, repeat, f"{eqn.primitive.name}")
    return [dst]


def _dot_made_at_placement(w: WalkerLike, eqn: Any, src: Layout, dst: Layout, repeat: int, phase: str) -> Layout:
    """The placement's input as XLA makes it where a dot makes that input and the placement gathers one of the dot's
    free axes: Shardy carries the sharding constraint back onto the dot's result (through transposes composing to
    none, each read once), so the partitioner computes the dot at the placement's split and gathers the operand
    owning that axis, not the result (XLA's CSE shares a gather of that operand made before: the forward's).  The
    gathers are charged here, the dot's result (and the transposes) laid out anew without the gathered axes, as
    the buffer XLA writes; that layout is returned, the move left to the placement.

    Measured (tests/test_dot_at_placement.py): the weight gradient g[512, 10]^T . h[512, 32@model] leaving an
    ``auto_axes`` region replicated gathers h (32 KiB sent) rather than the (10, 32) gradient (640 B), whatever
    the sizes: the choice is the propagation's, not a cost.  Not carried back: a jit's ``out_shardings`` on Auto
    axes (no constraint: XLA gathers the gradient), a real transpose or a dtype conversion between (measured:
    XLA gathers the product)."""
    found = _dot_behind(w, eqn.invars[0])
    if found is None or src.unreduced or len(src.dims) != len(dst.dims):
        return src
    dot, chain = found
    owners = _free_axis_owners(dot)
    bound = [w.env.get(v) for v in dot.invars[:2]]
    operands = [o for o in bound if o is not None and not is_free(o)]
    made = w.env.get(dot.outvars[0])
    if typed_dims(dot.outvars[0].aval) is not None or len(operands) != 2 or made is None or made.unreduced:
        return src
    kept = {m for d in dst.dims for m in d}
    gathered: dict[int, list[tuple[str, ...]]] = {}
    left = list(src.dims)
    for i, (have, want) in enumerate(zip(src.dims, dst.dims)):
        dropped = tuple(m for m in have if m not in want)
        if not dropped:
            continue
        owner = owners.get(i)
        if owner is None or kept & set(dropped):
            return src  # a batch axis (both operands own it) or a split moved, not gathered: the plain move
        k, axis = owner
        if not set(dropped) <= set(operands[k].dims[axis]):
            return src  # the result's split is not the operand's (a sum landed there): the plain move
        dims = gathered.setdefault(k, list(operands[k].dims))
        dims[axis] = tuple(m for m in dims[axis] if m not in dropped)
        left[i] = tuple(m for m in have if m in want)
    if not gathered:
        return src
    for k, dims in gathered.items():
        var = dot.invars[k]
        whole = w.relayout(var.aval, dims)
        w.change(dot, phase, operands[k], whole, var.aval.dtype, repeat, "dot operand gathered to a placement's split")
        w.bind_copy(var, whole)
    for var, axis_of in chain:
        placed: list[tuple[str, ...]] = [()] * len(left)
        for i, a in enumerate(axis_of):
            placed[a] = left[i]
        w.relay(var, w.relayout(var.aval, placed))
    return w.env[eqn.invars[0]]


def _dot_behind(w: WalkerLike, var: Any) -> tuple[Any, list[tuple[Any, tuple[int, ...]]]] | None:
    """The dot_general that makes ``var`` through transposes each read once, and the values from ``var`` back to
    its result, each with the axis of it that each axis of ``var`` is; None where no such dot makes ``var`` or the
    transposes do not compose to none.  ``var`` is read by the placement alone."""
    if hasattr(var, "val") or len(w.uses.get(id(var), ())) != 1:
        return None
    axis_of = tuple(range(len(getattr(var.aval, "shape", ()))))
    v = var
    chain: list[tuple[Any, tuple[int, ...]]] = []
    for _ in range(MAX_STEPS):
        home = home_of(w.costs, v)
        if home is None:
            return None
        made = home.jaxpr.eqns[home.position[id(v)]]
        chain.append((v, axis_of))
        if made.primitive.name == "dot_general":
            # Transposes composing to none (jax's gradient writes a weight gradient's twice) are carried back;
            # a real one is not (measured: (a[8@data, 8] @ b).T leaving replicated gathers the product).
            return (made, chain) if axis_of == tuple(range(len(axis_of))) else None
        src = made.invars[0]
        if made.primitive.name != "transpose" or hasattr(src, "val") or len(w.uses.get(id(src), ())) != 1:
            return None
        perm = made.params["permutation"]
        axis_of = tuple(int(perm[a]) for a in axis_of)
        v = src
    return None


def _free_axis_owners(dot: Any) -> dict[int, tuple[int, int]]:
    """A dot's result axis -> (the operand, its axis) for each free (neither contracted nor batch) axis."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    ranks = [len(v.aval.shape) for v in dot.invars[:2]]
    owners: dict[int, tuple[int, int]] = {}
    at = len(lb)
    for k, (contracted, batch) in enumerate(((lc, lb), (rc, rb))):
        for a in range(ranks[k]):
            if a not in contracted and a not in batch:
                owners[at] = (k, a)
                at += 1
    return owners


@register("pvary", "axis_index", "pbroadcast")
def manual_marker(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """Type-level markers inside a shard_map body: no data moves."""
    return [w.replicated(v.aval) for v in eqn.outvars]


@register("shard_map")
def shard_map(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A manual region: its body sees local blocks and its collectives are written out.

    The body is walked on local (unsplit) layouts; each explicit collective
    (psum, all_gather, psum_scatter, ppermute, all_to_all) is priced by its
    ring formula on the local block.  The results are laid out as the
    region's out_specs say.
    """
    p = eqn.params
    body = p["jaxpr"]
    body = body.jaxpr if hasattr(body, "consts") else body
    w.walk(body, [w.replicated(v.aval) for v in body.invars], repeat, inherit(phase))
    specs = p.get("out_specs") or ()
    outs = []
    for v, spec in zip(eqn.outvars, list(specs) + [None] * len(eqn.outvars)):
        entries = list(spec_partitions(spec)) if spec is not None else []
        entries += [None] * (len(v.aval.shape) - len(entries))
        outs.append(w.relayout(v.aval, [_entry_dims(e) for e in entries]))
    return outs


@register(*MANUAL_COLLECTIVES)
def manual_collective(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """An explicit collective inside a shard_map body, priced on the local block it moves.

    One collective over several mesh axes at once (``psum(x, ('data', 'model'))``) is one
    collective over their devices together, as XLA compiles it.
    """
    name = eqn.primitive.name
    p = eqn.params
    axes = p.get("axes", p.get("axis_name", ()))
    axes = (axes,) if isinstance(axes, str) else tuple(a for a in axes if isinstance(a, str))
    n = math.prod(w.costs.mesh_sizes.get(a, 1) for a in axes)
    kind = MANUAL_COLLECTIVES[name]
    colls = []
    for v_in, v_out in zip(eqn.invars, eqn.outvars):
        if not hasattr(v_in.aval, "shape") or n <= 1:
            continue
        item = dtype_itemsize(v_out.aval.dtype)
        local_in = int(math.prod(v_in.aval.shape)) * item
        local_out = int(math.prod(v_out.aval.shape)) * item
        array, sent = RING_BYTES[kind](n, local_in, local_out)  # the analyzer's formulas (cost.py)
        t = w.costs.profile.collective_time(kind, n, sent, array)
        colls.append(Collective(kind, axes, n, int(sent), array, t, "shard_map body", f"explicit {name}"))
    if colls:
        what = f"{name} over {','.join(axes)} (explicit)"
        w.record(eqn, phase, what, None, tuple(colls), 0.0, sum(c.time for c in colls), repeat)
    return [w.replicated(v.aval) for v in eqn.outvars]


@register("scan")
def scan(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    p = eqn.params
    body = scan_body(p)
    n_consts, n_carry = scan_counts(p)
    length = int(p["length"])
    consts, carry, xs = ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]
    xs_inner = [w.relayout(v.aval, lay.dims[1:]) for v, lay in zip(body.invars[n_consts + n_carry :], xs)]
    for v, lay in zip(eqn.invars[n_consts + n_carry :], xs):
        if lay.dims and lay.dims[0]:
            # Under jit, a scan over a stack sharded along the scanned axis (a layer
            # stack laid out 'l@stage ...') slices a sharded axis each iteration: XLA
            # gathers the stack.  Charged once per step, as the slice rule charges it;
            # a real pipeline schedule is einshard.pipeline's, not jit's.
            whole = lay.with_dims(((), *lay.dims[1:]))
            w.change(eqn, phase, lay, whole, v.aval.dtype, repeat, "scan slices a sharded leading axis")
    # A carry's layout is a fixed point of the body: walk it once quietly to
    # learn what the body makes of the carry, bring the initial carry there
    # (once, outside the loop), then walk it for real.
    quiet = type(w)(w.costs, quiet=True)
    quiet.requested.update(_carry_asks(body, n_carry, carry, quiet.requested))
    quiet_env: dict[Any, Layout] = {}
    first = quiet.walk(body, [*consts, *carry, *xs_inner], 1, inherit(phase), env=quiet_env)[:n_carry]
    # A carry the body makes as a pending sum lands at its readers' split in the next trip (below).
    readers = _readers_split(quiet, quiet_env, body, n_consts, first)
    fixed = [
        w.relayout(v.aval, readers.get(k, out.dims)) if not is_free(out) else lay
        for k, (v, lay, out) in enumerate(zip(eqn.outvars, carry, first))
    ]
    # XLA's other fixed point: the carry split as the scanned slices split the batch (see batch_split_carry).
    other = batch_split_carry(w, [v.aval for v in eqn.outvars[:n_carry]], fixed, xs_inner)
    # The main walk takes the fixed point XLA's propagation takes where a reader of the loop's result pulls it
    # (carry_pulled); the fork walks the other one.
    pulled = other is not None and carry_pulled(w, eqn.outvars[:n_carry], fixed, other)
    if other is None and not w.quiet and _on_batch_split(fixed, xs_inner):
        # A loop whose body keeps its carry on the batch's split alone (a recurrent state out of FSDP-gathered
        # weights) settles its transpose loop there too, as a pulled one does (measured on an LSTM under FSDP, as
        # Flax's nn.RNN(OptimizedLSTMCell): XLA carries the backward loop's cotangents on the batch split, one
        # all-to-all per step, where the backward body's own split moved five: tests/test_scan_unscattered_sums.py;
        # a state split on its hidden axis too is the body's own split, and its transpose keeps its own: eqx_gru).
        setattr(w, _PULLED, True)
    taken = other is not None and pulled != (id(CARRY_FORK) in w.costs.forced)
    settled = []
    for v, lay, want in zip(eqn.outvars[:n_carry], carry, other if taken and other else fixed):
        if not is_free(lay) and lay.dims != want.dims:
            w.change(eqn, phase, lay, lay.with_dims(want.dims), v.aval.dtype, repeat, "scan carry settles")
        settled.append(want)
    unasked = settled
    settled = asked_accumulators(w, eqn.outvars[:n_carry], settled)
    # The body's sums into those accumulators are asked for their split, as a program output's are: each
    # trip's partial sum lands there (rules_indexing.consumer_split: a reduce-scatter).
    accumulating = {
        id(bv): s.dims
        for bv, s, was in zip(body.outvars[:n_carry], settled, unasked)
        if s is not was and not hasattr(bv, "val") and id(bv) not in w.requested
    }
    # A stacked output the program returns split (an FSDP layer stack's gradient): each iteration's piece
    # leaves the loop as an output does, its sum pending, and is summed straight to its split inside the
    # loop -- a reduce-scatter per iteration, as XLA compiles it, not an all-reduce and a slice.
    outs = eqn.outvars
    stacked: list[tuple[int, Any, tuple[tuple[str, ...], ...]]] = []
    for k, (o, bv) in enumerate(zip(outs[n_carry:], body.outvars[n_carry:])):
        asked = w.requested.get(id(o)) or _consumers_ask(w, o)
        if asked and not asked[0] and any(asked[1:]) and not hasattr(bv, "val") and id(bv) not in w.program_outputs:
            stacked.append((k, bv, asked[1:]))
            w.program_outputs.add(id(bv))
    outer_path = w.call_path
    env: dict[Any, Layout] = {}  # kept: peak memory counts one iteration's buffers (memory.loop_body_bytes)
    w.call_path = (*outer_path, id(eqn))
    body_start = len(w.ops)
    # A carry settled off the body's own split (the batch's) is XLA's loop sharding: its propagation carries it
    # back into the body to where the values are computed (the fused projections), moved there once per trip.
    wants = [s.dims if s.dims != f.dims else None for s, f in zip(settled, fixed)]
    carried = carried_back(body, n_carry, wants) if taken and any(wants) else {}
    w.pulled.update(carried)
    w.requested.update(accumulating)
    # The pending-sum carries' readers' split, asked of the body's result: its dot sums each trip's partial there.
    carry_sums = {
        id(body.outvars[k]): tuple(tuple(d) for d in dims)
        for k, dims in readers.items()
        if settled[k].dims == tuple(tuple(d) for d in dims) and id(body.outvars[k]) not in w.requested
    }
    w.requested.update(carry_sums)
    # ... and left pending to the trip's end, as a stacked output's piece is (summed to its split below).
    carry_pending = {
        k for k in readers if id(body.outvars[k]) in carry_sums and id(body.outvars[k]) not in w.program_outputs
    }
    w.program_outputs.update(id(body.outvars[k]) for k in carry_pending)
    # Each stacked output's piece is asked the stack's split less the layer axis, as a program output is (a dot
    # making an FSDP layer's weight gradient is computed at it: rules_indexing.asked_split_operands).
    stacked_asks = {id(bv): dims for _, bv, dims in stacked if id(bv) not in w.requested}
    w.requested.update(stacked_asks)
    # The body's dot results, which the running XLA may move by gathering them whole (dot_result_route).
    dots = loop_dots(w, body)
    # The loop's constants: a gather of one is loop-invariant, made once outside the loop.
    hoisted = {k: repeat for k in invariant_values(body, body.invars[:n_consts]) if k not in w.hoisted}
    w.hoisted.update(hoisted)
    # A carry that entered split keeps that split in the body (XLA's while loop holds the init's sharding);
    # asked after the accumulators, which keep theirs.
    carry_asks = _carry_asks(body, n_carry, carry, w.requested, settled)
    w.requested.update(carry_asks)
    try:
        res = w.walk(body, [*consts, *settled, *xs_inner], repeat * length, inherit(phase), env=env)
    finally:
        w.call_path = outer_path
        for k in carried:
            w.pulled.pop(k, None)
        for k in accumulating:
            w.requested.pop(k, None)
        for k in carry_sums:
            w.requested.pop(k, None)
        for k in stacked_asks:
            w.requested.pop(k, None)
        for k in carry_asks:
            w.requested.pop(k, None)
        for k in hoisted:
            w.hoisted.pop(k, None)
        _loop_dots(w).difference_update(dots)
        w.program_outputs.difference_update(id(bv) for _, bv, _ in stacked)
        w.program_outputs.difference_update(id(body.outvars[k]) for k in carry_pending)
    if accumulating and not w.quiet:
        asked_avals = [v.aval for v, s, was in zip(eqn.outvars, settled, unasked) if s is not was]
        _mark_combined_sums(w, body_start, asked_avals)
        _mark_unscattered_sums(w, body_start, asked_avals)
    if other is not None and not taken and len(w.ops) > body_start:
        # Which fixed point XLA's propagation takes turns on its users outside the loop (a loss against labels
        # split on the batch pulls the carry there; measured on the FSDP GRU): the body's first op carries
        # the bound, measured by walking the program once more with the carry on the other fixed point.
        _mark_carry(w, eqn, body_start, _carry_bound(w, [v.aval for v in eqn.outvars[:n_carry]], fixed, other))
    if not w.quiet:
        w.sub_envs[(*outer_path, id(eqn))] = env
    carry_out, ys = list(res[:n_carry]), list(res[n_carry:])
    for k in carry_pending:
        if carry_out[k].unreduced:
            dst = w.relayout(body.outvars[k].aval, settled[k].dims)
            aval = body.outvars[k].aval
            spread = _spread_over_idle(w, body, env, k, carry_out[k], dst)
            if spread:
                what = f"scan carry's sum lands at its readers' split: {side_string(dst)}"
                w.record(eqn, phase, what, dst, spread, 0.0, sum(c.time for c in spread), repeat * length)
            else:
                w.change(
                    eqn,
                    phase,
                    carry_out[k],
                    dst,
                    aval.dtype,
                    repeat * length,
                    "scan carry's sum lands at its readers' split",
                )
            carry_out[k] = dst
    for k, bv, dims in stacked:
        if ys[k].unreduced:
            dst = w.relayout(bv.aval, dims)
            w.change(eqn, phase, ys[k], dst, bv.aval.dtype, repeat * length, "scan output's layout")
            ys[k] = dst
    out_layouts = [w.relayout(v.aval, lay.dims) for v, lay in zip(outs[:n_carry], carry_out)]
    out_layouts += [w.relayout(v.aval, [(), *lay.dims]) for v, lay in zip(outs[n_carry:], ys)]
    return out_layouts


def _readers_split(
    quiet: WalkerLike, env: dict[Any, Layout], body: Any, n_consts: int, first: list[Layout]
) -> dict[int, list[tuple[str, ...]]]:
    """The split each carry the body makes as a pending sum takes from its readers in the next trip, by carry index.

    A dot whose contraction is split leaves the carry a partial sum (an LSTM's backward loop: the h-cotangent
    ``dgates @ kernel_h.T``, the gates split on ``model``); no reader of the body's result is inside the trip, so
    the look-ahead (:func:`.rules_indexing.consumer_split`) stopped at the carry and the sum settled whole.  XLA's
    while loop holds one sharding for the body's result and its parameter, and propagates the parameter's readers'
    back to the result: the sum lands at the split its readers ask (an elementwise partner laid out on ``model``),
    a reduce-scatter per trip (measured: tests/test_scan_carry_rules.py's LSTM-like backward under dp x tp).
    ``env`` is the quiet walk's environment of the body (its readers' layouts).

    Only a dot's own sum.  Where the mesh axes neither of its operands splits hold as many devices as the sum, XLA
    spreads the sum over them instead (an all-reduce of a slice per idle group and a permute onto the split, as
    rules_indexing.scatter_to_consumers; measured: the same LSTM under tp alone, the batch whole, XLA all-reduces
    the carry's slice and permutes it each trip): the landing charges that (:func:`_spread_over_idle`)."""
    found: dict[int, list[tuple[str, ...]]] = {}
    made = {id(v): e for e in body.eqns for v in e.outvars}
    outer = quiet.env
    quiet.env = env
    try:
        for k, (bv, out) in enumerate(zip(body.outvars, first)):
            lay = None if hasattr(bv, "val") else env.get(bv)
            if hasattr(bv, "val") or lay is None or is_free(out) or not lay.unreduced:
                continue
            source = made.get(id(bv))
            if source is None or source.primitive.name != "dot_general":
                continue
            dims = consumer_split(quiet, body.invars[n_consts + k], out.with_dims(out.dims), frozenset(lay.unreduced))
            if dims is not None and tuple(tuple(d) for d in dims) != tuple(out.dims):
                found[k] = dims
    finally:
        quiet.env = outer
    return found


def _spread_over_idle(
    w: WalkerLike, body: Any, env: dict[Any, Layout], k: int, pending: Layout, dst: Layout
) -> tuple[Collective, ...]:
    """The collectives landing carry ``k``'s pending dot sum at ``dst`` where the mesh axes neither of the dot's
    operands splits hold at least as many devices as the sum: XLA spreads the sum over them, as it does for a dot
    whose consumer asks a split (rules_indexing.scatter_to_consumers): each idle group all-reduces the slice of
    the result its devices own over the summed axes and permutes it onto ``dst`` (1/n of the result each).
    Measured: an LSTM-like backward loop under tp alone (the batch whole, the gates split over 'model' on
    (data=4, model=2)) all-reduces f32[8, 32] of the (8, 64) h-cotangent and permutes f32[8, 32] each trip
    (tests/test_scan_carry_rules.py).  Empty where the idle devices are fewer (a reduce-scatter: the caller's)."""
    made = {id(v): e for e in body.eqns for v in e.outvars}
    source = made.get(id(body.outvars[k]))
    if source is None or source.primitive.name != "dot_general" or is_free(dst):
        return ()
    sizes = w.costs.mesh_sizes
    used = {m for u in source.invars[:2] for d in _dims_in(env, u) for m in d}
    summed = tuple(m for m in sizes if m in pending.unreduced)
    n = math.prod(sizes[m] for m in summed)
    if n <= 1 or math.prod(size for m, size in sizes.items() if m not in used) < n:
        return ()
    if not set(summed) <= {m for d in dst.dims for m in d} - {m for d in pending.dims for m in d}:
        return ()  # the sum does not land on its own mesh axes: not this pattern
    return idle_slice_sum(w, summed, n, math.prod(dst.shard_shape) * dtype_itemsize(body.outvars[k].aval.dtype))


def _dims_in(env: dict[Any, Layout], v: Any) -> tuple[tuple[str, ...], ...]:
    """``v``'s split in ``env`` (a literal's or an unwalked value's: whole)."""
    lay = None if hasattr(v, "val") else env.get(v)
    return () if lay is None or is_free(lay) else tuple(lay.dims)


def _carry_asks(
    body: Any, n_carry: int, entering: list[Layout], requested: Any, settled: list[Layout] | None = None
) -> dict[int, tuple[tuple[str, ...], ...]]:
    """The layouts a loop asks of its body's carry results: each carry that enters laid out split keeps that
    split (XLA's while loop holds one sharding for the carry's init, the body's parameter and its result, and
    propagates it from the init), so a clash the body settles on the way to the carry takes the carry's side
    (measured: a scanned FSDP layer h @ w[l], h[8@data, 32], w[32@data, 32], value_and_grad: XLA gathers w in the
    backward loop to keep the cotangent batch split, 6 all-gathers and 3 reduce-scatters, where explain, by
    operand sizes, gathered the cotangent and all-to-all'd the carry).  A carry entering whole or free (zeros)
    asks nothing: the body gives it its split; nor does one the loop ``settled`` elsewhere (the body's fixed
    point: asking it would land the body's partial sums there, where XLA all-reduces a GRU's weight gradients)."""
    asks: dict[int, tuple[tuple[str, ...], ...]] = {}
    for k, (bv, lay) in enumerate(zip(body.outvars[:n_carry], entering)):
        if hasattr(bv, "val") or is_free(lay) or lay.unreduced or not any(lay.dims) or id(bv) in requested:
            continue
        if settled is not None and settled[k].dims != lay.dims:
            continue
        asks[id(bv)] = tuple(tuple(d) for d in lay.dims)
    return asks


def _consumers_ask(w: WalkerLike, out: Any) -> tuple[tuple[str, ...], ...] | None:
    """The split the readers of a scan's stacked output ``out`` outside the loop would take its sum at, were it a
    pending sum over any mesh axis (:func:`.rules_indexing.consumer_split`'s search: an elementwise partner laid
    out split, a dot, a placement), or None.  An FSDP layer stack's gradient read by an optimizer update
    (``p - lr * g``, Adam's ``b1 * mu + (1 - b1) * g``, the stack ``l a@data b``) takes the update's split back
    into the loop: XLA reduce-scatters each iteration's piece there, as it does for a gradient the program
    returns split (measured: the scanned FSDP gradient under SGD and optax.adamw, 2 x L reduce-scatters).  On
    Explicit axes the output's type decides (:func:`.rules_structural.typed_dims`)."""
    aval = out.aval
    if not getattr(aval, "shape", ()):
        return None
    typed = typed_dims(aval)
    if typed is not None:
        # On Explicit axes the stacked gradient's type names its split (jax.grad types a cotangent like its
        # primal): XLA sums each piece there whatever reads it (measured: a replicated moment updated with it).
        return tuple(tuple(d) for d in typed)
    if not w.uses.get(id(out)):
        return None
    whole = w.relayout(aval, [()] * len(aval.shape))
    found = consumer_split(w, out, whole, frozenset(w.costs.mesh_sizes))
    return tuple(tuple(d) for d in found) if found is not None else None


# Why a scan's carry is approximate (the report's first line names the op the body's walk starts at).
CARRY_NOTE = (
    "a loop's carry has two fixed points, the split the body gives it and the batch split of the scanned inputs; "
    "XLA's sharding propagation picks one by the carry's users outside the loop"
)


class _CarryFork:
    """The one alternative every loop carry with two fixed points offers (its identity is the fork's key).

    A gradient's loops come in pairs, the forward's and its transpose's (whose carry is the forward carry's
    cotangent, and which reads the forward's stacked residuals in the forward carry's layout): XLA's sharding
    propagation settles them together (measured on a GRU over ``lax.scan`` with FSDP weights and the batch split:
    both while loops carry ``h[batch@data, hidden]``, the backward summing each weight's whole partial gradient
    per trip).  So one fork walks every such loop on its batch split at once; forking each loop alone walked a
    program XLA never compiles (the backward on the batch split reading residuals stacked on the hidden split)."""


CARRY_FORK = _CarryFork()


def batch_split_carry(
    w: WalkerLike, avals: list[Any], fixed: list[Layout], xs_inner: list[Layout]
) -> list[Layout] | None:
    """The carry's other fixed point, or None: each carry split on the dimension its scanned slices split the
    batch on (the same position and size, whole in the carry), over those mesh axes, taken off the carry's
    other dimensions.  A recurrent state ``h[batch, hidden]`` the body gives ``hidden@data`` (gates out of FSDP
    weights) meets slices ``x[batch@data, features]``: XLA carries ``h[batch@data, hidden]`` where the loop's
    result is read against the batch's split (measured: the FSDP GRU of the external corpus, an all-to-all of
    each fused projection per step and the weight gradients reduce-scattered per step), the body's split
    where nothing outside pulls."""
    splits = [
        (i, size, d)
        for lay in xs_inner
        if not is_free(lay)
        for i, (size, d) in enumerate(zip(lay.shape, lay.dims))
        if d
    ]
    if not splits:
        return None
    out: list[Layout] = []
    for aval, lay in zip(avals, fixed):
        dims = list(lay.dims) if not is_free(lay) else [()] * len(getattr(aval, "shape", ()))
        shape = tuple(int(s) for s in getattr(aval, "shape", ()))
        for at, size, axes in splits:
            # The batch is where the slices have it (vmap's axis: the same position, the same size).
            if at >= len(shape) or shape[at] != size or dims[at]:
                continue
            dims = [tuple(m for m in d if m not in axes) for d in dims]
            dims[at] = axes
            break
        out.append(w.relayout(aval, dims) if any(dims) else lay)
    if all(o.dims == f.dims for o, f in zip(out, fixed)):
        return None
    return out


# The walker attribute naming whether a loop of this walk took the carry's batch split because a reader of its result
# pulled it there: the loops of a gradient (the forward's and its transpose, which reads the forward's residuals)
# settle together, as the fork walks them.
_PULLED = "_einshard_carry_pulled"


def carry_pulled(w: WalkerLike, results: list[Any], fixed: list[Layout], other: list[Layout]) -> bool:
    """Whether XLA's sharding propagation takes the carry's batch split: a reader of the loop's result, followed
    along the batch axis, meets an operand already split on that axis over the batch's mesh axes (labels split on
    the batch against the read-out state), or an earlier loop of this walk was pulled so or kept there by its own
    body (:func:`_on_batch_split`: a gradient's transpose loop follows its forward).  Measured on a GRU over ``lax.scan`` with the cell's weights and the batch split
    over one mesh axis: a loss of the state alone keeps the body's split; the state read out by a head and held
    against labels split on the batch takes the batch split (labels whole: the body's), whatever the head's
    split (tests/test_scan_carry_rules.py)."""
    if getattr(w, _PULLED, False):
        return True
    for v, a, b in zip(results, fixed, other):
        moved = [i for i, (da, db) in enumerate(zip(a.dims, b.dims)) if db and da != db]
        if moved and _meets_split(w, v, moved[0], b.dims[moved[0]]):
            if not w.quiet:
                setattr(w, _PULLED, True)
            return True
    return False


def _on_batch_split(fixed: list[Layout], xs_inner: list[Layout]) -> bool:
    """Whether the carry is split on the batch alone: every split carry split only where the scanned slices split
    the batch (the same position and size), over the same mesh axes, and whole elsewhere (a state split on its
    hidden axis too, ``h[batch@data, hidden@model]``, is the body's own split: its transpose loop keeps its own).
    The batch is a slice's leading axis where it has features after it (``[batch, features]``, as a batched
    recurrent step's slices are): a carry split like the slices' features (``h[batch, hidden@model]`` against
    ``x[batch, features@model]`` of the same size) is the body's own split too (tests/test_dot_consumer_sums.py,
    the scanned cell on an idle data axis)."""
    splits = [
        (0, lay.shape[0], lay.dims[0]) for lay in xs_inner if not is_free(lay) and len(lay.dims) >= 2 and lay.dims[0]
    ]
    carried = [lay for lay in fixed if not is_free(lay) and any(lay.dims)]
    return bool(carried) and all(
        any(
            at < len(lay.dims)
            and lay.shape[at] == size
            and lay.dims == tuple(d if i == at else () for i in range(len(lay.dims)))
            for at, size, d in splits
        )
        for lay in carried
    )


def _meets_split(w: WalkerLike, var: Any, axis: int, mesh_axes: tuple[str, ...]) -> bool:
    """Whether ``var``'s axis ``axis``, followed through its readers (transposes, conversions, broadcasts,
    elementwise ops, reductions over other axes, dots where it is a free axis), meets an operand bound split
    there over ``mesh_axes``."""
    from .values import CARRIERS, ELEMENTWISE, REDUCTIONS

    frontier: list[tuple[Any, int]] = [(var, axis)]
    seen: set[tuple[int, int]] = set()
    while frontier:
        v, at = frontier.pop(0)
        if (id(v), at) in seen or len(seen) > 256:  # a bound on the search: the readers of one result
            continue
        seen.add((id(v), at))
        for e, k in w.uses.get(id(v), ()):
            name = e.primitive.name
            out = e.outvars[0] if e.outvars else None
            if out is None or not hasattr(out.aval, "shape"):
                continue
            if name == "transpose":
                frontier.append((out, list(e.params["permutation"]).index(at)))
            elif name in CARRIERS:
                frontier.append((out, at))
            elif name in ELEMENTWISE and tuple(out.aval.shape) == tuple(v.aval.shape):
                for u in e.invars:
                    lay = w.env.get(u) if u is not v and not hasattr(u, "val") else None
                    if lay is not None and not is_free(lay) and len(lay.dims) > at and lay.dims[at] == mesh_axes:
                        return True
                frontier.append((out, at))
            elif name == "broadcast_in_dim":
                frontier.append((out, int(e.params["broadcast_dimensions"][at])))
            elif name in REDUCTIONS and at not in e.params.get("axes", ()):
                frontier.append((out, at - sum(1 for a in e.params["axes"] if a < at)))
            elif name == "dot_general" and k < 2:
                (contract, batch) = e.params["dimension_numbers"]
                if at in contract[k]:
                    continue
                if at in batch[k]:
                    frontier.append((out, list(batch[k]).index(at)))
                    continue
                rank = [len(x.aval.shape) for x in e.invars[:2]]
                free = [i for i in range(rank[k]) if i not in contract[k] and i not in batch[k]]
                before = len(batch[0]) + (0 if k == 0 else rank[0] - len(contract[0]) - len(batch[0]))
                frontier.append((out, before + free.index(at)))
    return False


Dims = tuple[tuple[str, ...], ...]


def asked_accumulators(w: WalkerLike, results: list[Any], settled: list[Layout]) -> list[Layout]:
    """Carries the body keeps whole but the program returns split (a gradient accumulated over the trips: the
    transpose of a loop reading FSDP weights as constants carries their cotangents) settle on the split asked of
    the result: XLA's propagation brings the output's sharding into the loop, and each trip's partial sum is
    reduce-scattered straight into the accumulator's piece (measured on the FSDP GRU's gradient: each weight's
    per-trip sum a reduce-scatter over 'data', where a whole carry all-reduced it)."""
    from .rules_indexing import requested_dims  # rules_indexing's look-up of the layout asked of an output

    out = list(settled)
    for k, (v, lay) in enumerate(zip(results, settled)):
        if is_free(lay) or any(lay.dims) or lay.unreduced:
            continue
        asked = requested_dims(w, v)
        shape = tuple(int(s) for s in getattr(v.aval, "shape", ()))
        if not asked or not any(asked) or len(asked) != len(shape):
            continue
        if all(size % math.prod(w.costs.mesh_sizes[m] for m in d) == 0 for size, d in zip(shape, asked)):
            out[k] = w.relayout(v.aval, asked)
    return out


def carried_back(body: Any, n_carry: int, wants: list[Dims | None]) -> dict[int, Dims]:
    """The loop body's values XLA computes in the carry's fixed split, where they are made, by id.

    XLA's sharding propagation gives the body's carry results the loop's carry sharding and carries it back through
    the ops that make them -- elementwise ops, conversions, transposes, broadcasts, the split of the fused gates and
    its transpose (concatenate) -- to where a value is computed by a dot: that result is moved there (one
    all-to-all per fused projection per trip, measured on the FSDP GRU whose carry XLA splits on the batch), and
    what follows it computes in place, where explain met the body's split at every gate (permutes) and moved the
    carry."""
    from .values import CARRIERS, ELEMENTWISE

    made = {id(v) for e in body.eqns for v in e.outvars}
    want: dict[int, Dims] = {}
    for v, d in zip(body.outvars[:n_carry], wants):
        if d is not None and id(v) in made:
            want[id(v)] = d
    sources: dict[int, Dims] = {}

    def give(u: Any, dims: Dims) -> None:
        if not hasattr(u, "val") and id(u) in made:
            want.setdefault(id(u), dims)

    for e in reversed(body.eqns):
        got = [want.get(id(v)) for v in e.outvars]
        d = next((g for g in got if g is not None), None)
        if d is None:
            continue
        name = e.primitive.name
        shape = tuple(e.outvars[0].aval.shape)
        if name == "dot_general":
            sources[id(e.outvars[0])] = d
        elif name == "transpose":
            perm = list(e.params["permutation"])
            give(e.invars[0], tuple(d[perm.index(i)] for i in range(len(perm))))
        elif name in ELEMENTWISE or name in CARRIERS:
            for u in e.invars:
                if tuple(getattr(u.aval, "shape", ())) == shape:
                    give(u, d)
        elif name == "split" and not d[int(e.params["axis"])]:
            give(e.invars[0], d)
        elif name == "concatenate" and not d[int(e.params["dimension"])]:
            for u in e.invars:
                give(u, d)
        elif name == "broadcast_in_dim":
            src = e.invars[0]
            dims = e.params["broadcast_dimensions"]
            give(src, tuple(d[j] if src.aval.shape[i] == shape[j] else () for i, j in enumerate(dims)))
    return sources


# The walker attribute holding the ids of the dot results of the loop bodies being walked (:func:`dot_result_route`).
_LOOP_DOTS = "_einshard_loop_dots"


def loop_dots(w: WalkerLike, body: Any) -> set[int]:
    """Register the ids of ``body``'s dot results for :func:`dot_result_route` (the scan rule drops them after
    its walk); the ids registered, none where the running XLA all-to-alls them (nothing to route)."""
    from .xla_behaviour import xla_behaviour

    if not xla_behaviour().carried_back_splits_gathered:
        return set()
    made = {id(v) for e in body.eqns if e.primitive.name == "dot_general" for v in e.outvars} - _loop_dots(w)
    _loop_dots(w).update(made)
    return made


def _loop_dots(w: WalkerLike) -> set[int]:
    found: set[int] | None = getattr(w, _LOOP_DOTS, None)
    if found is None:
        found = set()
        setattr(w, _LOOP_DOTS, found)
    return found


def dot_result_route(w: WalkerLike, var: Any, src: Layout, dst: Layout, dtype: Any, phase: str) -> list[Layout]:
    """The layouts a move of ``var`` from ``src`` to ``dst`` passes through, ``dst`` last: one step, unless
    ``var`` is a dot's result in a transpose loop's body moved by an all-to-all on a mesh with an axis neither
    side splits.  jax 0.12's SPMD partitioner makes such a dot in its operands' split, partially replicated
    (``[batch, hidden@data]``, the state's cotangent), where propagation asked another (the carry's batch split,
    or an elementwise partner's) and cannot all-to-all between the two ("involuntary full rematerialization"): it
    gathers the result whole and slices it (:mod:`.xla_behaviour`'s ``carried_back_splits_gathered``, probed;
    measured on tests/test_scan_unscattered_sums.py's LSTM and accumulators under FSDP on (4, 2)).  jax 0.10's
    all-to-alls it, and so do both with nothing idle.  Only the backward loops were measured to differ."""
    if phase != "backward" or id(var) not in getattr(w, _LOOP_DOTS, ()):
        return [dst]
    split = {m for lay in (src, dst) for d in lay.dims for m in d}
    if all(m in split for m, n in w.costs.mesh_sizes.items() if n > 1):
        return [dst]
    if {c.kind for c in w.costs.reshard(src, dst, dtype)} != {"all-to-all"}:
        return [dst]
    return [dst.with_dims(tuple(() for _ in dst.dims)), dst]


# Why a loop summing into split accumulators is approximate (the report's first line names the op).
COMBINED_SUMS_NOTE = (
    "XLA's all-reduce combiner issues a trip's sums into the loop's accumulators as one all-reduce (XLA:CPU's "
    "reduce-scatter is an all-reduce and a slice): it holds every partial sum and every whole sum at once, which "
    "the memory walk does not count for sums landing split"
)


def _mark_combined_sums(w: WalkerLike, since: int, avals: list[Any]) -> None:
    """Mark the body's last reduce-scatter into an accumulator: peak memory may hold, beyond the walk, each
    accumulator's partial and whole sum (measured on the FSDP GRU's gradient: XLA's peak 2.0x the walk's, its
    three weight sums' partials and sums all live; kinds, counts and bytes are XLA's)."""
    at = next(
        (
            i
            for i in range(len(w.ops) - 1, since - 1, -1)
            if any(c.kind == "reduce-scatter" for c in w.ops[i].collectives)
        ),
        None,
    )
    if at is None:
        return
    held = 2 * sum(math.prod(int(s) for s in a.shape) * dtype_itemsize(a.dtype) for a in avals)
    op = w.ops[at]
    note = f"{op.note}; {COMBINED_SUMS_NOTE}" if op.approximate else f"{APPROXIMATE}: {COMBINED_SUMS_NOTE}"
    own = op.bound or (default_bound(op) if op.approximate else OpBound(0, 0.0, 0.0))
    w.ops[at] = dataclasses.replace(op, note=note, bound=OpBound(own.collectives, own.bytes, own.peak + held))


# Why a loop's whole partial sum beside split accumulators is approximate (the report's first line names the op).
UNSCATTERED_SUMS_NOTE = (
    "the loop's accumulators are asked split after the loop, but this per-trip partial sum was all-reduced whole: "
    "the walk did not carry their split back to it (a concatenated kernel's transpose, or an accumulator whose asked "
    "split it did not find); XLA may reduce-scatter it to the accumulator's split inside the loop"
)


def _mark_unscattered_sums(w: WalkerLike, since: int, avals: list[Any]) -> None:
    """Mark the body's all-reduces of a partial sum the size of a whole number of split accumulators: the
    accumulators' split, decided after the loop, may reach the sum through ops the walk does not carry it back
    through (measured: x_t @ concat(k * W) in a scan's gradient, W FSDP over 'data': XLA reduce-scatters each
    trip's kernel-gradient partial, explain all-reduced it whole; 2 reduce-scatters against 2 all-reduces x 6
    trips; and U's partials beside it, its accumulator's asked split not found).  Bound: each such op's own (its
    collectives moved another way, its whole bytes sent and held).  On Explicit axes the gradients' types carry the
    split into the loop and explain's reduce-scatters are XLA's: nothing to mark."""
    sizes = [math.prod(int(s) for s in a.shape) * dtype_itemsize(a.dtype) for a in avals]
    sizes = [s for s in sizes if s > 0]
    if not sizes:
        return
    for i in range(since, len(w.ops)):
        op = w.ops[i]
        sums = [c for c in op.collectives if c.kind == "all-reduce" and c.group_size > 1]
        if not sums or not any(c.array_bytes % s == 0 for c in sums for s in sizes):
            continue
        if UNSCATTERED_SUMS_NOTE in op.note:
            continue
        note = f"{op.note}; {UNSCATTERED_SUMS_NOTE}" if op.approximate else f"{APPROXIMATE}: {UNSCATTERED_SUMS_NOTE}"
        own = op.bound or (default_bound(op) if op.approximate else OpBound(0, 0.0, 0.0))
        extra = default_bound(op)
        total = OpBound(own.collectives + extra.collectives, own.bytes + extra.bytes, own.peak + extra.peak)
        w.ops[i] = dataclasses.replace(op, note=note, bound=total)


def _carry_bound(w: WalkerLike, avals: list[Any], fixed: list[Layout], other: list[Layout]) -> OpBound:
    """The carry's own bound, per trip, where the fork is not walked (beyond alternatives.MAX_FORKS): each carry
    that differs moved another way, one collective per peer, its whole bytes sent and held."""
    collectives, moved = 0, 0.0
    for aval, a, b in zip(avals, fixed, other):
        if a.dims == b.dims:
            continue
        axes = {m for d in (*a.dims, *b.dims) for m in d}
        collectives += max(1, math.prod(w.costs.mesh_sizes[m] for m in axes) - 1)
        moved += math.prod(int(s) for s in aval.shape) * dtype_itemsize(aval.dtype)
    return OpBound(collectives, moved, moved)


def _mark_carry(w: WalkerLike, eqn: Any, since: int, bound: OpBound) -> None:
    """Mark the body's first op that offers no other alternative with the carry's note and bound, and offer the
    carry's other fixed point there (:func:`.alternatives.offer` would tag every marked op since ``since``)."""
    if w.quiet or w.costs.forced:
        return
    at = next((i for i in range(since, len(w.ops)) if not w.ops[i].alternative), None)
    if at is None:
        return
    op = w.ops[at]
    note = f"{op.note}; {CARRY_NOTE}" if op.approximate else f"{APPROXIMATE}: {CARRY_NOTE}"
    own = op.bound or (default_bound(op) if op.approximate else OpBound(0, 0.0, 0.0))
    total = OpBound(own.collectives + bound.collectives, own.bytes + bound.bytes, own.peak + bound.peak)
    w.ops[at] = dataclasses.replace(op, note=note, bound=total, alternative=id(CARRY_FORK))


def scan_body(params: Any) -> Any:
    """A scan equation's body as a ``Jaxpr`` (a ClosedJaxpr's before jax 0.12, the Jaxpr itself after)."""
    body = params["jaxpr"]
    return body.jaxpr if hasattr(body, "consts") else body


def scan_counts(params: Any) -> tuple[int, int]:
    """A scan equation's operand counts (consts, carry), on both JAX lines (the rest are the scanned xs)."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    n_consts, n_carry = scan_groups(params["ft_in"])[:2]  # jax >= 0.12: ft_in groups (consts, carry, xs)
    return n_consts, n_carry


def scan_groups(ft_in: Any) -> list[int]:
    """Operand counts of (consts, carry, xs) from jax 0.12's ``ft_in``.

    It is a FlatTree: a tuple of three groups, a Pytree whose treedef has three
    children, or a filtered Pytree (``RightsOnly``) whose ``Right`` entries are the operands.
    """
    elts = getattr(ft_in, "elts", None)
    if elts is not None:
        return [len(e) for e in elts]
    filtered = type(ft_in).__name__ == "FTFiltered"
    pytree = ft_in.val if filtered else ft_in
    tree = getattr(pytree, "_tree", None)
    if tree is not None:
        vals, out, i = list(pytree.xs), [], 0
        for child in tree.children():
            chunk = vals[i : i + child.num_leaves]
            i += child.num_leaves
            out.append(sum(1 for x in chunk if getattr(x, "is_right", True)) if filtered else len(chunk))
        return out

    def count(x: Any) -> int:
        return sum(count(e) for e in x) if isinstance(x, (tuple, list)) else 1

    return [count(group) for group in ft_in]


@register("call_hi_primitive")
def hi_primitive(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A "hijax" primitive (jax 0.12: ``jnp.frexp``, ``jnp.ldexp``, the ``tril/triu_indices_from`` helpers): XLA
    compiles its expansion (``_prim.expand``, traced on the operands' types), so the expansion is walked as a
    call's body with the operands' layouts."""
    import jax

    from .registry import call_rule, unfollowed

    prim = eqn.params.get("_prim")
    expand = getattr(prim, "expand", None)
    avals = [v.aval for v in eqn.invars]
    try:
        body = jax.make_jaxpr(expand)(*avals) if callable(expand) else None
    except Exception:  # an expansion that does not trace on abstract values: priced as an op without a rule
        body = None
    if body is None or len(body.jaxpr.outvars) != len(eqn.outvars):
        return unfollowed(w, eqn, ins, repeat, phase)
    return call_rule(w, eqn.replace(params={**eqn.params, "jaxpr": body}), ins, repeat, phase)
