"""keras-hub's T5 backbone (encoder–decoder, relative position biases, gated feed-forward), tiny."""

from __future__ import annotations

from functools import cache

import jax.numpy as jnp
import numpy as np
import optax

from . import Family
from ._keras import pure_loss

V, D, F, H, S, B = 64, 32, 64, 2, 8, 8

_T = "b s -> b@data s"
_W = "b s -> b s"


def _inputs(e: str) -> dict[str, str]:
    return {k: e for k in ("encoder_token_ids", "encoder_padding_mask", "decoder_token_ids", "decoder_padding_mask")}


# Megatron: q/k/v and gate/input projections column-parallel (d, d@model), outputs row-parallel.
_MEGATRON = (
    (r"(query|key|value)_projector/kernel", "d f -> d f@model"),
    (r"(input|gate)_projector/kernel", "d f -> d f@model"),
    (r"output_projector/kernel", "f d -> f@model d"),
)
_FSDP = ((r"kernel|token_embedding", "a b -> a@data b"),)


def _head(out, p, labels):
    logits = jnp.einsum("bsd,vd->bsv", out["decoder_sequence_output"], p["token_embedding/embeddings"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@cache
def t5() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.T5Backbone(
        vocabulary_size=V,
        num_layers=1,
        num_heads=H,
        hidden_dim=D,
        intermediate_dim=F,
        dropout=0.0,
        dtype="float32",
    )
    loss, params = pure_loss(model, _head)
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    tgt = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    ones = jnp.ones((B, S), jnp.int32)
    batch = (
        {
            "encoder_token_ids": src,
            "encoder_padding_mask": ones,
            "decoder_token_ids": tgt,
            "decoder_padding_mask": ones,
        },
        jnp.roll(tgt, -1, axis=1),
    )
    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    data, whole = (_inputs(_T), _T), (_inputs(_W), _W)
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family("kh_t5", "keras-hub", "enc-dec", loss, params, batch, rules, batch_rules)
