"""A dm-haiku decoder stack: ``hk.layer_stack`` (a ``lax.scan`` over layers) of ``hk.remat`` blocks.

Blocks are Haiku's own ``hk.MultiHeadAttention``, ``hk.LayerNorm`` and ``hk.nets.MLP``; parameters are stacked
along a leading layer axis ``L``.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

from . import Family

B, S, D, F, H, L = 8, 8, 32, 64, 2, 4

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


def _forward(x: jax.Array) -> jax.Array:
    import haiku as hk

    def block(h: jax.Array) -> jax.Array:
        y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(h)
        h = h + hk.MultiHeadAttention(num_heads=H, key_size=D // H, w_init=hk.initializers.VarianceScaling())(y, y, y)
        y = hk.LayerNorm(-1, create_scale=True, create_offset=True)(h)
        return h + hk.nets.MLP([F, D], activation=jax.nn.gelu)(y)

    return hk.layer_stack(L)(hk.remat(block))(x)


@cache
def stack() -> Family:
    import haiku as hk

    model = hk.without_apply_rng(hk.transform(_forward))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    params = model.init(jax.random.key(0), x)

    def loss(p, batch):
        inputs, target = batch
        return jnp.mean((model.apply(p, inputs) - target) ** 2)

    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    batch_rules = {"dp": (_X, _X), "tp": ("b s d -> b s d",) * 2, "dp_tp": (_X, _X), "fsdp": (_X, _X)}
    return Family("hk_stack", "dm-haiku", "scan-remat", loss, params, (x, y), rules, batch_rules)
