"""A decoder-only transformer training step with a scanned layer stack, as shapes (for the planner benchmark)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def block(h, p, heads: int):
    """One pre-norm decoder block: causal attention and a GELU MLP (plain JAX)."""
    b, s, d = h.shape
    x = _norm(h)
    q = (x @ p["wq"]).reshape(b, s, heads, d // heads)
    k = (x @ p["wk"]).reshape(b, s, heads, d // heads)
    v = (x @ p["wv"]).reshape(b, s, heads, d // heads)
    att = jnp.einsum("bshk,bthk->bhst", q, k) / jnp.sqrt(d // heads)
    mask = jnp.tril(jnp.ones((s, s), bool))
    att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
    o = jnp.einsum("bhst,bthk->bshk", att, v).reshape(b, s, d)
    h = h + o @ p["wo"]
    return h + jax.nn.gelu(_norm(h) @ p["w1"]) @ p["w2"]


def make_step(heads: int):
    """``jax.value_and_grad`` of the next-token loss; params {'emb', 'layers': {wq, wk, wv, wo, w1, w2}} stacked."""

    def scan_block(h, p):
        return block(h, p, heads), None

    def loss(params, tokens):
        h = params["emb"][tokens]
        h, _ = jax.lax.scan(jax.checkpoint(scan_block), h, params["layers"])
        logits = _norm(h) @ params["emb"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1))

    return jax.value_and_grad(loss)


def shapes(layers: int, d: int, f: int, vocab: int, batch: int, seq: int, dtype=jnp.bfloat16):
    sds = lambda *s: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
    stack = {
        "wq": sds(layers, d, d),
        "wk": sds(layers, d, d),
        "wv": sds(layers, d, d),
        "wo": sds(layers, d, d),
        "w1": sds(layers, d, f),
        "w2": sds(layers, f, d),
    }
    params = {"emb": sds(vocab, d), "layers": stack}
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return params, tokens
