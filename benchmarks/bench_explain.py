"""How fast einshard.explain is next to XLA compiling the same step.

A 48-layer decoder transformer training step (loss and gradients, layers
written out, not scanned, so the program is as large as it looks) on a
(data=4, model=2) mesh with Megatron layouts.  We time
``einshard.explain(step, ...)`` (tracing included) and
``jax.jit(step, in_shardings=...).lower(...).compile()``, median of a few runs,
in one process, and write benchmarks/results/explain.{json,md}.

    python benchmarks/bench_explain.py [--layers 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "") and not os.environ.get(
    "JAX_PLATFORMS"
):
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import einshard  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from transformer import _norm, block  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def make_step(layers: int, heads: int):
    """The step with the layers written out (a Python loop): as large a program as it looks."""

    def loss(params, tokens):
        h = params["emb"][tokens]
        for i in range(layers):
            h = block(h, params["layers"][i], heads)
        logits = _norm(h) @ params["emb"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1))

    return jax.value_and_grad(loss)


def shapes(layers: int, d: int, f: int, vocab: int, batch: int, seq: int):
    sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
    layer = {"wq": sds(d, d), "wk": sds(d, d), "wv": sds(d, d), "wo": sds(d, d), "w1": sds(d, f), "w2": sds(f, d)}
    params = {"emb": sds(vocab, d), "layers": [dict(layer) for _ in range(layers)]}
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    rules = {
        r"w[qkv]'\]$": "d h -> d h@model",
        r"wo'\]$": "h d -> h@model d",
        r"w1'\]$": "d f -> d f@model",
        r"w2'\]$": "f d -> f@model d",
        r"emb": "v d -> v d",
    }
    return params, tokens, rules


def _specs(tree, rules):
    import re

    def pick(path, _):
        key = jax.tree_util.keystr(path)
        return next(e for p, e in rules.items() if re.search(p, key))

    return jax.tree_util.tree_map_with_path(pick, tree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d", type=int, default=256)
    args = ap.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params, tokens, rules = shapes(args.layers, args.d, 4 * args.d, 256, 16, 64)
    exprs = _specs(params, rules)
    step = make_step(args.layers, heads=4)
    in_specs = (exprs, "b s -> b@data s")

    explain_times = []
    for _ in range(args.repeats):
        jax.clear_caches()  # trace from scratch each time, as compile does below
        t = time.perf_counter()
        report = einshard.explain(step, params, tokens, mesh=mesh, in_specs=in_specs, profile="h100")
        explain_times.append(time.perf_counter() - t)

    shardings = (
        jax.tree.map(lambda e, s: einshard.sharding(e, s.shape, mesh=mesh), exprs, params),
        einshard.sharding("b s -> b@data s", tokens.shape, mesh=mesh),
    )
    compile_times = []
    for _ in range(max(1, args.repeats - 1)):
        jax.clear_caches()
        t = time.perf_counter()
        jax.jit(step, in_shardings=shardings).lower(params, tokens).compile()
        compile_times.append(time.perf_counter() - t)

    e, c = statistics.median(explain_times), statistics.median(compile_times)
    result = {
        "layers": args.layers,
        "d_model": args.d,
        "mesh": {"data": 4, "model": 2},
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "machine": platform.machine(),
        "explain_s": explain_times,
        "compile_s": compile_times,
        "explain_median_s": e,
        "compile_median_s": c,
        "speedup": c / e,
        "ops_reported": len(report.ops),
        "collectives_predicted": report.comm_count,
        "unfollowed": list(report.unfollowed),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "explain.json").write_text(json.dumps(result, indent=2) + "\n")
    table = (
        f"| {args.layers}-layer transformer step (d={args.d}, mesh data=4 × model=2) | median |\n|---|---|\n"
        f"| `einshard.explain` (tracing included) | {e * 1e3:.0f} ms |\n"
        f"| `jax.jit(...).lower(...).compile()` | {c * 1e3:.0f} ms |\n"
        f"| explain is faster by | **{c / e:.0f}×** |\n"
    )
    (RESULTS / "explain.md").write_text(table)
    print(table)
    print(f"predicted collectives: {report.comm_count}; not followed: {', '.join(report.unfollowed) or 'none'}")


if __name__ == "__main__":
    main()
