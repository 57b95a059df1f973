"""Models the corpus did not hold (session 16's probe, benchmarks/unseen_probe.py): primitives and idioms it lacked.

* ``eqx_dwconv``: Equinox ``Conv2d`` with ``groups`` (a depthwise conv: ``feature_group_count``), ``GroupNorm``,
  a pointwise conv and a ``Linear`` head — MobileNet's block;
* ``flax_bn``: Flax linen ``nn.Conv`` + ``nn.BatchNorm`` in training mode (batch statistics over the sharded
  batch), a ``nn.Dense`` head; its step is ``optax.chain(clip_by_global_norm, adamw(mask=kernels only))``;
* ``flax_lstm``: ``nn.RNN(nn.OptimizedLSTMCell)`` (linen's scan of an LSTM cell) and a ``nn.Dense`` head;
* ``flax_encdec``: an encoder–decoder of ``nn.MultiHeadDotProductAttention`` with a padding mask on the encoder,
  a causal mask on the decoder and a cross-attention mask (``nn.make_attention_mask``); its step is
  ``optax.adafactor`` (factored second moments);
* ``kh_bert``: keras-hub's ``BertBackbone`` (token, position and segment embeddings, post-norm encoder);
* ``kh_mistral``: keras-hub's ``MistralBackbone`` with a sliding window shorter than the sequence.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import Family
from ._keras import pure_loss

B, S, D, F, H, V = 8, 8, 32, 64, 4, 64
HW, C, CLASSES = 8, 16, 10

_X = "b s d -> b@data s d"
_LABEL = "b -> b@data"


def _step(loss: Any, opt: optax.GradientTransformation, params: Any) -> tuple[Any, Any]:
    """(the whole training step over ``(params, opt_state)``, the optimizer's initial state)."""

    def step(carry: tuple[Any, Any], batch: Any) -> tuple[Any, Any]:
        p, state = carry
        grads = jax.grad(loss)(p, batch)
        updates, state = opt.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    return step, opt.init(params)


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@cache
def dwconv() -> Family:
    import equinox as eqx

    k = jax.random.split(jax.random.key(0), 4)
    layers = (
        eqx.nn.Conv2d(3, C, 3, padding=1, key=k[0]),
        eqx.nn.Conv2d(C, C, 3, padding=1, groups=C, key=k[1]),  # depthwise
        eqx.nn.GroupNorm(4, C),
        eqx.nn.Conv2d(C, 2 * C, 1, key=k[2]),  # pointwise
        eqx.nn.Linear(2 * C, CLASSES, key=k[3]),
    )
    params, static = eqx.partition(layers, eqx.is_array)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, 3, HW, HW)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, CLASSES, size=(B,)), jnp.int32)

    def loss(p: Any, batch: Any) -> jax.Array:
        images, wanted = batch
        stem, depthwise, norm, pointwise, head = eqx.combine(p, static)

        def one(img: jax.Array) -> jax.Array:
            h = jax.nn.relu(stem(img))
            h = jax.nn.relu(norm(depthwise(h)))
            h = jax.nn.relu(pointwise(h))
            return head(h.mean((1, 2)))

        return _xent(jax.vmap(one)(images), wanted)

    # Equinox conv weights are (out, in/groups, h, w): channels split on their outputs.
    tp = ((r"\[[0-3]\]\.weight", "o i h w -> o@model i h w"), (r"\[[0-3]\]\.bias", "o h w -> o@model h w"))
    # The head's (classes=10, in) weight split on its inputs: 10 does not split four ways.
    fsdp = ((r"weight", "o i h w -> o@data i h w"), (r"weight", "a b -> a b@data"))
    image = "b c h w -> b@data c h w"
    rules = {"dp": (), "tp": tp, "dp_tp": tp, "fsdp": fsdp}
    batch_rules = {
        "dp": (image, _LABEL),
        "tp": ("b c h w -> b c h w", "b -> b"),
        "dp_tp": (image, _LABEL),
        "fsdp": (image, _LABEL),
    }
    return Family("eqx_dwconv", "equinox", "depthwise-conv", loss, params, (x, labels), rules, batch_rules)


