"""A small decoder-only transformer language model in plain JAX.

Byte-level tokens (vocabulary 256), learned positions, pre-norm blocks of
causal multi-head attention and a GELU MLP, a final layer norm and an untied
output projection.  Parameters are a dict pytree; every per-layer weight is
stacked along a leading ``layer`` axis and the blocks run under ``lax.scan``,
so one compiled block serves every layer and a layout can shard ``layer``
(pipeline stages) like any other axis.

The parameter paths and their axis names (what a layout's expressions name)::

    ['embed']['tokens']          v d        vocabulary x model width
    ['embed']['positions']       s d
    ['layers']['ln1']['scale']   l d        (and ['bias'], ['ln2'] alike)
    ['layers']['attn']['wq']     l d h k    (wk, wv alike: heads h of width k)
    ['layers']['attn']['wo']     l h k d
    ['layers']['mlp']['w_in']    l d f
    ['layers']['mlp']['w_out']   l f d
    ['final_ln']['scale']        d          (and ['bias'])
    ['unembed']                  d v

Example:
    >>> import jax, numpy as np
    >>> from einshard_apps.models.transformer import Config, init, loss_fn
    >>> cfg = Config(layers=1, width=16, heads=2, ffn=32, seq=8)
    >>> params = init(cfg, seed=0)
    >>> params['layers']['attn']['wq'].shape   # l d h k
    (1, 16, 2, 8)
    >>> tokens = np.zeros((2, cfg.seq + 1), np.int32)
    >>> float(loss_fn(params, tokens, cfg)) > 0
    True
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from einshard.errors import EinshardError

__all__ = [
    "Config",
    "AXES",
    "init",
    "embed",
    "block",
    "head",
    "forward",
    "loss_fn",
    "count_params",
    "layer_norm",
    "causal_attention",
    "cross_entropy",
]

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    """Model sizes.  ``width`` must equal ``heads * head_width``."""

    layers: int = 2
    width: int = 64
    heads: int = 8
    ffn: int = 256
    seq: int = 64
    vocab: int = 256  # bytes

    @property
    def head_width(self) -> int:
        return self.width // self.heads

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


# The axis names of every parameter, by path: the left side of the expressions layouts write.
AXES: dict[str, str] = {
    "['embed']['tokens']": "v d",
    "['embed']['positions']": "s d",
    "['layers']['ln1']['scale']": "l d",
    "['layers']['ln1']['bias']": "l d",
    "['layers']['attn']['wq']": "l d h k",
    "['layers']['attn']['wk']": "l d h k",
    "['layers']['attn']['wv']": "l d h k",
    "['layers']['attn']['wo']": "l h k d",
    "['layers']['ln2']['scale']": "l d",
    "['layers']['ln2']['bias']": "l d",
    "['layers']['mlp']['w_in']": "l d f",
    "['layers']['mlp']['w_out']": "l f d",
    "['final_ln']['scale']": "d",
    "['final_ln']['bias']": "d",
    "['unembed']": "d v",
}


def init(cfg: Config, seed: int = 0) -> Params:
    """Parameters as numpy float32 arrays, the same for a seed on every machine and layout.

    Built on the host with numpy so that a layout only decides where the
    values go, never what they are.
    """
    if cfg.width % cfg.heads:
        raise EinshardError(
            f"model width {cfg.width} is not a multiple of the {cfg.heads} heads",
            hint=f"Use a width divisible by {cfg.heads}, e.g. {cfg.heads * max(cfg.width // cfg.heads, 1)}.",
        )
    rng = np.random.default_rng(seed)
    d, h, k, f, n, v = cfg.width, cfg.heads, cfg.head_width, cfg.ffn, cfg.layers, cfg.vocab

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / math.sqrt(fan_in)).astype(np.float32)

    ones, zeros = np.ones((n, d), np.float32), np.zeros((n, d), np.float32)
    return {
        "embed": {"tokens": normal((v, d), d), "positions": normal((cfg.seq, d), d)},
        "layers": {
            "ln1": {"scale": ones.copy(), "bias": zeros.copy()},
            "attn": {
                "wq": normal((n, d, h, k), d),
                "wk": normal((n, d, h, k), d),
                "wv": normal((n, d, h, k), d),
                # Residual branches start small so a deeper stack trains as easily as a shallow one.
                "wo": normal((n, h, k, d), d * 2 * n),
            },
            "ln2": {"scale": ones.copy(), "bias": zeros.copy()},
            "mlp": {"w_in": normal((n, d, f), d), "w_out": normal((n, f, d), f * 2 * n)},
        },
        "final_ln": {"scale": np.ones((d,), np.float32), "bias": np.zeros((d,), np.float32)},
        "unembed": normal((d, v), d),
    }


def count_params(params: Params) -> int:
    return sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))


def _layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale + bias


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """Layer norm over the last axis (the model width): row-local, so any split of the rows computes it."""
    return _layer_norm(x, scale, bias)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention per head: ``q, k, v[b, s, h, k]`` -> ``[b, s, h, k]`` (heads never mix)."""
    s = q.shape[1]
    scores = jnp.einsum("bshk,bthk->bhst", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones((s, s), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    attn = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhst,bthk->bshk", attn, v)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of ``logits[..., vocab]`` against integer ``targets[...]``."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def block(x: jax.Array, p: Params) -> jax.Array:
    """One pre-norm block on activations ``x[b, s, d]`` with one layer's weights (``params['layers']`` at one ``l``).

    The unit a pipeline schedule runs per stage: ``forward`` scans it over the stacked layers.
    """
    y = _layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"])
    q = jnp.einsum("bsd,dhk->bshk", y, p["attn"]["wq"])
    kk = jnp.einsum("bsd,dhk->bshk", y, p["attn"]["wk"])
    vv = jnp.einsum("bsd,dhk->bshk", y, p["attn"]["wv"])
    heads = causal_attention(q, kk, vv)
    x = x + jnp.einsum("bshk,hkd->bsd", heads, p["attn"]["wo"])
    y = _layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"])
    hidden = jax.nn.gelu(jnp.einsum("bsd,df->bsf", y, p["mlp"]["w_in"]))
    return x + jnp.einsum("bsf,fd->bsd", hidden, p["mlp"]["w_out"])


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Token plus position embeddings: activations ``[b, s, d]`` for byte tokens ``[b, s]``."""
    return params["embed"]["tokens"][tokens] + params["embed"]["positions"][: tokens.shape[1]]


def head(params: Params, x: jax.Array) -> jax.Array:
    """The final layer norm and the output projection: logits ``[b, s, vocab]``."""
    x = _layer_norm(x, params["final_ln"]["scale"], params["final_ln"]["bias"])
    return jnp.einsum("bsd,dv->bsv", x, params["unembed"])


def forward(params: Params, tokens: jax.Array) -> jax.Array:
    """Logits ``[b, s, vocab]`` for byte tokens ``[b, s]``: embed, the blocks under ``lax.scan``, head."""

    def step(x: jax.Array, layer: Params) -> tuple[jax.Array, None]:
        return block(x, layer), None

    x, _ = jax.lax.scan(step, embed(params, tokens), params["layers"])
    return head(params, x)


def loss_fn(params: Params, batch: jax.Array, cfg: Config | None = None) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of ``batch[b, seq + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    del cfg  # sizes come from the arrays; kept so callers can pass the config they built with
    inputs, targets = batch[:, :-1], batch[:, 1:]
    return cross_entropy(forward(params, inputs), targets)
