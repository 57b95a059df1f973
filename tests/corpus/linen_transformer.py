"""A Flax Linen decoder block from ``nn.Embed``, ``nn.LayerNorm``, ``nn.MultiHeadDotProductAttention``, ``nn.Dense``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from . import transformer_case

V, D, F, S, B, H = 64, 32, 64, 8, 8, 2


class Model(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = nn.Embed(V, D, name="embed")(tokens)
        x = nn.LayerNorm(name="ln1")(h)
        h = h + nn.MultiHeadDotProductAttention(H, qkv_features=D, name="attn")(x, x)
        x = nn.LayerNorm(name="ln2")(h)
        h = h + nn.Dense(D, name="down")(jax.nn.gelu(nn.Dense(F, name="up")(x)))
        return nn.Dense(V, use_bias=False, name="head")(nn.LayerNorm(name="ln")(h))


MODEL = Model()
BATCH = (jax.ShapeDtypeStruct((B, S), jnp.int32), jax.ShapeDtypeStruct((B, S), jnp.int32))
PARAMS = jax.eval_shape(MODEL.init, jax.random.key(0), BATCH[0])


def loss(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    tokens, labels = batch
    logits = MODEL.apply(params, tokens)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


_MEGATRON = (
    (r"'(query|key|value)'\]\['kernel", "d h k -> d h@model k"),
    (r"'(query|key|value)'\]\['bias", "h k -> h@model k"),
    (r"'out'\]\['kernel", "h k d -> h@model k d"),
    (r"'up'\]\['kernel", "d f -> d f@model"),
    (r"'up'\]\['bias", "f -> f@model"),
    (r"'down'\]\['kernel", "f d -> f@model d"),
)
CASE = transformer_case(
    "linen",
    loss,
    PARAMS,
    BATCH,
    megatron=_MEGATRON,
    vocab=(
        (r"'embed'", "v d -> v@model d"),
        (r"'head'", "d v -> d v@model"),
    ),
    fsdp=(
        (r"'(query|key|value)'\]\['kernel", "d h k -> d@data h k"),
        (r"'out'\]\['kernel", "h k d -> h k d@data"),
        (r"'(up|down|head)'\]\['kernel", "a b -> a@data b"),
    ),
)
