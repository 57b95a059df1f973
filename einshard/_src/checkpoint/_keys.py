"""Typed PRNG keys in checkpoints: stored as their key data (uint32 words), restored as keys of the saved impl.

A train state often holds a typed key (``jax.random.key``, ``nnx.Rngs``); its dtype (``key<fry>``) has no numpy
equivalent, so orbax cannot read it back by that dtype and the checksums have no bits to read.  The key data has
the key's shape plus trailing words (2 for threefry), laid out as the key with the words replicated.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

KEY_IMPL = "key_impl"  # the saved entry's field naming the key's PRNG implementation ("threefry2x32", "rbg", ...)


def is_typed_key(leaf: Any) -> bool:
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def stored(leaf: Any) -> Any:
    """What is written for ``leaf``: a typed key's data, anything else itself."""
    return jax.random.key_data(leaf) if is_typed_key(leaf) else leaf


def record(leaf: Any) -> dict[str, Any]:
    """The entry fields that let a typed key be read back: its implementation and its data's trailing words."""
    if not is_typed_key(leaf):
        return {}
    words = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)).shape[len(leaf.shape) :]
    return {KEY_IMPL: str(jax.random.key_impl(leaf)), "key_words": list(words)}


def stored_struct(entry: dict[str, Any], sharding: jax.sharding.Sharding) -> jax.ShapeDtypeStruct | None:
    """The array to read for a saved key (its data, laid out as the key with the words whole); None for others."""
    if KEY_IMPL not in entry:
        return None
    words = tuple(entry["key_words"])
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(entry["shape"]) - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec, *(None,) * len(words)))
    return jax.ShapeDtypeStruct((*entry["shape"], *words), jnp.uint32, sharding=sharding)


def restored(entry: dict[str, Any], value: Any) -> Any:
    """A read value as the leaf it was: the saved key data wrapped as a key of its implementation."""
    return jax.random.wrap_key_data(value, impl=entry[KEY_IMPL]) if KEY_IMPL in entry else value


def key_struct(entry: dict[str, Any]) -> jax.ShapeDtypeStruct:
    """The abstract key a saved key entry describes (for a restore without ``like``)."""
    words = (*entry["shape"], *entry["key_words"])
    return jax.eval_shape(lambda: jax.random.wrap_key_data(jnp.zeros(words, jnp.uint32), impl=entry[KEY_IMPL]))
