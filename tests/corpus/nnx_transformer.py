"""A Flax NNX decoder block from ``nnx.Embed``, ``nnx.LayerNorm``, ``nnx.MultiHeadAttention``, ``nnx.Linear``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from . import transformer_case

V, D, F, S, B, H = 64, 32, 64, 8, 8, 2


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(H, D, qkv_features=D, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.up = nnx.Linear(D, F, rngs=rngs)
        self.down = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        x = self.ln1(h)
        h = h + self.attn(x, x, x)
        return h + self.down(jax.nn.gelu(self.up(self.ln2(h))))


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.block = Block(rngs)
        self.ln = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.ln(self.block(self.embed(tokens))))


GRAPH, PARAMS = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
PARAMS = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), PARAMS)


def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    tokens, labels = batch
    logits = nnx.merge(GRAPH, params)(tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


BATCH = (jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32))
_MEGATRON = (
    (r"'(query|key|value)'\]\['kernel", "d h k -> d h@model k"),
    (r"'(query|key|value)'\]\['bias", "h k -> h@model k"),
    (r"'out'\]\['kernel", "h k d -> h@model k d"),
    (r"'up'\]\['kernel", "d f -> d f@model"),
    (r"'up'\]\['bias", "f -> f@model"),
    (r"'down'\]\['kernel", "f d -> f@model d"),
)
CASE = transformer_case(
    "nnx",
    loss,
    PARAMS,
    BATCH,
    megatron=_MEGATRON,
    vocab=(
        (r"embed", "v d -> v@model d"),
        (r"'head'", "d v -> d v@model"),
    ),
    fsdp=(
        (r"'(query|key|value)'\]\['kernel", "d h k -> d@data h k"),
        (r"'out'\]\['kernel", "h k d -> h k d@data"),
        (r"'(up|down|head)'\]\['kernel", "a b -> a@data b"),
    ),
)