@cache
def batchnorm() -> Family:
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            # No conv bias before a batch norm (as ResNets write it): its gradient is identically zero, and
            # AdamW's first update of rounding noise would be a whole learning rate of either sign.
            x = nn.Conv(C, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            x = nn.Conv(2 * C, (3, 3), strides=2, use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=False)(x))
            return nn.Dense(CLASSES)(x.mean((1, 2)))

    net = Net()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, HW, HW, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, CLASSES, size=(B,)), jnp.int32)
    variables = net.init(jax.random.key(0), x)
    params, stats = variables["params"], variables["batch_stats"]

    def loss(p: Any, batch: Any) -> jax.Array:
        images, wanted = batch
        logits, _ = net.apply({"params": p, "batch_stats": stats}, images, mutable=["batch_stats"])
        return _xent(logits, wanted)

    mask = jax.tree_util.tree_map_with_path(lambda path, _: "kernel" in jax.tree_util.keystr(path), params)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, eps=1e-6, weight_decay=1e-2, mask=mask))
    step, opt_state = _step(loss, opt, params)
    channels = (
        (r"Conv_\d'\]\['kernel", "h w i o -> h w i o@model"),
        (r"(Conv|BatchNorm)_\d'\]\['(bias|scale)", "o -> o@model"),
    )
    fsdp = ((r"Conv_\d'\]\['kernel", "h w i o -> h w i o@data"), (r"Dense.*kernel", "a b -> a@data b"))
    image = "b h w c -> b@data h w c"
    rules = {"dp": (), "tp": channels, "dp_tp": channels, "fsdp": fsdp}
    batch_rules = {
        "dp": (image, _LABEL),
        "tp": ("b h w c -> b h w c", "b -> b"),
        "dp_tp": (image, _LABEL),
        "fsdp": (image, _LABEL),
    }
    return Family(
        "flax_bn", "flax", "batchnorm", loss, params, (x, labels), rules, batch_rules, step=step, opt_state=opt_state
    )


@cache
def lstm() -> Family:
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.RNN(nn.OptimizedLSTMCell(F))(x)
            return nn.Dense(D)(h)

    net = Net()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    params = net.init(jax.random.key(0), x)

    def loss(p: Any, batch: Any) -> jax.Array:
        inputs, wanted = batch
        return jnp.mean((net.apply(p, inputs) - wanted) ** 2)

    # The four gates' input and hidden kernels column-parallel (the cell concatenates them on their outputs).
    tp = ((r"'(i[ifgo]|h[ifgo])'\]\['kernel", "a f -> a f@model"), (r"'h[ifgo]'\]\['bias", "f -> f@model"))
    fsdp = ((r"kernel", "a b -> a@data b"),)
    rules = {"dp": (), "tp": tp, "dp_tp": tp, "fsdp": fsdp}
    batch_rules = {"dp": (_X, _X), "tp": ("b s d -> b s d",) * 2, "dp_tp": (_X, _X), "fsdp": (_X, _X)}
    return Family("flax_lstm", "flax", "lstm", loss, params, (x, target), rules, batch_rules)


