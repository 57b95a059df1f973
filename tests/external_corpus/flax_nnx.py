"""Flax NNX's own layers: a GPT-style decoder, tiny, and its whole training step with optax's AdamW.

``nnx_gpt``: token and learned position ``nnx.Embed`` tables, two pre-norm blocks of ``nnx.LayerNorm``,
causal ``nnx.MultiHeadAttention`` (its mask from ``nnx.make_causal_mask``) and an ``nnx.Linear`` MLP with gelu,
a final ``nnx.LayerNorm`` and the LM head tied to the token table (``Embed.attend``), integer-label
cross-entropy.  The model is split as NNX users do (``nnx.split(model, nnx.Param)``) into a graph and a
``State`` of parameters; the loss merges them back, a pure function of ``(state, batch)``.

``nnx_scan``: a deep-stack idiom of NNX: ``nnx.vmap`` over ``nnx.split_rngs`` makes three pre-norm blocks
(``nnx.LayerNorm``, ``nnx.MultiHeadAttention``, an ``nnx.Linear`` MLP) with parameters stacked on a leading axis,
run by ``nnx.scan`` over ``nnx.remat`` blocks.

Each family's ``step`` is the training step users plan whole: loss, gradient and an ``optax.adamw`` update of
``(state, opt_state)``, whose moments are as big as the parameters and take their layouts (the path rules
match the parameters' names inside the optimizer state too).
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import Family

V, D, F, H, S, B, L = 64, 32, 128, 4, 8, 8, 2
STACK = 3  # nnx_scan's layers

_TOKENS = "b s -> b@data s"
_WHOLE = "b s -> b s"
# Megatron for NNX's kernels: MultiHeadAttention's query/key/value (d, heads, head_dim) and out
# (heads, head_dim, d), the MLP's up (d, f) and down (f, d); the tied token table split along the vocabulary
# (a vocabulary-parallel embedding and LM head, as Megatron does).
_MEGATRON = (
    (r"\['(query|key|value)'\]\['kernel'\]", "d h k -> d h@model k"),
    (r"\['(query|key|value)'\]\['bias'\]", "h k -> h@model k"),
    (r"\['out'\]\['kernel'\]", "h k d -> h@model k d"),
    (r"\['up'\]\['kernel'\]", "d f -> d f@model"),
    (r"\['up'\]\['bias'\]", "f -> f@model"),
    (r"\['down'\]\['kernel'\]", "f d -> f@model d"),
    (r"\['tokens'\]\['embedding'\]", "v d -> v@model d"),
)
# FSDP: every matrix and head-shaped kernel split over 'data' along its first axis, tables included.
_FSDP = ((r"", "a b -> a@data b"), (r"", "a b c -> a@data b c"))
# The same on the scanned stack's kernels, stacked on a leading layer axis.
_STACKED_MEGATRON = (
    (r"\['(query|key|value)'\]\['kernel'\]", "l d h k -> l d h@model k"),
    (r"\['(query|key|value)'\]\['bias'\]", "l h k -> l h@model k"),
    (r"\['out'\]\['kernel'\]", "l h k d -> l h@model k d"),
    (r"\['up'\]\['kernel'\]", "l d f -> l d f@model"),
    (r"\['up'\]\['bias'\]", "l f -> l f@model"),
    (r"\['down'\]\['kernel'\]", "l f d -> l f@model d"),
)
_STACKED_FSDP = ((r"kernel", "l a b -> l a@data b"), (r"kernel", "l a b c -> l a@data b c"))


def _adamw_step(loss: Any) -> tuple[Any, Any]:
    """(AdamW, the whole step over ``(state, opt_state)``) for ``loss(state, batch)``."""
    # eps 1e-4, not optax's 1e-8: the key projection's bias has an identically zero gradient (softmax ignores a
    # shift shared by all keys), so its first Adam update is rounding noise scaled by 1/eps; at 1e-8 any sharded
    # sum order flips it by a whole learning rate, and at 1e-6 a CPU whose rounding differs (noise ~5e-9) moved it
    # by 1.1e-5 with the tests' LLVM optimisations off, past the values' check (atol 1e-5); at 1e-4 it stays ~5e-8.
    opt = optax.adamw(1e-3, eps=1e-4)

    def step(carry: tuple[Any, Any], batch: Any) -> tuple[Any, Any]:
        state, opt_state = carry
        grads = jax.grad(loss)(state, batch)
        updates, opt_state = opt.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state

    return opt, step


@cache
def gpt() -> Family:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
            self.up, self.down = nnx.Linear(D, F, rngs=rngs), nnx.Linear(F, D, rngs=rngs)

        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            x = x + self.attn(self.ln1(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class GPT(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.tokens, self.positions = nnx.Embed(V, D, rngs=rngs), nnx.Embed(S, D, rngs=rngs)
            # nnx.List from flax 0.12 (a list attribute holding modules must say so); before it, a plain list.
            self.blocks = getattr(nnx, "List", list)([Block(rngs) for _ in range(L)])
            self.ln_f = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.tokens(tokens) + self.positions(jnp.arange(tokens.shape[1]))
            mask = nnx.make_causal_mask(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.tokens.attend(self.ln_f(x))  # the LM head tied to the token table

    graph, params = nnx.split(GPT(nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32)
    batch = (tokens, jnp.roll(tokens, -1, axis=1))

    def loss(state: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        inputs, labels = batch
        logits = nnx.merge(graph, state)(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    opt, step = _adamw_step(loss)

    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    data, whole = (_TOKENS, _TOKENS), (_WHOLE, _WHOLE)
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family(
        "nnx_gpt",
        "flax-nnx",
        "gpt-adamw",
        loss,
        params,
        batch,
        rules,
        batch_rules,
        step=step,
        opt_state=opt.init(params),
    )


@cache
def scan() -> Family:
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln1, self.ln2 = nnx.LayerNorm(D, rngs=rngs), nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, decode=False, rngs=rngs)
            self.up, self.down = nnx.Linear(D, F, rngs=rngs), nnx.Linear(F, D, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.attn(self.ln1(x))
            return x + self.down(nnx.gelu(self.up(self.ln2(x))))

    class Stack(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            @nnx.split_rngs(splits=STACK)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: nnx.Rngs) -> Block:
                return Block(rngs)

            self.blocks = make(rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            @nnx.remat
            def layer(x: jax.Array, block: Block) -> jax.Array:
                return block(x)

            return layer(x, self.blocks)

    graph, params = nnx.split(Stack(nnx.Rngs(0)), nnx.Param)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)

    def loss(state: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        inputs, wanted = batch
        return jnp.mean((nnx.merge(graph, state)(inputs) - wanted) ** 2)

    opt, step = _adamw_step(loss)
    rules = {"dp": (), "tp": _STACKED_MEGATRON, "dp_tp": _STACKED_MEGATRON, "fsdp": _STACKED_FSDP}
    data, whole = ("b s d -> b@data s d",) * 2, ("b s d -> b s d",) * 2
    batch_rules = {"dp": data, "tp": whole, "dp_tp": data, "fsdp": data}
    return Family(
        "nnx_scan",
        "flax-nnx",
        "scan-remat",
        loss,
        params,
        (x, target),
        rules,
        batch_rules,
        step=step,
        opt_state=opt.init(params),
    )
