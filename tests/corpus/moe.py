"""A plain-``jax.numpy`` mixture-of-experts layer (GShard-style top-1 dispatch), experts split over ``data``.

Tokens are split over ``data`` by batch; the experts' weights over ``data`` by
expert.  The layer states where its dispatched tokens live with
``with_sharding_constraint`` (as GShard/Mixtral implementations do): batch-split
before the experts, expert-split inside them: XLA moves them with all-to-alls.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from . import Case

B, S, D, F, E, C = 8, 8, 32, 64, 4, 4  # capacity C tokens per expert per example
MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _at(x: jax.Array, *spec: Any) -> jax.Array:
    return jax.lax.with_sharding_constraint(x, NamedSharding(MESH, P(*spec)))


def loss(p: dict[str, Any], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    gates = jax.nn.softmax(jnp.einsum("bsd,de->bse", x, p["router"]), axis=-1)
    expert = jnp.argmax(gates, axis=-1)
    onehot = jax.nn.one_hot(expert, E)  # [b, s, e]
    position = jnp.cumsum(onehot, axis=1) * onehot - 1  # slot of each token in its expert's buffer
    dispatch = onehot[..., None] * jax.nn.one_hot(position, C)  # [b, s, e, c]
    combine = dispatch * jnp.max(gates, axis=-1)[..., None, None]
    tokens = _at(jnp.einsum("bsec,bsd->ebcd", dispatch, x), None, "data")
    tokens = _at(tokens, "data")  # all-to-all: batch-split -> expert-split
    h = jax.nn.gelu(jnp.einsum("ebcd,edf->ebcf", tokens, p["w_in"]))
    out = _at(jnp.einsum("ebcf,efd->ebcd", h, p["w_out"]), "data")
    out = _at(out, None, "data")  # all-to-all back
    pred = jnp.einsum("ebcd,bsec->bsd", out, combine)
    return jnp.mean((pred - y) ** 2)


def _sds(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


CASE = Case(
    name="moe",
    loss=loss,
    params={"router": _sds(D, E), "w_in": _sds(E, D, F), "w_out": _sds(E, F, D)},
    batch=(_sds(B, S, D), _sds(B, S, D)),
    rules={"ep": ((r"w_", "e a b -> e@data a b"),)},
    batch_rules={"ep": ("b s d -> b@data s d", "b s d -> b@data s d")},
)
