"""Pipelines (GPipe and circular; 1F1B in test_pipeline_1f1b.py) equal the sequential model: loss and every gradient, with and without DP/TP."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from pipeline_models import HI, D, assert_same, layer, loss_of, make, sequential

from einshard._src.lowering.pipeline import circular_layer_order, pipeline, pipeline_info
from einshard.errors import EinshardError


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


# (stages, data, microbatches, repeats, schedule).  The quick cells cover both schedules, one stage, a data axis,
# micro-batch counts that are not a multiple of the stages and three rounds; CI runs the rest with the slow tests.
QUICK = [
    (4, 2, 3, 1, "gpipe"),
    (1, 2, 2, 1, "gpipe"),
    (2, 2, 3, 2, "circular"),
    (2, 2, 4, 3, "circular"),
    (4, 1, 5, 1, "circular"),
]
SLOW = [
    (2, 1, 2, 1, "gpipe"),
    (4, 1, 4, 1, "gpipe"),
    (4, 1, 8, 1, "gpipe"),
    (8, 1, 2, 1, "gpipe"),
    (2, 1, 2, 2, "circular"),
    (4, 1, 4, 2, "circular"),
    (4, 2, 6, 2, "circular"),
]
GRID = QUICK + [pytest.param(*cell, marks=pytest.mark.slow) for cell in SLOW]


@pytest.mark.parametrize("stages,data,microbatches,repeats,schedule", GRID)
def test_pipeline_equals_sequential(stages, data, microbatches, repeats, schedule):
    mesh = _mesh((stages, data), ("stage", "data"))
    layers = stages * repeats * 2
    params, x, target = make(layers, data * microbatches * 2)
    want = loss_of(lambda p, x: sequential(layer, p, x))(params, x, target)
    kw = dict(microbatches=microbatches, schedule=schedule, repeats=repeats, mesh=mesh, data_axis="data")
    got = loss_of(lambda p, x: pipeline(layer, p, x, **kw))(params, x, target)
    assert_same(got, want)
    polluted = loss_of(lambda p, x: pipeline(layer, p, x, bubble_value=np.nan, **kw))(params, x, target)
    assert_same(polluted, want)


def test_without_sanitising_nan_bubbles_poison_the_gradient():
    # The check above is sensitive: the same pollution, unsanitised, gives NaN gradients.
    mesh = _mesh((4, 1), ("stage", "data"))
    params, x, target = make(8, 8)
    kw = dict(microbatches=4, mesh=mesh, bubble_value=np.nan)
    loss, grads = loss_of(lambda p, x: pipeline(layer, p, x, sanitize=False, **kw))(params, x, target)
    assert np.isfinite(loss)  # the forward masks the bubbles' outputs ...
    assert not np.all(np.isfinite(grads[0]["w"]))  # ... but 0 * nan reaches the weights' gradient


def test_remat_and_presorted_circular_layers():
    mesh = _mesh((2, 1), ("stage", "data"))
    params, x, target = make(8, 8)
    want = loss_of(lambda p, x: sequential(layer, p, x))(params, x, target)
    got = loss_of(lambda p, x: pipeline(layer, p, x, microbatches=4, mesh=mesh, remat=True))(params, x, target)
    assert_same(got, want)
    stored = circular_layer_order(params, 2, 2)
    kw = dict(microbatches=2, schedule="circular", repeats=2, mesh=mesh, layers_in_circular_order=True)
    loss, grads = loss_of(lambda p, x: pipeline(layer, p, x, **kw))(stored, x, target)
    np.testing.assert_allclose(loss, want[0], rtol=2e-6)
    np.testing.assert_allclose(grads[0]["w"], circular_layer_order(want[1][0], 2, 2)["w"], rtol=1e-5, atol=2e-6)


def test_tensor_parallel_layers_inside_stages():
    mesh = _mesh((2, 2, 2), ("stage", "data", "model"))
    rng = np.random.default_rng(3)
    L, F = 4, 8
    params = {
        "w1": (rng.standard_normal((L, D, F)) / 2).astype(np.float32),
        "w2": (rng.standard_normal((L, F, D)) / 3).astype(np.float32),
    }
    x = rng.standard_normal((8, D)).astype(np.float32)
    target = rng.standard_normal((8, D)).astype(np.float32)

    def mlp(p, h, reduce=lambda v: v):  # Megatron MLP: column- then row-parallel, one psum
        return h + reduce(jnp.dot(jnp.tanh(jnp.dot(h, p["w1"], precision=HI)), p["w2"], precision=HI))

    def tp_mlp(p, h):
        return mlp(p, h, lambda v: jax.lax.psum(v, "model"))

    layouts = {"w1": "layer d f -> layer@stage d f@model", "w2": "layer f d -> layer@stage f@model d"}
    kw = dict(microbatches=2, mesh=mesh, data_axis="data", param_layouts=layouts)
    got = loss_of(lambda p, x: pipeline(tp_mlp, p, x, **kw))(params, x, target)
    want = loss_of(lambda p, x: sequential(mlp, p, x))(params, x, target)
    assert_same(got, want)


def _count(hlo, op):
    return len(re.findall(rf"= [^=\n]*? {op}(-start)?\(", hlo))


def test_hlo_one_permute_per_scan_body():
    mesh = _mesh((4, 2), ("stage", "data"))
    params, x, target = make(8, 16)
    f = jax.jit(lambda p, x: pipeline(layer, p, x, microbatches=4, mesh=mesh, data_axis="data"))
    hlo = f.lower(params, x).compile().as_text()
    assert _count(hlo, "collective-permute") == 1
    assert _count(hlo, "all-gather") == 0
    g = jax.jit(jax.grad(lambda p, x: jnp.sum(pipeline(layer, p, x, microbatches=4, mesh=mesh, data_axis="data"))))
    ghlo = g.lower(params, x).compile().as_text()
    assert _count(ghlo, "collective-permute") == 2  # forward scan and the reversed (transposed) scan


def test_info():
    mesh = _mesh((4, 2), ("stage", "data"))
    params, x, _ = make(16, 32)
    info = pipeline_info(params, x, microbatches=4, mesh=mesh, data_axis="data")
    assert (info.stages, info.iterations, info.layers_per_visit, info.microbatch_shape) == (4, 7, 4, (4, D))
    assert info.bubble_fraction == pytest.approx(3 / 7)
    circ = pipeline_info(params, x, microbatches=4, schedule="circular", repeats=2, mesh=mesh, data_axis="data")
    assert circ.bubble_fraction == pytest.approx(3 / 11) and circ.layers_per_visit == 2
    remat = pipeline_info(params, x, microbatches=4, mesh=mesh, data_axis="data", remat=True)
    assert remat.activation_bytes < info.activation_bytes


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(microbatches=3), "does not split into microbatches=3"),
        (dict(microbatches=2, schedule="circular", repeats=2), "at least as many micro-batches"),
        (dict(microbatches=4, repeats=2), "belongs to schedule='circular' or '1f1b'"),
        (dict(microbatches=4, schedule="pipedream"), "schedule must be one of"),
        (dict(microbatches=4, stage_axis="pp"), "no stage_axis 'pp'"),
        (dict(microbatches=4, param_layouts="layer d f -> layer d f@stage"), "exactly the stage axis"),
    ],
)
def test_errors(kw, message):
    mesh = _mesh((4,), ("stage",))
    params = {"w": np.zeros((8, D, D), np.float32)}
    with pytest.raises(EinshardError, match=message):
        pipeline(lambda p, h: h @ p["w"], params, np.zeros((8, D), np.float32), mesh=mesh, **kw)
    with pytest.raises(EinshardError, match="layers do not split"):
        pipeline(lambda p, h: h, {"w": np.zeros((6, D))}, np.zeros((8, D)), microbatches=4, mesh=mesh)


def test_explicit_mesh_axes():
    kind = AxisType.Explicit
    mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=(kind, kind))
    params, x, target = make(8, 16)
    want = loss_of(lambda p, x: sequential(layer, p, x))(params, x, target)
    kw = dict(microbatches=2, schedule="circular", repeats=2, mesh=mesh, data_axis="data")
    with jax.set_mesh(mesh):
        got = loss_of(lambda p, x: pipeline(layer, p, x, **kw))(params, x, target)
    assert_same(got, want)


def test_circular_memory_does_not_grow_with_microbatches():
    # AD of the circular scan used to save each iteration's slice of the weights (one chunk per tick, M·R+S-1
    # of them); the rounds now re-slice in the backward.  Same global batch: more, smaller micro-batches.
    from pipeline_models import step_temp_bytes

    few = step_temp_bytes(2, 4, "circular", 2, batch=32)
    many = step_temp_bytes(2, 16, "circular", 2, batch=32)
    chunk = 2 * (64 * 64 + 64) * 4  # one round's weights on a device: 2 layers of w and b
    assert many < few + chunk
