"""An Equinox decoder block from ``eqx.nn`` layers: per-example, under ``vmap``, ``(out, in)`` weights."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from . import transformer_case

V, D, F, S, B, H = 64, 32, 64, 8, 8, 2


class Model(eqx.Module):
    embed: eqx.nn.Embedding
    ln1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    ln: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array) -> None:
        k = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(V, D, key=k[0])
        self.ln1 = eqx.nn.LayerNorm(D)
        self.attn = eqx.nn.MultiheadAttention(H, D, key=k[1])
        self.ln2 = eqx.nn.LayerNorm(D)
        self.up = eqx.nn.Linear(D, F, key=k[2])
        self.down = eqx.nn.Linear(F, D, key=k[3])
        self.ln = eqx.nn.LayerNorm(D)
        self.head = eqx.nn.Linear(D, V, use_bias=False, key=k[4])

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """One example: tokens [s] -> logits [s, v]."""
        h = jax.vmap(self.embed)(tokens)
        x = jax.vmap(self.ln1)(h)
        h = h + self.attn(x, x, x)
        h = h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(h))))
        return jax.vmap(self.head)(jax.vmap(self.ln)(h))


_model = eqx.filter_eval_shape(Model, jax.random.key(0))
PARAMS, STATIC = eqx.partition(_model, lambda x: isinstance(x, jax.ShapeDtypeStruct))


def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    tokens, labels = batch
    model = eqx.combine(params, STATIC)
    logits = jax.vmap(model)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


BATCH = (jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32))
# (out, in) weights: column-parallel splits the first axis, row-parallel the second.
_MEGATRON = (
    (r"\.(query|key|value)_proj\.weight", "o i -> o@model i"),
    (r"\.output_proj\.weight", "o i -> o i@model"),
    (r"\.up\.weight", "o i -> o@model i"),
    (r"\.up\.bias", "o -> o@model"),
    (r"\.down\.weight", "o i -> o i@model"),
)
CASE = transformer_case(
    "eqx",
    loss,
    PARAMS,
    BATCH,
    megatron=_MEGATRON,
    vocab=(
        (r"\.embed\.weight", "v d -> v@model d"),
        (r"\.head\.weight", "v d -> v@model d"),
    ),
    fsdp=((r"\.((query|key|value|output)_proj|up|down|head)\.weight", "o i -> o i@data"),),
)
