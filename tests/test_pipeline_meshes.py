"""Pipelines where users are: params placed first with ``einshard``, on Explicit (``jax.make_mesh``'s default),
Auto and mixed meshes, the mesh from ``mesh=`` or ``jax.set_mesh``, eager, under ``jax.jit`` and ``jax.grad``;
and bad arguments give an EinshardError that names them."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import einshard
from einshard import EinshardError
from einshard._src.lowering.pipeline import circular_layer_order, pipeline, pipeline_info

HI = jax.lax.Precision.HIGHEST
D = 4
E, A = AxisType.Explicit, AxisType.Auto
KINDS = {"explicit": (E, E), "auto": (A, A), "stage-explicit": (E, A), "data-explicit": (A, E)}
SCHEDULES = {"gpipe": dict(schedule="gpipe"), "circular": dict(schedule="circular", repeats=2)}
SCHEDULES["1f1b"] = dict(schedule="1f1b")
SCHEDULES["interleaved"] = dict(schedule="1f1b", repeats=2)


def layer(p, h):
    return jnp.tanh(jnp.dot(h, p["w"], precision=HI) + p["b"]) + 0.5 * h


def sequential(params, x):
    return jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)[0]


def make(layers=8, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "w": (rng.standard_normal((layers, D, D)) / np.sqrt(D)).astype(np.float32),
        "b": (0.1 * rng.standard_normal((layers, D))).astype(np.float32),
    }
    return (
        params,
        rng.standard_normal((batch, D)).astype(np.float32),
        rng.standard_normal((batch, D)).astype(np.float32),
    )


def close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-6)


# The full matrix (every mesh kind x mesh source x schedule) runs with the slow tests; these cells cover
# every schedule, both sources, Explicit, Auto and a mixed mesh in the quick run.
QUICK = {
    ("explicit", "mesh=", "gpipe"),
    ("explicit", "set_mesh", "circular"),
    ("data-explicit", "set_mesh", "1f1b"),
    ("auto", "mesh=", "interleaved"),
}
MATRIX = [
    pytest.param(k, src, sch, marks=() if (k, src, sch) in QUICK else pytest.mark.slow)
    for k in KINDS
    for src in ("mesh=", "set_mesh")
    for sch in SCHEDULES
]


@pytest.mark.parametrize("kind,source,schedule", MATRIX)
def test_placed_params_on_every_mesh_kind(kind, source, schedule):
    mesh = jax.make_mesh((2, 4), ("stage", "data"), axis_types=KINDS[kind])
    params, x, target = make()
    placed = einshard.einshard(params, "layer ... -> layer@stage ...", mesh=mesh)  # as the docs do
    xb = einshard.einshard(x, "b d -> b@data d", mesh=mesh)
    kw = dict(microbatches=2, data_axis="data", **SCHEDULES[schedule])
    if source == "mesh=":
        kw["mesh"] = mesh
    context = jax.set_mesh(mesh) if source == "set_mesh" else contextlib.nullcontext()

    def run(p, x):
        return pipeline(layer, p, x, **kw)

    def loss(p, x):
        return jnp.mean((run(p, x) - target) ** 2)

    want_y = sequential(params, x)
    want_loss, want_grads = jax.value_and_grad(lambda p, x: jnp.mean((sequential(p, x) - target) ** 2), (0, 1))(
        params, x
    )
    with context:
        close(run(placed, xb), want_y)  # eager
        close(jax.jit(run)(placed, xb), want_y)
        got_loss, got_grads = jax.jit(jax.value_and_grad(loss, (0, 1)))(placed, xb)
    close(got_loss, want_loss)
    for got, want in zip(jax.tree_util.tree_leaves(got_grads), jax.tree_util.tree_leaves(want_grads), strict=True):
        close(got, want)


def test_eager_grad_inside_set_mesh():
    mesh = jax.make_mesh((2, 4), ("stage", "data"))  # JAX's default: Explicit axes
    params, x, target = make()
    with jax.set_mesh(mesh):
        placed = einshard.einshard(params, "layer ... -> layer@stage ...")
        grads = jax.grad(lambda p: jnp.mean((pipeline(layer, p, x, microbatches=2, schedule="1f1b") - target) ** 2))(
            placed
        )
    want = jax.grad(lambda p: jnp.mean((sequential(p, x) - target) ** 2))(params)
    close(grads["w"], want["w"])
    close(grads["b"], want["b"])


def test_mesh_from_placed_operands():
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    params, x, _ = make()
    placed = einshard.einshard(params, "layer ... -> layer@stage ...", mesh=mesh)
    close(pipeline(layer, placed, x, microbatches=2), sequential(params, x))  # no mesh=, no set_mesh


def test_circular_layer_order_keeps_the_stage_sharding():
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    w = einshard.einshard(np.arange(8 * 3, dtype=np.float32).reshape(8, 3), "l d -> l@stage d", mesh=mesh)
    got = circular_layer_order(w, 2, 2)
    assert got.sharding == w.sharding
    np.testing.assert_array_equal(got[:, 0], circular_layer_order(np.asarray(w), 2, 2)[:, 0])
    np.testing.assert_array_equal(jax.jit(lambda w: circular_layer_order(w, 2, 2))(w), got)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(microbatches=3), "microbatches=3"),
        (dict(microbatches=0), "microbatches must be a positive int"),
        (dict(microbatches=2.0), "microbatches must be a positive int"),
        (dict(microbatches=2, repeats=0, schedule="circular"), "repeats must be a positive int"),
        (dict(microbatches=2, schedule="circular", repeats=2), "at least as many micro-batches"),
        (dict(microbatches=4, schedule="1f1b", repeats=3), "layers do not split into 4 stages x 3 repeats"),
        (dict(microbatches=4, repeats=2), "belongs to schedule='circular' or '1f1b'"),
        (dict(microbatches=4, schedule="zero-bubble"), "schedule must be one of"),
        (dict(microbatches=4, stage_axis="pp"), "no stage_axis 'pp'"),
        (dict(microbatches=4, data_axis="batch"), "data_axis 'batch'"),
        (dict(microbatches=4, mesh={"stage": 4, "data": 1}), "dict of sizes"),
        (dict(microbatches=4, mesh="stage"), "mesh= takes a jax.sharding.Mesh"),
    ],
)
def test_bad_arguments_name_the_argument(kw, message):
    mesh = jax.make_mesh((4, 1), ("stage", "data"))
    params = {"w": np.zeros((8, D, D), np.float32)}
    kw = {"mesh": mesh, **kw}
    with pytest.raises(EinshardError, match=message):
        pipeline(lambda p, h: h @ p["w"], params, np.zeros((8, D), np.float32), **kw)


def test_bad_leaves_and_counts():
    mesh = jax.make_mesh((4,), ("stage",), devices=jax.devices()[:4])
    x = np.zeros((8, D), np.float32)
    cases = [
        ({"w": np.zeros((6, D))}, dict(microbatches=4), "6 layers do not split into 4 stages"),
        ({"w": np.zeros((8, D)), "name": "relu"}, dict(microbatches=4), r"\['name'\] is a str, not an array"),
        ({"w": np.zeros((8, D)), "n": 3}, dict(microbatches=4), r"\['n'\] is a int"),
        ({"w": np.zeros((8, D)), "v": np.zeros(())}, dict(microbatches=4), "is a scalar"),
        ({"w": np.zeros((8, D)), "v": np.zeros((4, D))}, dict(microbatches=4), "same leading layer count"),
        ({"w": np.zeros((8, D))}, dict(microbatches=6, schedule="1f1b", repeats=2), "multiple of 4"),
        ({}, dict(microbatches=4), "no array leaves"),
    ]
    for params, kw, message in cases:
        with pytest.raises(EinshardError, match=message):
            pipeline(lambda p, h: h, params, np.zeros((48, D), np.float32), mesh=mesh, **kw)
    with pytest.raises(EinshardError, match="x must be an array"):
        pipeline(lambda p, h: h, {"w": np.zeros((8, D))}, [1.0] * 8, microbatches=4, mesh=mesh)
    with pytest.raises(EinshardError, match="layer_fn must be callable"):
        pipeline(None, {"w": np.zeros((8, D))}, x, microbatches=4, mesh=mesh)
    with pytest.raises(EinshardError, match="pipeline\\(\\) needs a mesh"):
        pipeline(lambda p, h: h, {"w": np.zeros((8, D))}, x, microbatches=4)
    other = jax.make_mesh((4,), ("stage",), devices=jax.devices()[4:])
    placed = einshard.einshard({"w": np.zeros((8, D))}, "l d -> l@stage d", mesh=other)
    with pytest.raises(EinshardError, match="operand 1 is laid out on"):
        pipeline(lambda p, h: h, placed, x, microbatches=4, mesh=mesh)
    with pytest.raises(EinshardError, match="repeats must be a positive int, got 0"):
        circular_layer_order({"w": np.zeros((8, D))}, 2, 0)
    with pytest.raises(EinshardError, match=r"\['w'\] has 6 layers"):
        circular_layer_order({"w": np.zeros((6, D))}, 2, 2)
    # A stage axis of size 1 is a one-stage pipeline (the demo runs it on one device), not an error.
    one = jax.make_mesh((1, 2), ("stage", "data"), devices=jax.devices()[:2])
    params, xs, _ = make(4, 8)
    close(pipeline(layer, params, xs, microbatches=2, schedule="1f1b", mesh=one), sequential(params, xs))
    # pipeline_info takes a dict of sizes (only sizes matter there)
    info = pipeline_info({"w": np.zeros((8, D))}, x, microbatches=4, mesh={"stage": 4})
    assert info.stages == 4
