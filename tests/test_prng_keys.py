"""Typed PRNG keys (``jax.random.key``: dtype ``key<fry>``, 8 bytes; ``key<rbg>``, 16) in a model's parameters or
state reach every entry point that sizes or names a leaf: ``plan``, path rules' large-leaf warning, ``show``, the
interop leaves and the pipeline lowering.  ``np.dtype`` refuses such a dtype; each site sizes it with the one helper
(``einshard._src._compat.dtype_itemsize``), and each test below failed with ``TypeError: Cannot interpret
'key<fry>' as a data type`` (or a refusal) before."""

import io

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard import interop
from einshard._src import tree_rules
from einshard._src._compat import dtype_itemsize, is_array_dtype
from einshard.errors import EinshardError, EinshardWarning


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"))


def test_the_helper_sizes_keys_by_their_buffers_and_numbers_as_numpy_does():
    assert dtype_itemsize(jax.random.key(0).dtype) == 8
    assert dtype_itemsize(jax.random.key(0, impl="rbg").dtype) == 16
    for dt in (np.float32, jnp.bfloat16, np.int8, np.bool_, "float16", np.dtype(np.complex64)):
        assert dtype_itemsize(dt) == np.dtype(dt).itemsize
    # What a JAX array can hold: numbers (ml_dtypes' too, NumPy kind 'V'), bool, keys; not text or objects.
    for dt in (np.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.int4, np.bool_, jax.random.key(0).dtype):
        assert is_array_dtype(dt), dt
    for dt in (np.str_, np.bytes_, object, np.dtype([("a", np.int32)]), np.dtype("V8")):
        assert not is_array_dtype(dt), dt


def _loss(p, x):
    keep = jax.random.bernoulli(p["rng"][0], 0.9, (x.shape[-1],))
    return jnp.sum(jnp.tanh((x * keep) @ p["w"]))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_plan_takes_params_holding_a_key_batch(mesh, impl):
    params = {"w": jnp.ones((64, 32)), "rng": jax.random.split(jax.random.key(0, impl=impl), 8)}
    x = jnp.ones((16, 64))

    def step(p, x):  # a train state holding its dropout keys: the gradient is the weights'
        return jax.value_and_grad(lambda w: _loss({"w": w, "rng": p["rng"]}, x))(p["w"])

    result = einshard.plan(step, params, x, mesh=mesh, profile="cpu")
    assert r"^\['rng'\]$" in result.rules
    placed = einshard.einshard(params, result.rules, mesh=mesh)  # the plan's rules place the key batch too
    assert placed["rng"].dtype == params["rng"].dtype
    assert np.array_equal(jax.random.key_data(placed["rng"]), jax.random.key_data(params["rng"]))


def test_a_large_key_batch_left_replicated_warns_naming_it(mesh, monkeypatch):
    monkeypatch.setattr(tree_rules, "LARGE_LEAF_BYTES", 64)  # 8 keys of 8 bytes count as large
    tree_rules.cache_clear()
    tree = {"rng": jax.random.split(jax.random.key(0), 8), "b": np.zeros((4,), np.float32)}
    with pytest.warns(EinshardWarning, match=r"leave 1 large leaf.*\['rng'\]"):
        einshard.einshard(tree, {"rng": "k -> k", "b": None}, mesh=mesh)
    split = einshard.einshard(tree, {"rng": "k -> k@data", "b": None}, mesh=mesh)
    assert split["rng"].sharding.spec == jax.sharding.PartitionSpec("data")


def _shown(x):
    out = io.StringIO()
    einshard.show(x, file=out)
    return out.getvalue()


@pytest.mark.parametrize(("impl", "per_key"), [("threefry2x32", 8), ("rbg", 16)])
def test_show_names_a_key_batch_and_its_bytes(mesh, impl, per_key):
    keys = einshard.einshard(jax.random.split(jax.random.key(0, impl=impl), (8, 4)), "k j -> k@data j@model", mesh=mesh)
    text = _shown(keys)
    assert text.splitlines()[0].startswith(f"{keys.dtype}[a:8@data b:4@model]")
    assert f"each device holds a:2 b:2 (4 elements, {4 * per_key} B)" in text


def test_interop_leaves_size_keys_and_take_bfloat16(mesh):
    params = {
        "w": jax.ShapeDtypeStruct((64, 32), jnp.bfloat16),  # NumPy calls bfloat16 kind 'V': it was refused too
        "rng": jax.random.split(jax.random.key(0), 8),
    }
    imported = interop.from_logical([("embed", "model")], {"w": ("embed", None), "rng": (None,)}, params, mesh=mesh)
    assert imported.rules[r"^\['w'\](\.value)?$"] == "embed b -> embed@model b"
    sizes = {m.leaf.name: m.leaf.nbytes for m in imported.leaves}
    assert sizes == {"w": 64 * 32 * 2, "rng": 8 * 8}


def test_interop_leaves_still_refuse_what_no_array_holds(mesh):
    with pytest.raises(EinshardError, match=r"params=: the leaf \['s'\] holds <U1 values"):
        interop.from_logical([("embed", "model")], {"s": (None,)}, {"s": np.array(["a", "b"])}, mesh=mesh)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_takes_one_key_per_layer(schedule):
    """Dropout in a pipelined stack: the params carry one key per layer, split over the stages with the weights."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    layers, d = 8, 16
    params = {"w": jnp.full((layers, d, d), 0.1), "rng": jax.random.split(jax.random.key(0), layers)}

    def layer(p, h):
        keep = jax.random.bernoulli(p["rng"], 0.9, h.shape[-1:])  # a per-feature mask: the same per micro-batch
        return jnp.tanh(h @ p["w"]) * keep

    x = jnp.arange(16 * d, dtype=jnp.float32).reshape(16, d) / 100
    out = einshard.pipeline(layer, params, x, microbatches=2, mesh=mesh, data_axis="data", schedule=schedule)
    want = x
    for i in range(layers):
        want = layer(jax.tree.map(lambda a, i=i: a[i], params), want)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_pipeline_still_refuses_a_key_batch_as_its_activations():
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    keys = jax.random.split(jax.random.key(0), 16)
    with pytest.raises(EinshardError, match="x= takes a numeric dtype"):
        einshard.pipeline(lambda p, h: h, {"w": jnp.ones((8, 2))}, keys, microbatches=2, mesh=mesh)
