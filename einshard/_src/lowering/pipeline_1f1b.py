"""1F1B (and interleaved 1F1B) in one SPMD program: a ``custom_vjp`` whose backward is a 1F1B-ordered scan.

Why a ``custom_vjp`` and not a ``pipeline_step`` that returns (loss, grads):
``pipeline`` stays a function ``x -> y`` that composes with the user's loss
and ``jax.grad`` exactly as the GPipe schedule does.  The price: the loss is
computed outside the pipeline, so no backward can start before every forward
has finished.  The forward pass is therefore the forward-only GPipe/circular
scan (no AD, so it keeps nothing but the outputs), and the backward rule runs
the 1F1B order: its F ticks recompute the stage inputs, its B ticks recompute
one stage visit under ``jax.vjp`` and push the cotangent back.  A stage keeps at
most the activations of the micro-batches in flight (about S, see
:mod:`.schedules`), never M.  Compute: one extra forward pass compared with
GPipe with ``remat=True`` (whose B ticks recompute too).

Each tick every stage runs one branch of ``lax.switch`` (idle / forward /
backward, chosen per device from the static tick table) and then *every*
device takes part in the same two ``ppermute``\\ s (activations forward,
gradients back), so collectives stay matched; collectives inside ``layer_fn``
(tensor parallelism) involve only devices of one stage, which all take the
same branch.  Idle ticks compute nothing and read no buffer, and buffer slots
are read only after the table says they were written, so NaN in unused slots
never reaches outputs or gradients.  Parameter gradients are accumulated per
data shard and summed over the data axes once, after the scan.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from ..core.layout import spec_dims
from ..core.mesh import AnyMesh
from .schedules import BACKWARD, OneFOneBPlan
from .steps import vary as _vary
from .steps import varying_axes as _varying

__all__ = ["one_f_one_b_pipeline"]


def _spec_axes(spec: PartitionSpec) -> frozenset[str]:
    return frozenset(m for d in spec_dims(spec) for m in d)


def _at(buf: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(buf, jnp.maximum(i, 0), 0, keepdims=False)


def _put(buf: jax.Array, i: jax.Array, value: jax.Array, when: jax.Array) -> jax.Array:
    """``buf[i] = value`` where ``when`` (a select, never a product with a mask: 0 * nan is nan)."""
    slot = jnp.maximum(i, 0)
    old = jax.lax.dynamic_index_in_dim(buf, slot, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(when, value, old), slot, 0)


def one_f_one_b_pipeline(
    forward: Callable[[Any, jax.Array], jax.Array],
    visit: Callable[[Any, jax.Array], jax.Array],
    plan: OneFOneBPlan,
    *,
    mesh: AnyMesh,
    param_specs: Any,
    x_spec: PartitionSpec,
    stage_axis: str,
    stages: int,
    microbatches: int,
    repeats: int,
    layers_per_visit: int,
    bubble_value: float,
) -> Callable[[Any, jax.Array], jax.Array]:
    """``forward`` (a shard_map'd forward-only pipeline) with a 1F1B backward as its ``custom_vjp``."""
    S, M, R, lps = stages, microbatches, repeats, layers_per_visit
    data_axes = _spec_axes(x_spec)
    columns = (plan.kind, plan.m, plan.chunk, plan.act_slot, plan.grad_slot, plan.recv_act, plan.recv_grad)
    forward_perm = [(j, (j + 1) % S) for j in range(S if R > 1 else S - 1)]
    backward_perm = [(b, a) for a, b in forward_perm]

    def body(p: Any, xb: jax.Array, dyb: jax.Array) -> tuple[Any, jax.Array]:
        s = jax.lax.axis_index(stage_axis)
        xs = xb.reshape(M, xb.shape[0] // M, *xb.shape[1:])
        dys = dyb.reshape(xs.shape)
        # Gradients stay per data shard inside the scan (one sum after it, not one per tick).
        p = jax.tree_util.tree_map(lambda w: _vary(w, data_axes & frozenset(mesh.axis_names)), p)

        def chunk(c: jax.Array) -> Any:
            if R == 1:
                return p
            return jax.tree_util.tree_map(lambda w: jax.lax.dynamic_slice_in_dim(w, c * lps, lps, 0), p)

        axes = _varying(xs) | _varying(dys) | {stage_axis}
        while True:  # the axes one stage visit's output varies over (a fixed point, usually one step)
            probe = jax.eval_shape(visit, chunk(jnp.int32(0)), _vary(xs[0], axes))
            grown = axes | _varying(probe)
            if grown == axes:
                break
            axes = grown

        def run(pc: Any, h: jax.Array) -> jax.Array:
            return _vary(visit(pc, h), axes)

        fill = _vary(jnp.full(xs.shape[1:], bubble_value, xs.dtype), axes)
        zero = _vary(jnp.zeros(xs.shape[1:], xs.dtype), axes)
        acts = jnp.broadcast_to(fill, (plan.act_slots, *fill.shape))
        grads_in = jnp.broadcast_to(fill, (plan.grad_slots, *fill.shape))
        dx = jnp.broadcast_to(fill, xs.shape)
        acc = jax.tree_util.tree_map(lambda w: _vary(jnp.zeros(w.shape, w.dtype), _varying(w)), p)

        def step(carry: Any, row: tuple[jax.Array, ...]) -> tuple[Any, None]:
            acts, grads_in, fmsg, bmsg, acc, dx = carry
            kind, m, c, act_slot, grad_slot, recv_act, recv_grad = (jnp.take(col, s) for col in row)
            # What the neighbours sent last tick goes to the slot the table gives it.
            acts = _put(acts, recv_act, fmsg, recv_act >= 0)
            grads_in = _put(grads_in, recv_grad, bmsg, recv_grad >= 0)
            h = jnp.where(act_slot >= 0, _at(acts, act_slot), _vary(_at(xs, m), axes))
            g = jnp.where(grad_slot >= 0, _at(grads_in, grad_slot), _vary(_at(dys, m), axes))
            pc = chunk(c)
            pc_zero = jax.tree_util.tree_map(lambda w: _vary(jnp.zeros(w.shape, w.dtype), _varying(w)), pc)

            def idle(pc: Any, h: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
                return zero, zero, pc_zero

            def forward_tick(pc: Any, h: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
                return run(pc, h), zero, pc_zero

            def backward_tick(pc: Any, h: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
                _, pullback = jax.vjp(run, pc, h)  # recompute this visit, then its vjp
                dp, dh = pullback(g)
                return zero, _vary(dh, axes), dp

            y, dh, dp = jax.lax.switch(kind, (idle, forward_tick, backward_tick), pc, h, g)
            if R == 1:
                acc = jax.tree_util.tree_map(jnp.add, acc, dp)
            else:
                acc = jax.tree_util.tree_map(
                    lambda a, d: jax.lax.dynamic_update_slice_in_dim(
                        a, jax.lax.dynamic_slice_in_dim(a, c * lps, lps, 0) + d, c * lps, 0
                    ),
                    acc,
                    dp,
                )
            dx = _put(dx, m, dh, (kind == BACKWARD) & (c == 0) & (s == 0))
            # Every device sends every tick (idle ones send zeros): the collectives stay matched.
            fmsg = jax.lax.ppermute(y, stage_axis, forward_perm)
            bmsg = jax.lax.ppermute(dh, stage_axis, backward_perm)
            return (acts, grads_in, fmsg, bmsg, acc, dx), None

        carry = (acts, grads_in, fill, fill, acc, dx)
        table = tuple(jnp.asarray(col) for col in columns)
        (_, _, _, _, acc, dx), _ = jax.lax.scan(step, carry, table)
        grads = jax.tree_util.tree_map(
            lambda a, spec: (
                jax.lax.psum(a, tuple(sorted(_varying(a) - _spec_axes(spec)))) if _varying(a) - _spec_axes(spec) else a
            ),
            acc,
            param_specs,
            is_leaf=lambda v: isinstance(v, PartitionSpec),
        )
        dx = jax.lax.psum(jnp.where(s == 0, dx, jnp.zeros_like(dx)), stage_axis)
        return grads, dx.reshape(xb.shape)

    backward = jax.jit(  # staged: an eager shard_map runs one primitive at a time
        jax.shard_map(
            body, mesh=mesh, in_specs=(param_specs, x_spec, x_spec), out_specs=(param_specs, x_spec), check_vma=True
        )
    )

    @jax.custom_vjp
    def run_pipeline(params: Any, x: jax.Array) -> jax.Array:
        return forward(params, x)

    def run_fwd(params: Any, x: jax.Array) -> tuple[jax.Array, tuple[Any, jax.Array]]:
        return forward(params, x), (params, x)  # forward-only scan: it keeps no activations

    def run_bwd(saved: tuple[Any, jax.Array], dy: jax.Array) -> tuple[Any, jax.Array]:
        params, x = saved
        return backward(params, x, dy)

    run_pipeline.defvjp(run_fwd, run_bwd)
    return run_pipeline
