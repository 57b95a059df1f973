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
from jax.sharding import AxisType, NamedSharding, PartitionSpec

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


# On a mesh with Explicit axes (jax.make_mesh's default) JAX types every value with its layout and refuses an op whose
# result's layout is ambiguous or illegal: a lookup in a split table, a matmul contracting a split axis, an axis split
# on both operands. The model then says each such result's layout the way JAX documents (``out_sharding=``,
# ``jax.sharding.reshard``, ``auto_axes`` around one op); on Auto axes (or no mesh) it passes none, and XLA lays the
# ops out by propagation as before. The layout it says: activations stay split like the batch (their rows), and a
# dimension a weight brings (heads, MLP hidden, vocabulary) keeps the weight's split unless the batch uses its axis.


def _explicit_sharding(x: jax.Array) -> NamedSharding | None:
    """``x``'s typed layout where it is on a mesh with Explicit axes (its mesh an abstract one under tracing);
    else None (Auto axes or no mesh)."""
    sharding = jax.typeof(x).sharding
    mesh = getattr(sharding, "mesh", None)
    if not isinstance(sharding, NamedSharding) or AxisType.Explicit not in tuple(getattr(mesh, "axis_types", ())):
        return None
    return sharding


def _explicit_spec(x: jax.Array) -> tuple[Any, ...] | None:
    """``x``'s layout, one entry a dimension, where it is typed on a mesh with Explicit axes; else None."""
    sharding = _explicit_sharding(x)
    if sharding is None:
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (jnp.ndim(x) - len(spec))


def _on_mesh_of(x: jax.Array, *entries: Any) -> NamedSharding:
    """The layout ``entries`` on ``x``'s (Explicit) mesh: a NamedSharding needs no ``jax.set_mesh`` around the step."""
    return NamedSharding(jax.typeof(x).sharding.mesh, PartitionSpec(*entries))


def _mesh_axes(entry: Any) -> set[str]:
    """The mesh axes one PartitionSpec entry names (None, an axis, or a tuple of axes)."""
    if entry is None:
        return set()
    return {entry} if isinstance(entry, str) else set(entry)


def _rows_layout(rows: jax.Array, *entries: Any) -> NamedSharding | None:
    """The layout of a result ``[b, s, *entries]`` computed from activations ``rows[b, s, ...]``: the rows' split,
    then each entry unless it reuses a mesh axis of the rows' (JAX splits a dimension over an axis at most once);
    None off Explicit axes (no ``out_sharding=``: XLA chooses)."""
    spec = _explicit_spec(rows)
    if spec is None:
        return None
    used = _mesh_axes(spec[0]) | _mesh_axes(spec[1])
    return _on_mesh_of(rows, spec[0], spec[1], *(None if _mesh_axes(e) & used else e for e in entries))


def _weight_entries(w: jax.Array, *dims: int) -> tuple[Any, ...]:
    """The weight's split of the dimensions ``dims`` it brings into a result (none off Explicit axes)."""
    spec = _explicit_spec(w)
    return tuple(spec[d] for d in dims) if spec is not None else (None,) * len(dims)


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
    layout = _rows_layout(logp)
    if layout is None:
        picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    else:  # a lookup in the split vocabulary has no typed layout: XLA lays out this one op (auto_axes), as on Auto
        pick = jax.sharding.auto_axes(_take_target, out_sharding=_on_mesh_of(logp, *layout.spec[:2]))
        picked = pick(logp, targets)
    return -jnp.mean(picked)


def _take_target(logp: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def block(x: jax.Array, p: Params) -> jax.Array:
    """One pre-norm block on activations ``x[b, s, d]`` with one layer's weights (``params['layers']`` at one ``l``).

    The unit a pipeline schedule runs per stage: ``forward`` scans it over the stacked layers.
    """
    a = p["attn"]
    y = _layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"])
    q, kk, vv = (
        jnp.einsum("bsd,dhk->bshk", y, w, out_sharding=_rows_layout(y, *_weight_entries(w, 1, 2)))
        for w in (a["wq"], a["wk"], a["wv"])
    )
    heads = causal_attention(q, kk, vv)
    x = x + jnp.einsum("bshk,hkd->bsd", heads, a["wo"], out_sharding=_rows_layout(x, None))
    y = _layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"])
    w_in, w_out = p["mlp"]["w_in"], p["mlp"]["w_out"]
    hidden = jax.nn.gelu(jnp.einsum("bsd,df->bsf", y, w_in, out_sharding=_rows_layout(y, *_weight_entries(w_in, 1))))
    return x + jnp.einsum("bsf,fd->bsd", hidden, w_out, out_sharding=_rows_layout(x, None))


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Token plus position embeddings: activations ``[b, s, d]`` for byte tokens ``[b, s]``."""
    table, positions = params["embed"]["tokens"], params["embed"]["positions"][: tokens.shape[1]]
    layout = _rows_layout(tokens, None)
    if layout is None:
        return table[tokens] + positions
    # Typed: the looked-up rows are split like the tokens, and the positions (added to every row) whole.
    return table.at[tokens].get(out_sharding=layout) + jax.sharding.reshard(
        positions, _on_mesh_of(positions, None, None)
    )


def head(params: Params, x: jax.Array) -> jax.Array:
    """The final layer norm and the output projection: logits ``[b, s, vocab]``."""
    x = _layer_norm(x, params["final_ln"]["scale"], params["final_ln"]["bias"])
    w = params["unembed"]
    return jnp.einsum("bsd,dv->bsv", x, w, out_sharding=_rows_layout(x, *_weight_entries(w, 1)))


def forward(params: Params, tokens: jax.Array) -> jax.Array:
    """Logits ``[b, s, vocab]`` for byte tokens ``[b, s]``: embed, the blocks under ``lax.scan``, head."""

    def step(x: jax.Array, layer: Params) -> tuple[jax.Array, None]:
        return block(x, layer), None

    x, _ = jax.lax.scan(step, embed(params, tokens), jax.tree.map(_whole_layers, params["layers"]))
    return head(params, x)


def _whole_layers(w: jax.Array) -> jax.Array:
    """A stacked weight with its ``layer`` axis whole: ``lax.scan`` takes one layer a step, and on Explicit axes JAX
    refuses a scanned-over axis that is split (on Auto axes XLA gathers it all the same); other axes keep their split.
    """
    spec = _explicit_spec(w)
    if spec is None or spec[0] is None:
        return w
    return jax.sharding.reshard(w, _on_mesh_of(w, None, *spec[1:]))


def loss_fn(params: Params, batch: jax.Array, cfg: Config | None = None) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of ``batch[b, seq + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``."""
    del cfg  # sizes come from the arrays; kept so callers can pass the config they built with
    inputs, targets = batch[:, :-1], batch[:, 1:]
    return cross_entropy(forward(params, inputs), targets)
