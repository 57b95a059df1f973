"""Typed PRNG keys (``jax.random.key``, what ``nnx.Rngs`` holds) survive a checkpoint: same impl, same bits,
same layout — saved as their uint32 key data, wrapped back on restore; a key restored into numbers (or the
reverse) is an error naming the leaf."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from einshard import EinshardError, checkpoint, describe, einshard


def _mesh(kind: AxisType) -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))


def _state(mesh: jax.sharding.Mesh, impl: str) -> dict:
    keys = jax.random.split(jax.random.key(1, impl=impl), 8)
    return {
        "w": einshard(jnp.arange(32.0).reshape(8, 4), "a b -> a@data b", mesh=mesh),
        "key": jax.random.key(0, impl=impl),
        "keys": einshard(keys, "k -> k@data", mesh=mesh),
        "step": jnp.int32(3),
    }


def _assert_same_keys(got: jax.Array, want: jax.Array) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(want)))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("with_like", [True, False], ids=["like", "no-like"])
def test_typed_keys_round_trip_with_their_impl_bits_and_layout(tmp_path, impl, kind, with_like):
    mesh = _mesh(kind)
    state = _state(mesh, impl)
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, state)
    back = checkpoint.restore(path, like=state if with_like else None)
    for name in ("key", "keys"):
        _assert_same_keys(back[name], state[name])
    assert describe(back["keys"]) == describe(state["keys"]) == "a -> a@data"
    np.testing.assert_array_equal(np.asarray(back["w"]), np.asarray(state["w"]))
    # The restored keys work as keys: the same draws as the saved ones.
    np.testing.assert_array_equal(
        np.asarray(jax.random.normal(back["key"], (3,))), np.asarray(jax.random.normal(state["key"], (3,)))
    )


def test_key_entries_name_their_impl_in_the_meta(tmp_path):
    state = _state(_mesh(AxisType.Explicit), "threefry2x32")
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, state)
    leaves = {leaf["path"]: leaf for leaf in checkpoint.read_meta(path)["leaves"]}
    assert leaves["['keys']"]["key_impl"] == "threefry2x32" and leaves["['keys']"]["shape"] == [8]
    assert "key_impl" not in leaves["['w']"]


def test_a_key_restored_into_numbers_is_an_error_naming_the_leaf(tmp_path):
    state = _state(_mesh(AxisType.Explicit), "threefry2x32")
    path = str(tmp_path / "ckpt")
    checkpoint.save(path, state)
    like = {**state, "keys": jax.ShapeDtypeStruct((8,), jnp.uint32)}
    with pytest.raises(EinshardError, match=r"\['keys'\] was saved as a PRNG key"):
        checkpoint.restore(path, like=like)
    numbers = {**state, "key": jnp.zeros((), jnp.float32)}
    checkpoint.save(str(tmp_path / "numbers"), numbers)
    with pytest.raises(EinshardError, match=r"\['key'\] was saved as an array of float32"):
        checkpoint.restore(str(tmp_path / "numbers"), like=state)
