"""Where users start: a Flax NNX, an Equinox and a Keras 3 model, built from their libraries' own layers, on JAX's
default (Explicit) mesh with einshard's Megatron layouts — docs/default-mesh.md's recipe, as tests.

For each library: the model as written for an Auto mesh is refused by JAX on the default mesh;
``einshard.check_explicit`` names every op JAX rejects, at the model's own source lines; with the recipe's fixes
(``out_sharding=`` where the layer takes it, ``jax.reshard`` of the layer's input where it does not) the check is
clean, and three training steps on the default mesh give the parameters three steps give unsharded.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.core import ShardingTypeError
from jax.sharding import PartitionSpec as P

import einshard

VOCAB, D, F, BATCH = 64, 16, 32, 16
ROWS = P("data", None)  # the batch's layout: what each fixed op's result is asked to be


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"))  # JAX's default: Explicit axes


def _batch(mesh: Any | None) -> tuple[Any, Any]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, BATCH).astype(np.int32)
    target = rng.standard_normal((BATCH, D)).astype(np.float32)
    if mesh is None:
        return tokens, target
    return einshard.einshard(tokens, "b -> b@data", mesh=mesh), einshard.einshard(target, "b d -> b@data d", mesh=mesh)


def _train(loss: Callable[..., Any], params: Any, tokens: Any, target: Any, steps: int = 3) -> Any:
    @jax.jit
    def step(params: Any, tokens: Any, target: Any) -> Any:
        grads = jax.grad(loss)(params, tokens, target)
        return jax.tree.map(lambda p, g: p - 0.5 * g, params, grads)

    for _ in range(steps):
        params = step(params, tokens, target)
    return params


def _assert_close(got: Any, want: Any) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-6)


def _check_recipe(
    mesh: Any,
    loss: Callable[[bool], Callable[..., Any]],
    params: Any,
    host_params: Any,
    expected: dict[str, str],
) -> None:
    """The recipe, asserted: JAX refuses the Auto-mesh model; the check names each op at the model's lines;
    fixed, the check is clean and training equals unsharded."""
    tokens, target = _batch(mesh)
    with jax.set_mesh(mesh):
        with pytest.raises(ShardingTypeError):
            jax.jit(jax.grad(loss(False))).trace(params, tokens, target)
        report = einshard.check_explicit(jax.grad(loss(False)), params, tokens, target)
        found = {f.primitive: f for f in report.findings}
        for prim, line_text in expected.items():
            assert prim in found, str(report)
            assert "test_default_mesh_models.py" in found[prim].where and line_text in found[prim].where, str(report)
        assert einshard.check_explicit(jax.grad(loss(True)), params, tokens, target).ok
        trained = _train(loss(True), params, tokens, target)
    want = _train(loss(False), host_params, *_batch(None))
    _assert_close(trained, want)
    for leaf, spec in zip(jax.tree.leaves(trained), jax.tree.leaves(jax.tree.map(lambda x: x.sharding.spec, params))):
        assert leaf.sharding.spec == spec  # the parameters stay laid out as einshard placed them


# -- Flax NNX ----------------------------------------------------------------------------------------------------


def test_flax_nnx_model_trains_on_the_default_mesh(mesh: Any) -> None:
    nnx = pytest.importorskip("flax.nnx")
    import einshard.nnx as esx

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
            self.up = nnx.Linear(D, F, rngs=rngs)
            self.down = nnx.Linear(F, D, rngs=rngs)

        def __call__(self, tokens: jax.Array, rows: P | None = None) -> jax.Array:
            x = self.embed(tokens, out_sharding=rows)  # nnx_embed_line
            h = jax.nn.relu(self.up(x))
            return self.down(h, out_sharding=rows)  # nnx_down_line

    rules = {r"up.*kernel": "i o -> i o@model", r"up.*bias": "o -> o@model", r"down.*kernel": "f d -> f@model d"}
    graphdef, params = nnx.split(esx.init_sharded(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules=rules))
    host = jax.tree.map(np.asarray, params)

    def loss(fixed: bool) -> Callable[..., Any]:
        def f(params: Any, tokens: Any, target: Any) -> Any:
            out = nnx.merge(graphdef, params)(tokens, ROWS if fixed else None)
            return jnp.mean((out - target) ** 2)

        return f

    _check_recipe(mesh, loss, params, host, {"gather": "MLP.__call__", "dot_general": "MLP.__call__"})


# -- Equinox -----------------------------------------------------------------------------------------------------


def test_equinox_model_trains_on_the_default_mesh(mesh: Any) -> None:
    eqx = pytest.importorskip("equinox")

    class MLP(eqx.Module):  # type: ignore[misc]
        embed: Any
        up: Any
        down: Any

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3 = jax.random.split(key, 3)
            self.embed = eqx.nn.Embedding(VOCAB, D, key=k1)
            self.up = eqx.nn.Linear(D, F, key=k2)
            self.down = eqx.nn.Linear(F, D, key=k3)

        def __call__(self, tokens: jax.Array, rows: P | None = None) -> jax.Array:
            if rows is not None:
                # Equinox's layers take no out_sharding: the fix reshards their inputs, as check_explicit offers.
                tokens = jax.reshard(tokens, P())
            x = jax.vmap(self.embed)(tokens)
            if rows is not None:
                x = jax.reshard(x, rows)
            h = jax.nn.relu(jax.vmap(self.up)(x))
            if rows is not None:
                h = jax.reshard(h, rows)
            return jax.vmap(self.down)(h)

    params, static = eqx.partition(MLP(jax.random.key(0)), eqx.is_array)
    host = jax.tree.map(np.asarray, params)
    rules = {
        r"\.up\.weight": "o i -> o@model i",
        r"\.up\.bias": "o -> o@model",
        r"\.down\.weight": "d f -> d f@model",
        ".*": "... -> ...",
    }
    params = einshard.einshard(params, rules, mesh=mesh)

    def loss(fixed: bool) -> Callable[..., Any]:
        def f(params: Any, tokens: Any, target: Any) -> Any:
            out = eqx.combine(params, static)(tokens, ROWS if fixed else None)
            return jnp.mean((out - target) ** 2)

        return f

    _check_recipe(mesh, loss, params, host, {"gather": "MLP.__call__", "dot_general": "MLP.__call__"})


# -- Keras 3 -----------------------------------------------------------------------------------------------------


def _keras() -> Any:
    if os.environ.setdefault("KERAS_BACKEND", "jax") != "jax":
        pytest.skip("KERAS_BACKEND is set to another backend")
    keras = pytest.importorskip("keras")
    if keras.backend.backend() != "jax":
        pytest.skip("keras was imported with another backend")
    return keras


def test_keras_model_trains_on_the_default_mesh(mesh: Any) -> None:
    keras = _keras()

    class MLP(keras.Model):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.embed = keras.layers.Embedding(VOCAB, D)
            self.up = keras.layers.Dense(F, activation="relu")
            self.down = keras.layers.Dense(D)
            self.rows: P | None = None

        def call(self, tokens: Any) -> Any:
            if self.rows is None:
                return self.down(self.up(self.embed(tokens)))
            # Keras's layers take no out_sharding: reshard their inputs, as check_explicit offers.
            x = jax.reshard(self.embed(jax.reshard(tokens, P())), self.rows)
            return self.down(jax.reshard(self.up(x), self.rows))

    keras.utils.set_random_seed(0)
    model = MLP()
    model(np.zeros((8,), np.int32))  # builds the variables
    paths = [v.path for v in model.trainable_variables]
    host = {v.path: np.asarray(v.value) for v in model.trainable_variables}
    rules = {
        r"dense/kernel": "i o -> i o@model",
        r"dense/bias": "o -> o@model",
        r"dense_1/kernel": "f d -> f@model d",
        ".*": "... -> ...",
    }
    params = einshard.einshard(dict(host), rules, mesh=mesh)

    def loss(fixed: bool) -> Callable[..., Any]:
        def f(params: Any, tokens: Any, target: Any) -> Any:
            model.rows = ROWS if fixed else None
            out, _ = model.stateless_call([params[p] for p in paths], [], tokens)
            return jnp.mean((out - target) ** 2)

        return f

    _check_recipe(mesh, loss, params, host, {"gather": "MLP.call", "dot_general": "MLP.call"})
