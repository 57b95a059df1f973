"""The pipeline's ends (PipelineEnd: embedding before the first stage, head and loss after the last, their
params split over the stage axis), and a stage axis of size 1 (one stage runs every layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from pipeline_models import assert_same, layer, lm_sequential, loss_of, make, sequential, split_embed, split_head_loss

import einshard
from einshard.errors import EinshardError
from einshard.lowering import PipelineEnd, pipeline

HEAD = "d v -> d v@stage"  # the head's vocabulary (columns) over the stages; the embedding's rows by default


def _mesh(shape, names, kind=AxisType.Auto):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=jax.devices()[:n])


def _lm_loss(mesh, head_layouts=HEAD, embed_layouts=None, **kw):
    def loss(params, tokens, targets):
        per_example = pipeline(
            layer,
            params["layers"],
            tokens,
            mesh=mesh,
            data_axis="data",
            first=PipelineEnd(split_embed, params["embed"], layouts=embed_layouts),
            last=PipelineEnd(split_head_loss, params["head"], layouts=head_layouts, args=(targets,)),
            **kw,
        )
        return jnp.mean(per_example)

    return loss


@pytest.mark.parametrize(
    "kind,schedule,repeats",
    [
        (AxisType.Explicit, "gpipe", 1),
        (AxisType.Auto, "1f1b", 1),
        pytest.param(AxisType.Explicit, "1f1b", 2, marks=pytest.mark.slow),
        pytest.param(AxisType.Auto, "circular", 2, marks=pytest.mark.slow),
    ],
)
def test_ends_loss_and_every_gradient_equal_sequential(kind, schedule, repeats):
    mesh = _mesh((2, 2), ("stage", "data"), kind)
    params, tokens, targets = make_lm_placed(mesh, 2 * 2 * repeats, 8)
    want = jax.jit(jax.value_and_grad(lm_sequential))(jax.device_get(params), tokens, targets)
    loss = _lm_loss(mesh, microbatches=2, schedule=schedule, repeats=repeats)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.value_and_grad(loss))(params, tokens, targets)
    assert set(got[1]) == {"layers", "embed", "head"}
    assert_same(got, want)


def make_lm_placed(mesh, layers, batch):
    from pipeline_models import make_lm

    params, tokens, targets = make_lm(layers, batch)
    layouts = {"layers": "l ... -> l@stage ...", "embed": "v d -> v@stage d", "head": HEAD}
    placed = {k: einshard.einshard(v, layouts[k], mesh=mesh) for k, v in params.items()}
    return placed, tokens, targets


def test_split_ends_hold_a_stage_share_of_their_params_per_device():
    # XLA's own per-device argument bytes for the whole training step: the embedding and head split over
    # 4 stages hold 1/4 of their bytes per device; replicated ('.*': None), every device holds all of them.
    mesh = _mesh((4, 2), ("stage", "data"))
    params, tokens, targets = make_lm_placed(mesh, 4, 8)
    big = {"table": np.zeros((64, 256), np.float32)}, {"w": np.zeros((256, 64), np.float32)}
    params = {**params, "embed": big[0], "head": big[1]}
    params["layers"] = {k: np.zeros((4, 256, 256)[: v.ndim], np.float32) for k, v in params["layers"].items()}

    def argument_bytes(embed_layouts, head_layouts):
        loss = _lm_loss(mesh, head_layouts, embed_layouts, microbatches=2)
        return jax.jit(jax.grad(loss)).lower(params, tokens, targets).compile().memory_analysis()

    split = argument_bytes(None, HEAD)
    replicated = argument_bytes({".*": None}, {".*": None})
    ends = 2 * 64 * 256 * 4
    assert replicated.argument_size_in_bytes - split.argument_size_in_bytes == ends - ends // 4


def test_one_stage_runs_every_schedule_as_the_sequential_model():
    mesh = _mesh((1, 2), ("stage", "data"))
    params, x, target = make(4, 8)
    want = loss_of(lambda p, x: sequential(layer, p, x))(params, x, target)
    for kw in (dict(), dict(schedule="circular", repeats=2), dict(schedule="1f1b", repeats=2)):
        got = loss_of(lambda p, x, kw=kw: pipeline(layer, p, x, microbatches=2, mesh=mesh, data_axis="data", **kw))
        assert_same(got(params, x, target), want)


def test_end_errors_name_the_end():
    mesh = _mesh((2,), ("stage",))
    params, tokens, targets = make_lm_placed(mesh, 2, 4)
    with pytest.raises(EinshardError, match="fn must be callable"):
        PipelineEnd(None)
    with pytest.raises(EinshardError, match="args must be a tuple"):
        PipelineEnd(split_embed, args=[targets])
    run = dict(microbatches=2, mesh=mesh)
    with pytest.raises(EinshardError, match="first= must be an einshard.lowering.PipelineEnd"):
        pipeline(layer, params["layers"], tokens, first=split_embed, **run)
    forgot_psum = PipelineEnd(lambda p, t: jnp.take(p["table"], t % 4, axis=0), params["embed"])
    with pytest.raises(EinshardError, match="varies over the stage axis 'stage'"):
        pipeline(layer, params["layers"], tokens, first=forgot_psum, **run)
    scalar = PipelineEnd(lambda p, h: jnp.sum(h @ p["w"]), params["head"], layouts={".*": None})
    x = np.zeros((4, 4), np.float32)
    with pytest.raises(EinshardError, match="keep the batch axis first"):
        pipeline(layer, params["layers"], x, last=scalar, **run)
    with pytest.raises(EinshardError, match=r"last= PipelineEnd's params leaf at \['w'\]"):
        pipeline(
            layer,
            params["layers"],
            x,
            last=PipelineEnd(split_head_loss, {"w": np.zeros((3, 4))}, args=(targets,)),
            **run,
        )


@pytest.mark.parametrize("schedule", ["gpipe", pytest.param("1f1b", marks=pytest.mark.slow)])
def test_an_eager_pipeline_is_traced_once_and_reused(schedule):
    """A repeated eager call (the same layer function, ends, schedule, mesh) reuses its staged program.

    Counted by tracing: each function counts the times JAX traces it.  A second call at the same shapes
    traces nothing (jit's cache hit, where a fresh closure each call compiled again: 1-2 s per call);
    ``einshard.clear_caches()`` forgets the program; a different layer function gets its own.
    """
    traced = {"layer": 0, "embed": 0, "head": 0}

    def counting_layer(p, h):
        traced["layer"] += 1
        return layer(p, h)

    def counting_embed(*a):
        traced["embed"] += 1
        return split_embed(*a)

    def counting_head(*a):
        traced["head"] += 1
        return split_head_loss(*a)

    mesh = _mesh((2, 2), ("stage", "data"), AxisType.Explicit)
    params, tokens, targets = make_lm_placed(mesh, 4, 8)

    def run(layer_fn=counting_layer):
        return pipeline(
            layer_fn,
            params["layers"],
            tokens,
            mesh=mesh,
            data_axis="data",
            microbatches=2,
            schedule=schedule,
            first=PipelineEnd(counting_embed, params["embed"]),
            last=PipelineEnd(counting_head, params["head"], layouts=HEAD, args=(targets,)),
        )

    first = run()
    after_first = dict(traced)
    assert all(after_first.values())
    second = run()
    assert traced == after_first  # nothing traced again
    np.testing.assert_array_equal(first, second)
    want = lm_sequential(*jax.device_get((params, tokens, targets)))
    np.testing.assert_allclose(np.mean(first), want, rtol=1e-5, atol=1e-6)
    einshard.clear_caches()
    run()
    assert traced["layer"] > after_first["layer"] and traced["embed"] > after_first["embed"]
    before = traced["layer"]
    run(lambda p, h: counting_layer(p, h))  # another function: its own program
    assert traced["layer"] > before
