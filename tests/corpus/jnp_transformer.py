"""A plain-``jax.numpy`` decoder block: embedding + position table, pre-norm attention and MLP, optax loss."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from . import transformer_case

V, D, F, S, B, H = 64, 32, 64, 8, 8, 2


def _norm(x: jax.Array, w: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * w


def loss(p: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    tokens, labels = batch
    h = p["embed"][tokens] + p["pos"]  # [1, s, d] position table broadcast over the batch
    x = _norm(h, p["ln1"])
    q, k, v = (jnp.einsum("bsd,dh->bsh", x, p[n]).reshape(B, S, H, D // H) for n in ("wq", "wk", "wv"))
    a = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // H) ** 0.5, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(B, S, D)
    h = h + o @ p["wo"]
    h = h + jax.nn.gelu(_norm(h, p["ln2"]) @ p["w1"]) @ p["w2"]
    logits = _norm(h, p["lnf"]) @ p["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _sds(*shape: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


PARAMS = {
    "embed": _sds(V, D),
    "pos": _sds(1, S, D),
    "ln1": _sds(D),
    "wq": _sds(D, D),
    "wk": _sds(D, D),
    "wv": _sds(D, D),
    "wo": _sds(D, D),
    "ln2": _sds(D),
    "w1": _sds(D, F),
    "w2": _sds(F, D),
    "lnf": _sds(D),
    "head": _sds(D, V),
}
BATCH = (_sds(B, S, dtype=jnp.int32), _sds(B, S, dtype=jnp.int32))

_MEGATRON = (
    (r"w[qkv]|w1", "d f -> d f@model"),
    (r"wo|w2", "f d -> f@model d"),
)

CASE = transformer_case(
    "jnp",
    loss,
    PARAMS,
    BATCH,
    megatron=_MEGATRON,
    vocab=(
        (r"embed", "v d -> v@model d"),
        (r"head", "d v -> d v@model"),
    ),
    fsdp=((r"w|head", "a b -> a@data b"),),
)
