"""Llama-style decoders as shapes only: what ``einshard plan --model llama-7b`` / ``llama-70b`` plan.

Pre-norm blocks of RMSNorm, grouped-query causal attention with rotary
positions and a SwiGLU MLP; bf16 parameters, stacked over a leading layer axis
and run under ``lax.scan`` with ``jax.checkpoint`` (remat) as large models
train.  Nothing is ever allocated: :func:`shapes` gives
``jax.ShapeDtypeStruct``s and the planner traces :func:`loss_fn` on them.

The sizes follow the published Llama 2 configurations (7B: 32 layers, width
4096, 32 heads, MLP 11008; 70B: 80 layers, width 8192, 64 query heads over 8
key/value heads, MLP 28672; vocabulary 32000).  ``unroll=True`` runs the
blocks as a Python loop over per-layer slices instead of a scan (the planner's
cost then grows with depth unless identical blocks are costed once).

Example:
    >>> from einshard_apps.models.llama import CONFIGS, shapes
    >>> p = shapes(CONFIGS['llama-7b'])
    >>> p['layers']['attn']['wq'].shape   # l d h k
    (32, 4096, 32, 128)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["LlamaConfig", "CONFIGS", "shapes", "loss_fn", "param_count"]


@dataclass(frozen=True)
class LlamaConfig:
    """A decoder's sizes.  ``width == heads * head_width``; ``kv_heads`` divides ``heads``."""

    name: str
    layers: int
    width: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int = 32000
    seq: int = 4096
    unroll: bool = False

    @property
    def head_width(self) -> int:
        return self.width // self.heads


CONFIGS: dict[str, LlamaConfig] = {
    "llama-7b": LlamaConfig("llama-7b", layers=32, width=4096, heads=32, kv_heads=32, ffn=11008),
    "llama-70b": LlamaConfig("llama-70b", layers=80, width=8192, heads=64, kv_heads=8, ffn=28672),
}


def shapes(cfg: LlamaConfig, dtype: Any = jnp.bfloat16) -> dict[str, Any]:
    """The parameters as ``ShapeDtypeStruct``s (per-layer weights stacked on a leading ``l`` axis)."""
    n, d, h, g, k, f, v = cfg.layers, cfg.width, cfg.heads, cfg.kv_heads, cfg.head_width, cfg.ffn, cfg.vocab

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    return {
        "embed": s(v, d),
        "layers": {
            "attn_norm": s(n, d),
            "attn": {"wq": s(n, d, h, k), "wk": s(n, d, g, k), "wv": s(n, d, g, k), "wo": s(n, h, k, d)},
            "mlp_norm": s(n, d),
            "mlp": {"w_gate": s(n, d, f), "w_up": s(n, d, f), "w_down": s(n, f, d)},
        },
        "final_norm": s(d),
        "unembed": s(d, v),
    }


def param_count(cfg: LlamaConfig) -> int:
    import math

    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes(cfg)))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array) -> jax.Array:
    """Rotary positions on ``b s h k`` (the half-split form): ``x cos + rotate_half(x) sin``.

    ``rotate_half`` is a matmul with a constant signed permutation (not a slice and a concatenate, whose
    gradient is a ``split``): every op then has a layout rule and the plan is complete."""
    s, k = x.shape[1], x.shape[-1]
    half = k // 2
    freqs = 1.0 / (10000.0 ** (np.arange(half, dtype=np.float32) / half))
    angles = np.arange(s, dtype=np.float32)[:, None] * np.concatenate([freqs, freqs])[None, :]
    cos, sin = np.cos(angles)[None, :, None, :], np.sin(angles)[None, :, None, :]
    rotate = np.zeros((k, k), np.float32)
    rotate[np.arange(half) + half, np.arange(half)] = -1.0  # out[j] = -x[j + k/2] for j < k/2
    rotate[np.arange(half), np.arange(half) + half] = 1.0  # out[j] = x[j - k/2] for j >= k/2
    x32 = x.astype(jnp.float32)
    rotated = jnp.einsum("bshk,kj->bshj", x32, jnp.asarray(rotate))
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _block(cfg: LlamaConfig, x: jax.Array, layer: dict[str, Any]) -> jax.Array:
    a = layer["attn"]
    h = _rms_norm(x, layer["attn_norm"])
    q = _rope(jnp.einsum("bsd,dhk->bshk", h, a["wq"]))
    kk = _rope(jnp.einsum("bsd,dgk->bsgk", h, a["wk"]))
    vv = jnp.einsum("bsd,dgk->bsgk", h, a["wv"])
    groups = cfg.heads // cfg.kv_heads
    q = q.reshape(*q.shape[:2], cfg.kv_heads, groups, cfg.head_width)
    scores = jnp.einsum("bsgrk,btgk->bgrst", q, kk) / jnp.sqrt(jnp.float32(cfg.head_width)).astype(x.dtype)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bgrst,btgk->bsgrk", probs, vv).reshape(*x.shape[:2], cfg.heads, cfg.head_width)
    x = x + jnp.einsum("bshk,hkd->bsd", out, a["wo"])
    m = layer["mlp"]
    h = _rms_norm(x, layer["mlp_norm"])
    gate = jax.nn.silu(jnp.einsum("bsd,df->bsf", h, m["w_gate"]))
    return x + jnp.einsum("bsf,fd->bsd", gate * jnp.einsum("bsd,df->bsf", h, m["w_up"]), m["w_down"])


def loss_fn(params: dict[str, Any], tokens: jax.Array, cfg: LlamaConfig) -> jax.Array:
    """Next-token cross-entropy of ``tokens`` (``b, s+1`` int32) under the decoder."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    x = params["embed"][inputs]
    block = jax.checkpoint(functools.partial(_block, cfg))  # remat: activations of one block at a time
    if cfg.unroll:
        for i in range(cfg.layers):
            x = block(x, jax.tree.map(lambda w, i=i: w[i], params["layers"]))
    else:
        x, _ = jax.lax.scan(lambda x, layer: (block(x, layer), None), x, params["layers"])
    logits = jnp.einsum("bsd,dv->bsv", _rms_norm(x, params["final_norm"]), params["unembed"])
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def sized(name: str, layers: int | None = None, unroll: bool = False, seq: int | None = None) -> LlamaConfig:
    """A built-in config, optionally with another depth, sequence length or unrolled."""
    cfg = CONFIGS[name]
    changes: dict[str, Any] = {"unroll": unroll}
    if layers is not None:
        changes["layers"] = layers
    if seq is not None:
        changes["seq"] = seq
    return dataclasses.replace(cfg, **changes)