@cache
def encdec() -> Family:
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, src: jax.Array, src_pad: jax.Array, tgt: jax.Array) -> jax.Array:
            att = lambda: nn.MultiHeadDotProductAttention(num_heads=H, qkv_features=D)  # noqa: E731
            enc_mask = nn.make_attention_mask(src_pad, src_pad)
            y = nn.LayerNorm()(src)
            memory = src + att()(y, y, mask=enc_mask)
            y = nn.LayerNorm()(tgt)
            causal = nn.make_causal_mask(jnp.ones(tgt.shape[:2]))
            x = tgt + att()(y, y, mask=causal)
            cross = nn.make_attention_mask(jnp.ones(tgt.shape[:2]), src_pad)
            x = x + att()(nn.LayerNorm()(x), memory, mask=cross)
            return x + nn.Dense(D)(nn.gelu(nn.Dense(F)(nn.LayerNorm()(x))))

    net = Net()
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    pad = jnp.asarray(np.arange(S)[None, :] < rng.integers(S // 2, S + 1, size=(B, 1)), jnp.int32)
    tgt = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    want = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    params = net.init(jax.random.key(0), src, pad, tgt)

    def loss(p: Any, batch: Any) -> jax.Array:
        s, m, t, w = batch
        return jnp.mean((net.apply(p, s, m, t) - w) ** 2)

    step, opt_state = _step(loss, optax.adafactor(1e-3), params)
    # Adafactor's factored moments (v_row, v_col) of a vector are (1,)-shaped: left replicated.
    megatron = (
        (r"(query|key|value)'\]\['kernel", "d h k -> d h@model k"),
        (r"(query|key|value)'\]\['bias", "h k -> h@model k"),
        (r"out'\]\['kernel", "h k d -> h@model k d"),
        (r"Dense_0'\]\['kernel", "d f -> d f@model"),
        (r"^(?!.*v_(row|col)).*Dense_0'\]\['bias", "f -> f@model"),
        (r"Dense_1'\]\['kernel", "f d -> f@model d"),
    )
    fsdp = ((r"kernel", "a b -> a@data b"), (r"kernel", "a b c -> a@data b c"))
    whole = ("b s d -> b s d", "b s -> b s", "b s d -> b s d", "b s d -> b s d")
    data = (_X, "b s -> b@data s", _X, _X)
    rules = {"dp": (), "tp": megatron, "dp_tp": megatron, "fsdp": fsdp}
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family(
        "flax_encdec",
        "flax",
        "enc-dec",
        loss,
        params,
        (src, pad, tgt, want),
        rules,
        batch_rules,
        step=step,
        opt_state=opt_state,
    )


_TOKENS = "b s -> b@data s"
_KH_MEGATRON = (
    (r"/(query|key|value)/kernel", "d h k -> d h@model k"),
    (r"/(query|key|value)/bias", "h k -> h@model k"),
    (r"attention_output/kernel", "h k d -> h@model k d"),
    (r"feedforward_(intermediate|gate)_dense/kernel", "d f -> d f@model"),
    (r"feedforward_intermediate_dense/bias", "f -> f@model"),
    (r"feedforward_output_dense/kernel", "f d -> f@model d"),
)
# FSDP on the first axis; BERT's two-row segment table on its second (2 does not split four ways).
_KH_FSDP = (
    (r"segment_embedding", "a b -> a b@data"),
    (r"", "a b c -> a@data b c"),
    (r"", "a b -> a@data b"),
)


@cache
def bert() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.BertBackbone(
        vocabulary_size=V,
        num_layers=1,
        num_heads=H,
        hidden_dim=D,
        intermediate_dim=F,
        max_sequence_length=S,
        dtype="float32",
    )

    def head(out: Any, p: Any, labels: jax.Array) -> jax.Array:
        logits = jnp.einsum("bsd,vd->bsv", out["sequence_output"], p["token_embedding/embeddings"])
        return _xent(logits, labels) + jnp.mean(out["pooled_output"] ** 2)

    loss, params = pure_loss(model, head)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    segments = jnp.asarray(np.arange(S)[None, :] >= S // 2, jnp.int32) * jnp.ones((B, 1), jnp.int32)
    inputs = {"token_ids": tokens, "segment_ids": segments, "padding_mask": jnp.ones((B, S), jnp.int32)}
    data = ({k: _TOKENS for k in inputs}, _TOKENS)
    whole = ({k: "b s -> b s" for k in inputs}, "b s -> b s")
    rules = {"dp": (), "tp": _KH_MEGATRON, "dp_tp": _KH_MEGATRON, "fsdp": _KH_FSDP}
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family(
        "kh_bert", "keras-hub", "encoder", loss, params, (inputs, jnp.roll(tokens, -1, 1)), rules, batch_rules
    )


@cache
def mistral() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.MistralBackbone(
        vocabulary_size=V,
        num_layers=1,
        num_query_heads=H,
        hidden_dim=D,
        intermediate_dim=F,
        num_key_value_heads=2,
        sliding_window=S // 2,
        dtype="float32",
    )

    def head(out: Any, p: Any, labels: jax.Array) -> jax.Array:
        return _xent(jnp.einsum("bsd,dv->bsv", out, p["token_embedding/reverse_embeddings"]), labels)

    loss, params = pure_loss(model, head)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    inputs = {"token_ids": tokens, "padding_mask": jnp.ones((B, S), jnp.int32)}
    data = ({k: _TOKENS for k in inputs}, _TOKENS)
    whole = ({k: "b s -> b s" for k in inputs}, "b s -> b s")
    rules = {"dp": (), "tp": _KH_MEGATRON, "dp_tp": _KH_MEGATRON, "fsdp": _KH_FSDP}
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family(
        "kh_mistral", "keras-hub", "sliding-window", loss, params, (inputs, jnp.roll(tokens, -1, 1)), rules, batch_rules
    )


FAMILIES = {
    "eqx_dwconv": dwconv,
    "flax_bn": batchnorm,
    "flax_lstm": lstm,
    "flax_encdec": encdec,
    "kh_bert": bert,
    "kh_mistral": mistral,
}
STEP_FAMILIES = ("flax_bn", "flax_encdec")
