"""A ViT from Keras 3's own layers (Conv2D patches, MultiHeadAttention, LayerNormalization, Dense), tiny."""

from __future__ import annotations

from functools import cache

import jax.numpy as jnp
import numpy as np
import optax

from . import Family
from ._keras import pure_loss

B, HW, PATCH, D, F, H, CLASSES = 8, 16, 4, 32, 64, 2, 10
N = (HW // PATCH) ** 2

_IMG = "b h w c -> b@data h w c"
_LBL = "b -> b@data"
# Megatron for keras.layers.MultiHeadAttention: query/key/value kernels (d, heads, head_dim), output
# (heads, head_dim, d); MLP Dense kernels (d, f) then (f, d).
_MEGATRON = (
    (r"(query|key|value)/kernel", "d h k -> d h@model k"),
    (r"attention_output/kernel", "h k d -> h@model k d"),
    (r"mlp_up/kernel", "d f -> d f@model"),
    (r"mlp_up/bias", "f -> f@model"),
    (r"mlp_down/kernel", "f d -> f@model d"),
)
_FSDP = (
    (r"(query|key|value)/kernel", "d h k -> d@data h k"),
    (r"attention_output/kernel", "h k d -> h k d@data"),
    (r"mlp_(up|down)/kernel", "a b -> a@data b"),
)


def _build():
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)
    image = keras.Input((HW, HW, 3))
    x = layers.Conv2D(D, PATCH, strides=PATCH, name="patches")(image)
    x = layers.Reshape((N, D))(x)
    x = x + layers.Embedding(N, D, name="position")(keras.ops.arange(N))
    y = layers.LayerNormalization(name="ln1")(x)
    x = x + layers.MultiHeadAttention(H, D // H, name="attention")(y, y)
    y = layers.LayerNormalization(name="ln2")(x)
    y = layers.Dense(F, activation="gelu", name="mlp_up")(y)
    x = x + layers.Dense(D, name="mlp_down")(y)
    x = layers.GlobalAveragePooling1D()(layers.LayerNormalization(name="ln")(x))
    return keras.Model(image, layers.Dense(CLASSES, name="head")(x))


def _head(logits, p, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@cache
def vit() -> Family:
    loss, params = pure_loss(_build(), _head)
    rng = np.random.default_rng(0)
    batch = (
        jnp.asarray(rng.normal(size=(B, HW, HW, 3)), jnp.float32),
        jnp.asarray(rng.integers(0, CLASSES, B), jnp.int32),
    )
    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    data = (_IMG, _LBL)
    batch_rules = {"dp": data, "tp": ("b h w c -> b h w c", "b -> b"), "dp_tp": data, "fsdp": data}
    return Family("keras_vit", "keras", "vit", loss, params, batch, rules, batch_rules)
