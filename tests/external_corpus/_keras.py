"""A Keras 3 model (JAX backend) as a pure ``loss(params, batch)``: ``stateless_call`` with params by path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import unique_keys


def pure_loss(
    model: Any, head: Callable[[Any, dict[str, jax.Array], Any], jax.Array]
) -> tuple[Callable[[Any, Any], jax.Array], dict[str, jax.Array]]:
    """``loss(params, (inputs, target))`` calling ``model`` statelessly, and the model's parameters by path.

    Non-trainable state (batch-norm statistics) is closed over; the training-mode forward uses batch statistics.
    ``head(outputs, params, target)`` turns the model's outputs into the scalar loss (it may read head weights).
    """
    keys = unique_keys([v.path for v in model.trainable_variables])
    params = {k: jnp.asarray(v.value) for k, v in zip(keys, model.trainable_variables)}
    frozen = [jnp.asarray(v.value) for v in model.non_trainable_variables]

    def loss(p: dict[str, jax.Array], batch: Any) -> jax.Array:
        inputs, target = batch
        out, _ = model.stateless_call([p[k] for k in keys], frozen, inputs, training=True)
        return head(out, p, target)

    return loss, params
