"""Equinox's own layers: a rotary-attention decoder and a GRU over time, tiny.

* ``eqx_rotary``: three blocks of ``eqx.nn.LayerNorm``, ``eqx.nn.MultiheadAttention`` with
  ``eqx.nn.RotaryPositionalEmbedding`` on each head (as Equinox's docs show, through ``process_heads``),
  ``eqx.nn.RMSNorm`` and two ``eqx.nn.Linear`` layers, vmapped over the sequence as Equinox layers are;
* ``eqx_gru``: an ``eqx.nn.GRUCell`` run over time by ``lax.scan`` (a recurrent carry: every step reads the
  split weights) and an ``eqx.nn.Linear`` head.

Parameters are the arrays of the modules (``eqx.partition(model, eqx.is_array)``); the loss combines them with
the static parts, as an Equinox training step does.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

from . import Family

B, S, D, F, H, L = 8, 8, 32, 64, 4, 3
OUT = 4

_X = "b s d -> b@data s d"
_REPLICATED_X = "b s d -> b s d"
# Megatron for eqx.nn.MultiheadAttention (projections are (out, in) Linear weights: query/key/value split on
# their outputs, the output projection on its inputs) and the MLP (up on its outputs, down on its inputs).
_MEGATRON = (
    (r"(query_proj|key_proj|value_proj).*weight", "f d -> f@model d"),
    (r"output_proj.*weight", "d f -> d f@model"),
    (r"\.up.*weight", "f d -> f@model d"),
    (r"\.up.*bias", "f -> f@model"),
    (r"\.down.*weight", "d f -> d f@model"),
)
_FSDP = ((r"weight", "a b -> a@data b"),)


def _batch_rules(target: str) -> dict[str, tuple[str, str]]:
    return {
        "dp": (_X, target),
        "tp": (_REPLICATED_X, target.replace("@data", "")),
        "dp_tp": (_X, target),
        "fsdp": (_X, target),
    }


@cache
def rotary() -> Family:
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        att: eqx.nn.MultiheadAttention
        rope: eqx.nn.RotaryPositionalEmbedding
        ln2: eqx.nn.RMSNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k1, k2, k3 = jax.random.split(key, 3)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.RMSNorm(D)
            self.att = eqx.nn.MultiheadAttention(H, D, key=k1)
            self.rope = eqx.nn.RotaryPositionalEmbedding(D // H)
            self.up, self.down = eqx.nn.Linear(D, F, key=k2), eqx.nn.Linear(F, D, key=k3)

        def __call__(self, x: jax.Array) -> jax.Array:
            turn = jax.vmap(self.rope, in_axes=1, out_axes=1)  # rotary on each head's (seq, dim) slice
            y = jax.vmap(self.ln1)(x)
            x = x + self.att(y, y, y, process_heads=lambda q, k, v: (turn(q), turn(k), v))
            y = jax.vmap(self.ln2)(x)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(y)))

    blocks = [Block(k) for k in jax.random.split(jax.random.key(0), L)]
    # Equinox keeps the rotary tables in a module-level cache filled by the first call, arrays and sharding types
    # included: fill it here, outside any mesh context, or a first call under an Explicit mesh leaves tables typed
    # on it that an auto_axes region (Auto context) then refuses to multiply (a test-order dependence).
    blocks[0].rope(jnp.zeros((S, D // H), jnp.float32))
    params, static = eqx.partition(blocks, eqx.is_array)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)

    def loss(p, batch):
        inputs, wanted = batch
        model = eqx.combine(p, static)

        def one(h):
            for block in model:
                h = block(h)
            return h

        return jnp.mean((jax.vmap(one)(inputs) - wanted) ** 2)

    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    return Family("eqx_rotary", "equinox", "rotary", loss, params, (x, target), rules, _batch_rules(_X))


@cache
def gru() -> Family:
    import equinox as eqx

    cell = eqx.nn.GRUCell(D, F, key=jax.random.key(1))
    head = eqx.nn.Linear(F, OUT, key=jax.random.key(2))
    params, static = eqx.partition((cell, head), eqx.is_array)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(B, OUT)), jnp.float32)

    def loss(p, batch):
        inputs, wanted = batch
        step, read_out = eqx.combine(p, static)

        def run(seq):
            state, _ = jax.lax.scan(lambda h, xt: (step(xt, h), None), jnp.zeros(F), seq)
            return read_out(state)

        return jnp.mean((jax.vmap(run)(inputs) - wanted) ** 2)

    # The cell's three gates stacked on the weights' first axis (3·hidden): split over 'model' on it.
    tp = ((r"weight_ih", "g d -> g@model d"), (r"weight_hh", "g f -> g@model f"))
    rules = {"dp": (), "tp": tp, "dp_tp": tp, "fsdp": _FSDP}
    return Family("eqx_gru", "equinox", "rnn", loss, params, (x, target), rules, _batch_rules("b o -> b@data o"))
