"""keras-hub's GPT-2 and Gemma (2-style) backbones, tiny, each with its LM head tied to the token table.

* ``kh_gpt2``: learned position embeddings, pre-norm blocks with biased query/key/value ``(d, heads, head_dim)``
  kernels, a gelu feed-forward; logits ``hidden @ token_table.T``;
* ``kh_gemma``: grouped-query attention with query ``(heads, d, head_dim)`` kernels, attention-logit soft-capping,
  sliding-window attention on every other layer, post-attention and post-feed-forward RMS norms, a GeGLU
  feed-forward (``ffw_gating`` / ``ffw_gating_2`` / ``ffw_linear``), final-logit soft-capping as
  ``ReversibleEmbedding(logit_soft_cap=...)`` computes it.

Hand layouts are what a user writes for these kernel shapes; on Gemma the tied table is split along the
vocabulary under tensor parallelism (a vocabulary-parallel LM head), on GPT-2 it stays whole (keras-hub's own
layout maps shard it along the model dimension instead: that is the ``tp`` rule here).
"""

from __future__ import annotations

from functools import cache

import jax.numpy as jnp
import numpy as np
import optax

from . import Family
from ._keras import pure_loss

V, D, F, H, KV, HEAD, S, B, L = 64, 32, 64, 4, 2, 8, 8, 8, 2
ATTENTION_CAP, FINAL_CAP, WINDOW = 50.0, 30.0, 4

_TOKENS = "b s -> b@data s"
_DATA = ({"token_ids": _TOKENS, "padding_mask": _TOKENS}, _TOKENS)
_WHOLE = ({"token_ids": "b s -> b s", "padding_mask": "b s -> b s"}, "b s -> b s")
# FSDP: every matrix and head-shaped kernel split over 'data' on its first axis, the tied table too.
_FSDP = ((r"", "a b c -> a@data b c"), (r"", "a b -> a@data b"))


def _batch() -> tuple[dict, jnp.ndarray]:
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    # Right padding on some rows: the padding mask is read, not all ones.
    keep = jnp.asarray(np.arange(S)[None, :] < rng.integers(S // 2, S + 1, (B, 1)), jnp.int32)
    return {"token_ids": tokens, "padding_mask": keep}, jnp.roll(tokens, -1, axis=1)


def _tied_head(cap: float | None):
    def head(out, p, labels):
        logits = jnp.einsum("bsd,vd->bsv", out, p["token_embedding/embeddings"])
        if cap is not None:  # ReversibleEmbedding's logit_soft_cap
            logits = jnp.tanh(logits / cap) * cap
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return head


Rules = tuple[tuple[str, str], ...]


def _family(name: str, kind: str, model, cap: float | None, megatron: Rules, fsdp: Rules = _FSDP) -> Family:
    loss, params = pure_loss(model, _tied_head(cap))
    rules = {"dp": (), "tp": megatron, "dp_tp": megatron, "fsdp": fsdp}
    batch_rules = {"dp": _DATA, "tp": _WHOLE, "dp_tp": _DATA, "fsdp": _DATA}
    return Family(name, "keras-hub", kind, loss, params, _batch(), rules, batch_rules)


@cache
def gpt2() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.GPT2Backbone(
        vocabulary_size=V,
        num_layers=L,
        num_heads=H,
        hidden_dim=D,
        intermediate_dim=F,
        max_sequence_length=S,
        dtype="float32",
    )
    megatron = (
        (r"self_attention/(query|key|value)/kernel", "d h k -> d h@model k"),
        (r"self_attention/(query|key|value)/bias", "h k -> h@model k"),
        (r"attention_output/kernel", "h k d -> h@model k d"),
        (r"feedforward_intermediate_dense/kernel", "d f -> d f@model"),
        (r"feedforward_intermediate_dense/bias", "f -> f@model"),
        (r"feedforward_output_dense/kernel", "f d -> f@model d"),
        (r"token_embedding/embeddings", "v d -> v d@model"),
    )
    return _family("kh_gpt2", "learned-positions", model, None, megatron)


@cache
def gemma() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.GemmaBackbone(
        vocabulary_size=V,
        num_layers=L,
        num_query_heads=H,
        num_key_value_heads=KV,
        hidden_dim=D,
        intermediate_dim=2 * F,  # Gemma halves it: each GeGLU branch is F wide
        head_dim=HEAD,
        attention_logit_soft_cap=ATTENTION_CAP,
        final_logit_soft_cap=FINAL_CAP,
        use_post_attention_norm=True,
        use_post_ffw_norm=True,
        use_sliding_window_attention=True,
        sliding_window_size=WINDOW,
        dtype="float32",
    )
    megatron = (
        (r"attention/(query|key|value)/kernel", "h d k -> h@model d k"),
        (r"attention_output/kernel", "h k d -> h@model k d"),
        (r"ffw_gating(_2)?/kernel", "d f -> d f@model"),
        (r"ffw_linear/kernel", "f d -> f@model d"),
        (r"token_embedding/embeddings", "v d -> v@model d"),
    )
    # FSDP: the attention kernels lead with their (2 or 4) heads, too few to split four ways: split d instead.
    fsdp = ((r"attention/(query|key|value)/kernel", "h d k -> h d@data k"), *_FSDP)
    return _family("kh_gemma", "geglu-softcap", model, FINAL_CAP, megatron, fsdp)
