"""The small stacked-layer model and checks the pipeline tests share (GPipe/circular and 1F1B)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from einshard._src.lowering.pipeline_stages import vocab_parallel_cross_entropy, vocab_parallel_embed

HI = jax.lax.Precision.HIGHEST
D = 4


def layer(p, h):
    return jnp.tanh(jnp.dot(h, p["w"], precision=HI) + p["b"]) + 0.5 * h


def sequential(layer_fn, params, x):
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]


def make(layers, batch, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": (rng.standard_normal((layers, D, D)) / np.sqrt(D)).astype(np.float32),
        "b": (0.1 * rng.standard_normal((layers, D))).astype(np.float32),
    }
    x = rng.standard_normal((batch, D)).astype(np.float32)
    target = rng.standard_normal((batch, D)).astype(np.float32)
    return params, x, target


def loss_of(run):
    def loss(params, x, target):
        return jnp.mean((run(params, x) - target) ** 2)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def assert_same(got, want, tol=2e-6):
    (lg, gg), (lw, gw) = got, want
    np.testing.assert_allclose(lg, lw, rtol=tol, atol=tol)
    for a, b in zip(jax.tree_util.tree_leaves(gg), jax.tree_util.tree_leaves(gw), strict=True):
        assert np.all(np.isfinite(a))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=tol)


# A tiny language model's ends, written for a vocabulary split over the 'stage' axis (the pipeline's
# PipelineEnd convention: fn sees this device's blocks and combines over the stage axis itself).
V = 8


def make_lm(layers, batch, seed=0):
    params, _, _ = make(layers, batch, seed)
    rng = np.random.default_rng(seed + 1)
    ends = {
        "embed": {"table": rng.standard_normal((V, D)).astype(np.float32)},
        "head": {"w": (rng.standard_normal((D, V)) / 2).astype(np.float32)},
    }
    tokens = rng.integers(0, V, batch).astype(np.int32)
    targets = rng.integers(0, V, batch).astype(np.int32)
    return {"layers": params, **ends}, tokens, targets


def split_embed(p, tokens):
    return vocab_parallel_embed(p["table"], tokens, "stage")


def split_head_loss(p, h, targets):
    return vocab_parallel_cross_entropy(jnp.dot(h, p["w"], precision=HI), targets, "stage")


def lm_sequential(params, tokens, targets):
    h = sequential(layer, params["layers"], params["embed"]["table"][tokens])
    logits = jnp.dot(h, params["head"]["w"], precision=HI)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0])


def step_temp_bytes(stages, microbatches, schedule, repeats=1, *, batch, width=64, layer_fn=None):
    """XLA's temporary bytes per device of the whole training step (jit of grad) on an Auto stage mesh."""
    import einshard

    mesh = jax.make_mesh(
        (stages,), ("stage",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:stages]
    )
    layers = stages * 2 * repeats
    params = {"w": jnp.zeros((layers, width, width)), "b": jnp.zeros((layers, width))}
    params = einshard.einshard(params, "l ... -> l@stage ...", mesh=mesh)  # stored as the pipeline keeps them
    x = jnp.zeros((batch, width))
    run = dict(microbatches=microbatches, schedule=schedule, repeats=repeats, mesh=mesh, layers_in_circular_order=True)

    def loss(p, x):
        from einshard.lowering import pipeline

        return jnp.sum(pipeline(layer_fn or layer, p, x, **run) ** 2)

    return jax.jit(jax.grad(loss)).lower(params, x).compile().memory_analysis().temp_size_in_bytes


def activation_bytes(stages, microbatches, schedule, repeats=1, *, batch, width=64):
    """What grows with the batch (temp at 2B minus temp at B), less the same for a layer whose backward keeps
    nothing under GPipe (the step's batch-sized I/O): the activations a schedule keeps, in bytes."""

    def batch_part(schedule, repeats, layer_fn=None):
        at = [
            step_temp_bytes(stages, microbatches, schedule, repeats, batch=b, width=width, layer_fn=layer_fn)
            for b in (batch, 2 * batch)
        ]
        return at[1] - at[0]

    io = batch_part("gpipe", 1, lambda p, h: h + p["b"])
    return batch_part(schedule, repeats) - io
