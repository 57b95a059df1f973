"""A dm-haiku decoder stack: ``hk.layer_stack`` (a ``lax.scan`` over layers) of ``hk.remat`` blocks.

Blocks are Haiku's own ``hk.MultiHeadAttention``, ``hk.LayerNorm`` and ``hk.nets.MLP``; parameters are stacked
along a leading layer axis ``L``.
"""

from __future__ import annotations

from functools import cache
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from . import Family

Size = Literal["tiny", "large"]
# (batch, seq, d_model, ff, heads, layers).  "tiny" is the corpus' explain check; "large" is for planning: a step
# heavy enough in FLOPs and memory that computing it whole on each of the 8 simulated devices (everything
# replicated) loses to data and tensor splits, so the planner has to split.
SIZES: dict[str, tuple[int, int, int, int, int, int]] = {
    "tiny": (8, 8, 32, 64, 2, 4),
    "large": (32, 64, 256, 1024, 4, 4),
}
B, S, D, F, H, L = SIZES["tiny"]

_X = "b s d -> b@data s d"
# Megatron on stacked weights: (L, d, heads*key) query/key/value column-parallel, (L, heads*key, d) output and
# the MLP's second layer row-parallel, the MLP's first column-parallel.
_MEGATRON = (
    (r"multi_head_attention/(query|key|value)'\]\['w", "l d f -> l d f@model"),
    (r"multi_head_attention/(query|key|value)'\]\['b", "l f -> l f@model"),
    (r"multi_head_attention/linear'\]\['w", "l f d -> l f@model d"),
    (r"mlp/~/linear_0'\]\['w", "l d f -> l d f@model"),
    (r"mlp/~/linear_0'\]\['b", "l f -> l f@model"),
    (r"mlp/~/linear_1'\]\['w", "l f d -> l f@model d"),
)
_FSDP = ((r"'w'", "l a b -> l a@data b"),)
# Data parallel and FSDP over the whole mesh (the "large" size's extra hand layouts).
_X_ALL = "b s d -> b@(data,model) s d"
_FSDP_ALL = ((r"'w'", "l a b -> l a@(data,model) b"),)


def _forward(x: jax.Array, d: int, f: int, heads: int, layers: int) -> jax.Array:
    import haiku as hk

    def block(h: jax.Array) -> jax.Array:
        y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(h)
        h = h + hk.MultiHeadAttention(num_heads=heads, key_size=d // heads, w_init=hk.initializers.VarianceScaling())(
            y, y, y
        )
        y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(h)
        return h + hk.nets.MLP([f, d], activation=jax.nn.gelu)(y)

    return hk.layer_stack(layers)(hk.remat(block))(x)


@cache
def stack(size: Size = "tiny") -> Family:
    import haiku as hk

    b, s, d, f, heads, layers = SIZES[size]
    model = hk.without_apply_rng(hk.transform(lambda x: _forward(x, d, f, heads, layers)))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss(p, batch):
        inputs, target = batch
        return jnp.mean((model.apply(p, inputs) - target) ** 2)

    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    batch_rules = {"dp": (_X, _X), "tp": ("b s d -> b s d",) * 2, "dp_tp": (_X, _X), "fsdp": (_X, _X)}
    if size != "tiny":  # what a user with 8 devices and a step this size writes too: both mesh axes for the batch
        rules |= {"dp_all": (), "fsdp_all": _FSDP_ALL}
        batch_rules |= {"dp_all": (_X_ALL, _X_ALL), "fsdp_all": (_X_ALL, _X_ALL)}
    name = "hk_stack" if size == "tiny" else f"hk_stack_{size}"
    return Family(name, "dm-haiku", "scan-remat", loss, params, (x, y), rules, batch_rules)
