"""keras-hub's Llama (rotary, grouped-query attention) and Mixtral (top-k routed experts) backbones, tiny.

Hand layouts are what a user writes for keras-hub's kernel shapes: query ``(d, heads, head_dim)``, key/value
``(d, kv_heads, head_dim)``, output ``(heads, head_dim, d)``, feed-forward ``(d, f)`` / ``(f, d)``, experts
``(e, d, f)`` / ``(e, f, d)``.
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import jax.numpy as jnp
import numpy as np
import optax

from . import Family
from ._keras import pure_loss

Size = Literal["tiny", "large"]
# (vocab, d_model, ff, query heads, kv heads, seq, batch, layers).  "tiny" is the corpus' explain check; "large"
# is for planning: heavy enough in FLOPs and memory that each of the 8 simulated devices computing the whole
# step (everything replicated) loses to data and tensor splits.
SIZES: dict[str, tuple[int, int, int, int, int, int, int, int]] = {
    "tiny": (64, 32, 64, 4, 2, 8, 8, 1),
    "large": (1024, 256, 1024, 8, 4, 64, 32, 2),
}
V, D, F, H, KV, S, B, _ = SIZES["tiny"]
E, K = 4, 2

_TOKENS = "b s -> b@data s"
_DATA = ({"token_ids": _TOKENS, "padding_mask": _TOKENS}, _TOKENS)
_WHOLE = ({"token_ids": "b s -> b s", "padding_mask": "b s -> b s"}, "b s -> b s")
# Megatron: heads split over 'model' (kv_heads=2 too), column/row-parallel feed-forward.
_MEGATRON = (
    (r"self_attention/(query|key|value)/kernel", "d h k -> d h@model k"),
    (r"attention_output/kernel", "h k d -> h@model k d"),
    (r"feedforward_(intermediate|gate)_dense/kernel", "d f -> d f@model"),
    (r"feedforward_output_dense/kernel", "f d -> f@model d"),
)
# FSDP: every matrix split over 'data' along its first axis (the embedding tables too, as a user writes it).
_FSDP = (
    (r"", "a b c -> a@data b c"),
    (r"", "a b -> a@data b"),
)
_EP = ((r"experts/", "e a b -> e@data a b"),)
# Data parallel and FSDP over the whole mesh (the "large" size's extra hand layouts).
_TOKENS_ALL = "b s -> b@(data,model) s"
_DATA_ALL = ({"token_ids": _TOKENS_ALL, "padding_mask": _TOKENS_ALL}, _TOKENS_ALL)
_FSDP_ALL = (
    (r"", "a b c -> a@(data,model) b c"),
    (r"", "a b -> a@(data,model) b"),
)


def _batch(rng: np.random.Generator, vocab: int, batch: int, seq: int) -> tuple[dict, jnp.ndarray]:
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
    return {"token_ids": tokens, "padding_mask": jnp.ones((batch, seq), jnp.int32)}, jnp.roll(tokens, -1, axis=1)


def _lm_head(out, p, labels):
    logits = jnp.einsum("bsd,dv->bsv", out, p["token_embedding/reverse_embeddings"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _family(name: str, kind: str, model, ep: bool, size: Size = "tiny") -> Family:
    loss, params = pure_loss(model, _lm_head)
    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    batch_rules = {"dp": _DATA, "tp": _WHOLE, "dp_tp": _DATA, "fsdp": _DATA}
    if ep:
        rules["ep"] = _EP
        batch_rules["ep"] = _DATA
    if size != "tiny":  # what a user with 8 devices and a step this size writes too: both mesh axes for the batch
        rules |= {"dp_all": (), "fsdp_all": _FSDP_ALL}
        batch_rules |= {"dp_all": _DATA_ALL, "fsdp_all": _DATA_ALL}
    v, _, _, _, _, s, b, _ = SIZES[size]
    batch = _batch(np.random.default_rng(0), v, b, s)
    return Family(
        name if size == "tiny" else f"{name}_{size}", "keras-hub", kind, loss, params, batch, rules, batch_rules
    )


@cache
def llama(size: Size = "tiny") -> Family:
    import keras
    import keras_hub

    v, d, f, h, kv, _, _, layers = SIZES[size]
    keras.utils.set_random_seed(0)
    model = keras_hub.models.LlamaBackbone(
        vocabulary_size=v,
        num_layers=layers,
        num_query_heads=h,
        hidden_dim=d,
        intermediate_dim=f,
        num_key_value_heads=kv,
        dtype="float32",
    )
    return _family("kh_llama", "rotary-gqa", model, ep=False, size=size)


@cache
def mixtral() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.MixtralBackbone(
        vocabulary_size=V,
        num_layers=1,
        num_query_heads=H,
        hidden_dim=D,
        intermediate_dim=F,
        num_key_value_heads=KV,
        num_experts=E,
        top_k=K,
        dtype="float32",
    )
    return _family("kh_mixtral", "moe", model, ep=True)
