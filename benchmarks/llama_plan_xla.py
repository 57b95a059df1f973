"""XLA's check of the 80-layer llama-7b plan's one change (docs/planner.md, Limits), on a model XLA compiles here.

``einshard.plan`` of the unrolled llama-7b on ``tpu:v5p:4x4x4`` (``einshard_apps.models.llama``,
64 sequences of 2048, ``max_evaluations=160``) returned a plan that differed from the previous one only in
``w_gate``: laid out like ``w_up`` (``l x@model y@data``) where it had been ``l x y@(data,model)``.  This compiles
both layouts of the same architecture at 2 layers, width 256, on a (16, 4) mesh of 64 simulated CPU devices (the
target's mesh shape; the batch replicated as in both plans) and prints XLA's collectives, bytes sent per device
and temporary memory.

    python benchmarks/llama_plan_xla.py
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=64"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import einshard  # noqa: E402
from einshard._src.tree_rules import leaf_expressions  # noqa: E402
from einshard.testing import hlo  # noqa: E402
from einshard_apps.models import llama  # noqa: E402

NEW = {
    "['embed']": "x y -> x y",
    "['final_norm']": "x -> x",
    "['layers']['attn_norm']": "x y -> x y",
    "['layers']['mlp_norm']": "x y -> x y",
    "['unembed']": "x y -> x y",
    "['layers']['attn']['wk']": "l x y z -> l x@model y@data z",
    "['layers']['attn']['wq']": "l x y z -> l x@model y@data z",
    "['layers']['attn']['wv']": "l x y z -> l x@model y@data z",
    "['layers']['attn']['wo']": "l x y z -> l x@data y z@model",
    "['layers']['mlp']['w_down']": "l x y -> l x@data y@model",
    "['layers']['mlp']['w_gate']": "l x y -> l x@model y@data",
    "['layers']['mlp']['w_up']": "l x y -> l x@model y@data",
}
OLD = NEW | {"['layers']['mlp']['w_gate']": "l x y -> l x y@(data,model)"}


def compiled_numbers(rules: dict[str, str]) -> dict[str, object]:
    cfg = llama.LlamaConfig(
        "mini", layers=2, width=256, heads=16, kv_heads=16, ffn=512, vocab=1024, seq=128, unroll=True
    )
    params = llama.shapes(cfg, dtype=jnp.float32)
    tokens = jax.ShapeDtypeStruct((16, cfg.seq + 1), jnp.int32)
    mesh = jax.make_mesh((16, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    exact = {"^" + re.escape(path) + "$": expr for path, expr in rules.items()}
    exprs = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), leaf_expressions(params, exact))
    psh = jax.tree.map(lambda e, a: einshard.sharding(e, a.shape, mesh=mesh), exprs, params)
    step = jax.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg))
    replicated = NamedSharding(mesh, P())
    comp = (
        jax.jit(step, in_shardings=(psh, replicated), out_shardings=(replicated, psh)).lower(params, tokens).compile()
    )
    colls = hlo.normalized(comp.as_text())
    kinds: dict[str, int] = {}
    for c in colls:
        kinds[c.kind] = kinds.get(c.kind, 0) + c.runs
    return {
        "bytes_sent": sum(c.sent_bytes * c.runs for c in colls),
        "collectives": sum(c.runs for c in colls),
        "kinds": kinds,
        "temp_bytes": comp.memory_analysis().temp_size_in_bytes,
    }


if __name__ == "__main__":
    for name, rules in (("w_gate l x y@(data,model) (the 4.36 s plan)", OLD), ("w_gate like w_up (3.64 s)", NEW)):
        print(name, compiled_numbers(rules))
