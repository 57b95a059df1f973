"""Tiny models and hand-written presets for measuring einshard.plan against XLA (tests and benchmarks/bench_planner.py).

Each model is ``(step, params, batch, presets)``: ``step = jax.value_and_grad(loss)``,
``params`` and ``batch`` concrete arrays, ``presets`` name -> (param rules, batch rule)
as a practitioner writes them for that model (dp, fsdp, tp, hybrid, fsdp-tp).
:func:`compiled_costs` compiles a layout (in_shardings; gradients out like the
parameters) and reads XLA's own numbers: bytes sent by the HLO collectives and
FLOPs per device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard.testing import hlo

Rules = Mapping[str, str]


def expression_tree(tree: Any, rules: Rules | str) -> Any:
    """Each leaf's expression: the first rule whose pattern is found in its path (einshard()'s matching)."""
    if isinstance(rules, str):
        return jax.tree.map(lambda _: rules, tree)
    compiled = [(re.compile(p), e) for p, e in rules.items()]

    def one(path: Any, x: Any) -> str:
        key = jax.tree_util.keystr(path)
        for rx, e in compiled:
            if rx.search(key):
                return e
        raise KeyError(key)

    return jax.tree_util.tree_map_with_path(one, tree)


def shardings(tree: Any, rules: Rules | str, mesh: Any) -> Any:
    exprs = expression_tree(tree, rules)
    return jax.tree.map(lambda e, x: einshard.sharding(e, tuple(x.shape), mesh=mesh), exprs, tree)


def compiled_costs(step: Any, params: Any, batch: Any, prules: Rules, brule: Rules | str, mesh: Any) -> dict[str, Any]:
    """Compile ``step`` under a layout: XLA's bytes sent per device, FLOPs per device, and the jitted step."""
    sh_p = shardings(params, prules, mesh)
    sh_b = shardings(batch, brule, mesh)
    jitted = jax.jit(step, in_shardings=(sh_p, sh_b), out_shardings=(NamedSharding(mesh, P()), sh_p))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    compiled = jitted.lower(*abstract).compile()
    colls = hlo.normalized(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {
        # per step: a collective inside a while loop (the demo's lax.scan over layers) counted once per iteration
        "comm_bytes": float(sum(c.sent_bytes * c.runs for c in colls)),
        "collectives": sum(c.runs for c in colls),
        "flops": float(cost.get("flops", 0.0)),
        "jitted": jitted,
        "shardings": (sh_p, sh_b),
    }


def data_rule(result: Any) -> str:
    (expr,) = result.data_rules[0].values()
    return expr


# ---------------------------------------------------------------------------
# The demo's transformer (einshard_apps/models/transformer.py) with the demo's presets


def mlp_step(n_layers: int) -> Any:
    """value_and_grad of a tanh MLP's mean square output; params ``{'w0': [d0, d1], ...}``."""

    def loss(p: Any, x: Any) -> Any:
        return jnp.mean(mlp_forward(n_layers)(p, x) ** 2)

    return jax.value_and_grad(loss)


def mlp_forward(n_layers: int) -> Any:
    """The MLP itself (the planner's inference objective)."""

    def forward(p: Any, x: Any) -> Any:
        h = x
        for i in range(n_layers):
            h = jnp.tanh(h @ p[f"w{i}"])
        return h

    return forward


def demo_transformer(batch: int = 64) -> tuple[Any, Any, Any, dict[str, tuple[Rules, str]]]:
    from einshard_apps.models import transformer as tm
    from einshard_apps.presets import PRESETS

    cfg = tm.Config(layers=2, width=32, heads=4, ffn=128, seq=16)
    params = jax.tree.map(jnp.asarray, tm.init(cfg, 0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab, (batch, cfg.seq + 1)), jnp.int32)
    presets = {n: (dict(PRESETS[n].params), PRESETS[n].batch) for n in ("dp", "fsdp", "tp", "hybrid", "fsdp-tp")}
    return jax.value_and_grad(tm.loss_fn), params, tokens, presets


# ---------------------------------------------------------------------------
# A Flax NNX transformer from nnx layers (Embed, MultiHeadAttention, LayerNorm, Linear)


def nnx_transformer(batch: int = 64) -> tuple[Any, Any, Any, dict[str, tuple[Rules, str]]]:
    from flax import nnx

    d, heads, f, vocab, seq = 32, 4, 128, 256, 16

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=heads, in_features=d, qkv_features=d, decode=False, use_bias=False, rngs=rngs
            )
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.up = nnx.Linear(d, f, rngs=rngs)
            self.down = nnx.Linear(f, d, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
            return x + self.down(jax.nn.gelu(self.up(self.ln2(x))))

    class Model(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(vocab, d, rngs=rngs)
            self.blocks = (
                nnx.List([Block(rngs) for _ in range(2)]) if hasattr(nnx, "List") else [Block(rngs) for _ in range(2)]
            )
            self.ln = nnx.LayerNorm(d, rngs=rngs)
            self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

        def __call__(self, tokens: jax.Array) -> jax.Array:
            x = self.embed(tokens)
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    graphdef, state = nnx.split(Model(nnx.Rngs(0)))
    params = nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        st = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(st, p)
        logits = nnx.merge(graphdef, st)(tokens[:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)), jnp.int32)
    megatron = {
        r"\['(query|key|value)'\]\['kernel'\]": "d h k -> d h@model k",
        r"\['out'\]\['kernel'\]": "h k d -> h@model k d",
        r"\['up'\]\['kernel'\]": "d f -> d f@model",
        r"\['up'\]\['bias'\]": "f -> f@model",
        r"\['down'\]\['kernel'\]": "f d -> f@model d",
        r"\['embed'\]": "v d -> v@model d",
        r"\['head'\]\['kernel'\]": "d v -> d v@model",
        r".*": "... -> ...",
    }
    fsdp = {
        r"\['(query|key|value)'\]\['kernel'\]": "d h k -> d@data h k",
        r"\['out'\]\['kernel'\]": "h k d -> h k d@data",
        r"\['up'\]\['kernel'\]": "d f -> d f@data",
        r"\['down'\]\['kernel'\]": "f d -> f@data d",
        r"\['embed'\]": "v d -> v@data d",
        r"\['head'\]\['kernel'\]": "d v -> d v@data",
        r".*": "... -> ...",
    }
    fsdp_tp = {
        r"\['(query|key|value)'\]\['kernel'\]": "d h k -> d@data h@model k",
        r"\['out'\]\['kernel'\]": "h k d -> h@model k d@data",
        r"\['up'\]\['kernel'\]": "d f -> d@data f@model",
        r"\['down'\]\['kernel'\]": "f d -> f@model d@data",
        r"\['embed'\]": "v d -> v@model d@data",
        r"\['head'\]\['kernel'\]": "d v -> d@data v@model",
        r".*": "... -> ...",
    }
    presets = {
        "dp": ({".*": "... -> ..."}, "b s -> b@data s"),
        "fsdp": (fsdp, "b s -> b@data s"),
        "tp": (megatron, "b s -> b s"),
        "hybrid": (megatron, "b s -> b@data s"),
        "fsdp-tp": (fsdp_tp, "b s -> b@data s"),
    }
    return jax.value_and_grad(loss), params, tokens, presets


# ---------------------------------------------------------------------------
# An Equinox transformer from eqx.nn layers: per-example under vmap, (out, in) weights


def eqx_transformer(batch: int = 64) -> tuple[Any, Any, Any, dict[str, tuple[Rules, str]]]:
    import equinox as eqx
    import optax

    d, heads, f, vocab, seq = 32, 4, 128, 256, 16

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 3)
            self.ln1 = eqx.nn.LayerNorm(d)
            self.attn = eqx.nn.MultiheadAttention(heads, d, key=k[0])
            self.ln2 = eqx.nn.LayerNorm(d)
            self.up = eqx.nn.Linear(d, f, key=k[1])
            self.down = eqx.nn.Linear(f, d, key=k[2])

        def __call__(self, h: jax.Array) -> jax.Array:
            x = jax.vmap(self.ln1)(h)
            mask = jnp.tril(jnp.ones((h.shape[0], h.shape[0]), bool))
            h = h + self.attn(x, x, x, mask=mask)
            return h + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.ln2)(h))))

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list[Block]
        ln: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key: jax.Array) -> None:
            k = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(vocab, d, key=k[0])
            self.blocks = [Block(k[1]), Block(k[2])]
            self.ln = eqx.nn.LayerNorm(d)
            self.head = eqx.nn.Linear(d, vocab, use_bias=False, key=k[3])

        def __call__(self, tokens: jax.Array) -> jax.Array:
            h = jax.vmap(self.embed)(tokens)
            for blk in self.blocks:
                h = blk(h)
            return jax.vmap(self.head)(jax.vmap(self.ln)(h))

    params, static = eqx.partition(Model(jax.random.key(0)), eqx.is_array)

    def loss(p: Any, tokens: jax.Array) -> jax.Array:
        logits = jax.vmap(eqx.combine(p, static))(tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)), jnp.int32)
    # (out, in) weights: column-parallel splits the first axis, row-parallel the second.
    megatron = {
        r"\.(query|key|value)_proj\.weight": "o i -> o@model i",
        r"\.output_proj\.weight": "o i -> o i@model",
        r"\.up\.weight": "o i -> o@model i",
        r"\.up\.bias": "o -> o@model",
        r"\.down\.weight": "o i -> o i@model",
        r"\.embed\.weight": "v d -> v@model d",
        r"\.head\.weight": "v d -> v@model d",
        r".*": "... -> ...",
    }
    fsdp = {
        r"\.(query|key|value)_proj\.weight": "o i -> o i@data",
        r"\.output_proj\.weight": "o i -> o@data i",
        r"\.up\.weight": "o i -> o@data i",
        r"\.down\.weight": "o i -> o i@data",
        r"\.embed\.weight": "v d -> v@data d",
        r"\.head\.weight": "v d -> v@data d",
        r".*": "... -> ...",
    }
    fsdp_tp = {
        r"\.(query|key|value)_proj\.weight": "o i -> o@model i@data",
        r"\.output_proj\.weight": "o i -> o@data i@model",
        r"\.up\.weight": "o i -> o@model i@data",
        r"\.down\.weight": "o i -> o@data i@model",
        r"\.embed\.weight": "v d -> v@model d@data",
        r"\.head\.weight": "v d -> v@model d@data",
        r".*": "... -> ...",
    }
    presets = {
        "dp": ({".*": "... -> ..."}, "b s -> b@data s"),
        "fsdp": (fsdp, "b s -> b@data s"),
        "tp": (megatron, "b s -> b s"),
        "hybrid": (megatron, "b s -> b@data s"),
        "fsdp-tp": (fsdp_tp, "b s -> b@data s"),
    }
    return jax.value_and_grad(loss), params, tokens, presets
