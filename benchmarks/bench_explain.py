"""How fast einshard.explain is next to XLA compiling the same step, phase by phase.

Programs: a 48-layer decoder transformer training step (loss and gradients,
layers written out, not scanned, so the program is as large as it looks; d=128
by default to keep the run short, the old README figure used d=256), and the
test corpus's models (tests/corpus: plain jnp, Flax NNX, Flax Linen, Equinox,
a mixture of experts), each as ``jax.grad`` of its loss under DP×TP, on a
(data=4, model=2) mesh.  For each we time, separately: tracing to a jaxpr
(``einshard.analysis.program.trace``), the walk (``TracedProgram.report``),
``jax.jit(...).lower(...)`` and ``.compile()``, medians of a few runs in one
process, and write benchmarks/results/explain.{json,md}.  Explain's end-to-end
time is tracing + walk; XLA's is lower + compile (lowering traces too).

    python benchmarks/bench_explain.py [--layers 48] [--d 128] [--repeats 3]
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
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from transformer import _norm, block  # noqa: E402

from einshard._src.analysis.program import trace  # noqa: E402

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


def _phases(fn, params, batch, in_specs, mesh, repeats: int, compile_repeats: int, compile_s=None) -> dict:
    """Medians of: tracing, the walk, lower, compile (seconds), and what explain predicted.

    ``compile_s``: a compile time measured earlier (the large program's compile: 4-30 min on 2 shared cores): lower is timed once
    and not compiled.
    """
    place = lambda e, s: einshard.sharding(e, s.shape, mesh=mesh)  # noqa: E731
    shardings = jax.tree.map(place, in_specs, (params, batch))
    traces, walks = [], []
    for _ in range(repeats):
        jax.clear_caches()  # trace from scratch each time, as lowering does below
        t = time.perf_counter()
        traced = trace(fn, params, batch, mesh=mesh, profile="h100")
        traces.append(time.perf_counter() - t)
        t = time.perf_counter()
        report = traced.report(in_specs)
        walks.append(time.perf_counter() - t)
    lowers, compiles = [], []
    for _ in range(compile_repeats):
        jax.clear_caches()
        t = time.perf_counter()
        lowered = jax.jit(fn, in_shardings=shardings).lower(params, batch)
        lowers.append(time.perf_counter() - t)
        if compile_s is not None:
            compiles.append(compile_s)
            continue
        t = time.perf_counter()
        lowered.compile()
        compiles.append(time.perf_counter() - t)
    med = statistics.median
    out = {
        "trace_s": med(traces),
        "walk_s": med(walks),
        "lower_s": med(lowers),
        "compile_s": med(compiles),
        "runs": {"trace": traces, "walk": walks, "lower": lowers, "compile": compiles},
        "ops_reported": len(report.ops),
        "collectives_predicted": report.comm_count,
        "unfollowed": list(report.unfollowed),
    }
    out["walk_over_lower_compile"] = out["walk_s"] / (out["lower_s"] + out["compile_s"])
    out["speedup_end_to_end"] = (out["lower_s"] + out["compile_s"]) / (out["trace_s"] + out["walk_s"])
    return out


def _corpus(mesh, repeats: int) -> dict:
    import importlib

    from corpus import specs_for

    out = {}
    for name, strategy in (
        ("jnp_transformer", "dp_tp"),
        ("nnx_transformer", "dp_tp"),
        ("linen_transformer", "dp_tp"),
        ("eqx_transformer", "dp_tp"),
        ("moe", "ep"),
    ):
        case = importlib.import_module(f"corpus.{name}").CASE
        specs = specs_for(case, strategy)
        out[f"{case.name} ({strategy}, grad)"] = _phases(
            jax.grad(case.loss), case.params, case.batch, specs, mesh, repeats, repeats
        )
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.1 else f"{s * 1e3:.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--no-corpus", action="store_true")
    ap.add_argument(
        "--reuse-large",
        action="store_true",
        help="keep the large program's compile time from the last results/explain.json (it takes 4-30 min on "
        "2 shared cores) and re-measure the rest; the table says which time is reused and from when",
    )
    args = ap.parse_args()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    large = f"{args.layers}-layer transformer step (d={args.d})"
    previous = json.loads((RESULTS / "explain.json").read_text()) if args.reuse_large else {}
    params, tokens, rules = shapes(args.layers, args.d, 4 * args.d, 256, 16, 64)
    exprs = _specs(params, rules)
    step = make_step(args.layers, heads=4)
    if large in previous.get("programs", {}):
        # Trace, walk and lower measured now; only the compile is the earlier run's.
        old = previous["programs"][large]
        when = old.get("compile_measured", old.get("measured", previous.get("measured", "an earlier day")))
        row = _phases(step, params, tokens, (exprs, "b s -> b@data s"), mesh, 1, 1, compile_s=old["compile_s"])
        row["compile_measured"] = when
    else:
        row = _phases(step, params, tokens, (exprs, "b s -> b@data s"), mesh, args.repeats, 1)
        row["compile_measured"] = time.strftime("%Y-%m-%d")
    row["measured"] = time.strftime("%Y-%m-%d")
    programs = {large: row}
    if not args.no_corpus:
        programs.update(_corpus(mesh, args.repeats))
    result = {
        "mesh": {"data": 4, "model": 2},
        "jax": jax.__version__,
        "device": jax.devices()[0].device_kind,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "measured": time.strftime("%Y-%m-%d"),
        "corpus_repeats": args.repeats,
        "programs": programs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "explain.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| program (mesh data=4 × model=2) | trace | walk | lower | compile | walk / (lower+compile) "
        "| explain vs XLA end to end |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in programs.items():
        when = r.get("compile_measured", "")
        reused = f" (compile time reused from the run of {when})" if name == large and args.reuse_large else ""
        lines.append(
            f"| {name}{reused} | {_ms(r['trace_s'])} | {_ms(r['walk_s'])} | {_ms(r['lower_s'])} | {_ms(r['compile_s'])} "
            f"| {100 * r['walk_over_lower_compile']:.1f}% | {r['speedup_end_to_end']:.1f}× faster |"
        )
    lines.append("")
    lines.append(
        f"Wall-clock on {platform.machine()} with {os.cpu_count()} CPU cores, jax {jax.__version__}; "
        f"corpus rows: {args.repeats} run(s) each (medians of {args.repeats}); "
        "the large program's lower and compile are one run. On a machine shared with other jobs the absolute "
        "times are inflated (and unevenly: phases run at different moments); the ratios are indicative. "
        "Explain end to end = trace + walk; XLA = lower + compile."
    )
    table = "\n".join(lines) + "\n"
    (RESULTS / "explain.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
