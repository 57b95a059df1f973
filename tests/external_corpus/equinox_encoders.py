"""Equinox's own layers in two encoders, tiny: a BERT-like text encoder and an MLP-Mixer over image patches.

* ``eqx_bert``: ``eqx.nn.Embedding`` token and learned position tables, two post-norm blocks of
  ``eqx.nn.MultiheadAttention`` (padding mask from the batch) and ``eqx.nn.LayerNorm`` with an ``eqx.nn.MLP``
  (gelu), a classifier on the first token — the BERT shape;
* ``eqx_mixer``: an ``eqx.nn.Conv2d`` patch embedding, two Mixer blocks (token mixing: an ``eqx.nn.MLP`` over
  the transposed (channels, tokens) map; channel mixing: one over (tokens, channels)), ``eqx.nn.LayerNorm``,
  mean-pooled ``eqx.nn.Linear`` head — the transposes between the two mixings cross split axes.

Parameters are the modules' arrays (``eqx.partition(model, eqx.is_array)``), combined with the static parts in
the loss, as an Equinox training step does; every layer runs per example under ``jax.vmap``.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import Family

V, D, F, H, S, B, L, CLASSES = 64, 32, 64, 4, 8, 8, 2, 10
HW, PATCH, TOKEN_F = 16, 4, 32  # 16 patches of 4x4

_TOKENS = "b s -> b@data s"
_LABELS = "b -> b@data"
# Megatron for eqx.nn.MultiheadAttention ((out, in) Linear weights: query/key/value split on their outputs, the
# output projection on its inputs) and eqx.nn.MLP (layers[0] on its outputs, layers[1] on its inputs).
_ATTENTION = (
    (r"(query_proj|key_proj|value_proj)\.weight", "f d -> f@model d"),
    (r"output_proj\.weight", "d f -> d f@model"),
)
_MLP = (
    (r"mlp\.layers\[0\]\.weight", "f d -> f@model d"),
    (r"mlp\.layers\[0\]\.bias", "f -> f@model"),
    (r"mlp\.layers\[1\]\.weight", "d f -> d f@model"),
)
# FSDP: every weight split over 'data' on its first axis (tables and the patch convolution's kernel too), but
# the classifier's (10 classes, d): ten rows do not split four ways.
_FSDP = (
    (r"(?<!head)\.weight", "a b -> a@data b"),
    (r"weight", "o i h w -> o@data i h w"),
)


@cache
def bert() -> Family:
    import equinox as eqx

    class Block(eqx.Module):
        attention: eqx.nn.MultiheadAttention
        ln1: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP
        ln2: eqx.nn.LayerNorm

        def __init__(self, key: jax.Array) -> None:
            k1, k2 = jax.random.split(key)
            self.attention = eqx.nn.MultiheadAttention(H, D, key=k1)
            self.mlp = eqx.nn.MLP(D, D, F, depth=1, activation=jax.nn.gelu, key=k2)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)

        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            x = jax.vmap(self.ln1)(x + self.attention(x, x, x, mask=mask))
            return jax.vmap(self.ln2)(x + jax.vmap(self.mlp)(x))

    class Bert(eqx.Module):
        tokens: eqx.nn.Embedding
        positions: eqx.nn.Embedding
        blocks: list[Block]
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3, *ks = jax.random.split(key, 3 + L)
            self.tokens, self.positions = eqx.nn.Embedding(V, D, key=k1), eqx.nn.Embedding(S, D, key=k2)
            self.blocks = [Block(k) for k in ks]
            self.head = eqx.nn.Linear(D, CLASSES, key=k3)

        def __call__(self, tokens: jax.Array, keep: jax.Array) -> jax.Array:
            x = jax.vmap(self.tokens)(tokens) + jax.vmap(self.positions)(jnp.arange(tokens.shape[0]))
            mask = jnp.broadcast_to(keep[None, :] > 0, (keep.shape[0],) * 2)  # (query, key): none attends to padding
            for block in self.blocks:
                x = block(x, mask)
            return self.head(x[0])  # the first ([CLS]) token

    params, static = eqx.partition(Bert(jax.random.key(0)), eqx.is_array)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    keep = jnp.asarray(np.arange(S)[None, :] < rng.integers(S // 2, S + 1, (B, 1)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, CLASSES, (B,)), jnp.int32)

    def loss(p: Any, batch: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        inputs, padding, wanted = batch
        logits = jax.vmap(eqx.combine(p, static))(inputs, padding)
        return optax.softmax_cross_entropy_with_integer_labels(logits, wanted).mean()

    tp = _ATTENTION + _MLP
    rules = {"dp": (), "tp": tp, "dp_tp": tp, "fsdp": _FSDP}
    data, whole = (_TOKENS, _TOKENS, _LABELS), ("b s -> b s", "b s -> b s", "b -> b")
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family("eqx_bert", "equinox", "encoder", loss, params, (tokens, keep, labels), rules, batch_rules)


@cache
def mixer() -> Family:
    import equinox as eqx

    tokens = (HW // PATCH) ** 2

    class MixerBlock(eqx.Module):
        ln1: eqx.nn.LayerNorm
        token_mlp: eqx.nn.MLP
        ln2: eqx.nn.LayerNorm
        channel_mlp: eqx.nn.MLP

        def __init__(self, key: jax.Array) -> None:
            k1, k2 = jax.random.split(key)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
            self.token_mlp = eqx.nn.MLP(tokens, tokens, TOKEN_F, depth=1, activation=jax.nn.gelu, key=k1)
            self.channel_mlp = eqx.nn.MLP(D, D, F, depth=1, activation=jax.nn.gelu, key=k2)

        def __call__(self, x: jax.Array) -> jax.Array:  # x: (tokens, channels)
            y = jax.vmap(self.ln1)(x).T  # (channels, tokens): token mixing runs per channel
            x = x + jax.vmap(self.token_mlp)(y).T
            return x + jax.vmap(self.channel_mlp)(jax.vmap(self.ln2)(x))

    class Mixer(eqx.Module):
        patches: eqx.nn.Conv2d
        blocks: list[MixerBlock]
        ln: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k1, k2, *ks = jax.random.split(key, 2 + L)
            self.patches = eqx.nn.Conv2d(3, D, PATCH, stride=PATCH, key=k1)
            self.blocks = [MixerBlock(k) for k in ks]
            self.ln, self.head = eqx.nn.LayerNorm(D), eqx.nn.Linear(D, CLASSES, key=k2)

        def __call__(self, image: jax.Array) -> jax.Array:  # image: (channels, height, width)
            x = self.patches(image).reshape(D, tokens).T  # (tokens, channels)
            for block in self.blocks:
                x = block(x)
            return self.head(jax.vmap(self.ln)(x).mean(0))

    params, static = eqx.partition(Mixer(jax.random.key(0)), eqx.is_array)
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(B, 3, HW, HW)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, CLASSES, (B,)), jnp.int32)

    def loss(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        inputs, wanted = batch
        logits = jax.vmap(eqx.combine(p, static))(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, wanted).mean()

    # Megatron on both mixing MLPs: their hidden units over 'model'.
    tp = (
        (r"(token_mlp|channel_mlp)\.layers\[0\]\.weight", "f d -> f@model d"),
        (r"(token_mlp|channel_mlp)\.layers\[0\]\.bias", "f -> f@model"),
        (r"(token_mlp|channel_mlp)\.layers\[1\]\.weight", "d f -> d f@model"),
    )
    image = "b c h w -> b@data c h w"
    rules = {"dp": (), "tp": tp, "dp_tp": tp, "fsdp": _FSDP}
    batch_rules = {
        "dp": (image, _LABELS),
        "tp": ("b c h w -> b c h w", "b -> b"),
        "dp_tp": (image, _LABELS),
        "fsdp": (image, _LABELS),
    }
    return Family("eqx_mixer", "equinox", "mixer", loss, params, (images, labels), rules, batch_rules)
