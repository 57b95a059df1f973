"""How long einshard.plan takes, and how much faster its layout is predicted to be than hand-written presets.

Two models, analysed from shapes only (``jax.ShapeDtypeStruct``), training steps
(``jax.value_and_grad`` of the next-token loss, layer stack under ``lax.scan``),
H100 profile, Adam state counted:

* small: the demo-sized transformer (4 layers, d=512) on mesh data=4 × model=2;
* large: 48 layers, d=8192 (f=32768, ~40 B parameters, bf16) on a 2048-device
  mesh data=256 × model=8, 80 GiB per device.

For each: planning time (median of ``--repeats`` runs, tracing included), the
plan's predicted step time, and the same cost model's prediction for the
hand-written presets dp, fsdp, tp (Megatron over every device) and hybrid
(batch over data, Megatron over model); speed-up = best preset that fits /
plan.  Plus the coordinate-descent gap: on random small MLPs (and budgets), the heuristic's
choice vs the exhaustive optimum.  Writes benchmarks/results/planner.{json,md}.

    python benchmarks/bench_planner.py [--repeats 5] [--gap-trials 20]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import random
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from transformer import make_step, shapes  # noqa: E402

import einshard  # noqa: E402
from einshard.analysis import planner as pl  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def presets(mesh: dict[str, int]) -> dict[str, tuple[dict[str, str], str]]:
    """Hand-written layouts for the transformer, as users write them."""
    axes = list(mesh)
    every = "(" + ",".join(axes) + ")" if len(axes) > 1 else axes[0]
    model = axes[-1]
    data = axes[0]

    def megatron(tp: str) -> dict[str, str]:
        return {
            r"\['w[qkv1]'\]": f"l x y -> l x y@{tp}",
            r"\['w[o2]'\]": f"l x y -> l x@{tp} y",
            r"emb": f"v d -> v@{tp} d",
        }

    return {
        "dp": ({r".*emb": "v d -> v d", r".*": "l x y -> l x y"}, f"b s -> b@{every} s"),
        "fsdp": ({r".*emb": f"v d -> v@{every} d", r".*": f"l x y -> l x@{every} y"}, f"b s -> b@{every} s"),
        "tp": (megatron(every), "b s -> b s"),
        "hybrid": (megatron(model), f"b s -> b@{data} s"),
    }


def bench_model(name, layers, d, f, vocab, batch, seq, heads, mesh, budget, repeats):
    params, tokens = shapes(layers, d, f, vocab, batch, seq)
    step = make_step(heads)
    times, result = [], None
    for _ in range(repeats):
        jax.clear_caches()
        t = time.perf_counter()
        result = einshard.plan(
            step, params, tokens, mesh=mesh, profile="h100", memory_budget=budget, presets=presets(mesh)
        )
        times.append(time.perf_counter() - t)
    assert result is not None
    pre = {a.label.removeprefix("preset "): a for a in result.alternatives if a.label.startswith("preset ")}
    fitting = [a for a in pre.values() if a.fits]
    best = min(fitting, key=lambda a: a.time_s) if fitting else None
    return {
        "model": name,
        "layers": layers,
        "d_model": d,
        "d_ff": f,
        "params": sum(int(jnp.prod(jnp.array(x.shape))) for x in jax.tree_util.tree_leaves(params)),
        "mesh": mesh,
        "budget": budget,
        "planning_s_median": statistics.median(times),
        "planning_s_all": times,
        "method": result.method,
        "evaluated": result.evaluated,
        "space": result.space,
        "plan": {
            "rules": result.rules,
            "data_rules": [dict(r) for r in result.data_rules],
            "strategies": result.strategies,
        },
        "plan_time_s": result.time_s,
        "plan_memory_bytes": result.memory_bytes,
        "plan_fits": result.fits,
        "presets": {
            k: {"time_s": a.time_s, "memory_bytes": a.memory_bytes, "comm_bytes": a.comm_bytes, "fits": a.fits}
            for k, a in pre.items()
        },
        "best_preset": None if best is None else best.label.removeprefix("preset "),
        "speedup_vs_best_preset": None if best is None else best.time_s / result.time_s,
        "explanation": result.explanation,
    }


def heuristic_gap(trials: int, seed: int = 0) -> dict:
    """Coordinate descent vs exhaustive search on random 1-3 layer MLPs, with and without budgets."""

    def make(n):
        def loss(p, x):
            h = x
            for i in range(n):
                h = jnp.tanh(h @ p[f"w{i}"])
            return jnp.mean(h**2)

        return jax.value_and_grad(loss)

    rng = random.Random(seed)
    gaps, cd_evals, ex_evals = [], [], []
    for _ in range(trials):
        n = rng.choice([1, 2, 2, 3])
        dims = [rng.choice([16, 64, 256, 1024]) for _ in range(n + 1)]
        b = rng.choice([8, 64, 256, 4096])
        mesh = rng.choice([{"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8}, {"data": 2, "model": 2}])
        obj = rng.choice(list(pl.OBJECTIVES))
        params = {f"w{i}": jax.ShapeDtypeStruct((dims[i], dims[i + 1]), jnp.float32) for i in range(n)}
        x = jax.ShapeDtypeStruct((b, dims[0]), jnp.float32)
        free = pl.plan(make(n), params, x, mesh=mesh, profile="h100", objective=obj)
        dp = next(a for a in free.alternatives if a.label == "preset dp")
        frac = rng.choice([None, 0.5, 0.9])
        budget = None if frac is None else int(frac * dp.memory_bytes)
        kw = dict(mesh=mesh, profile="h100", objective=obj, memory_budget=budget)
        ex = pl.plan(make(n), params, x, exhaustive_limit=10**6, **kw)
        cd = pl.plan(make(n), params, x, exhaustive_limit=0, **kw)
        if not ex.fits:  # nothing fits: both return the least memory
            gaps.append(cd.memory_bytes / ex.memory_bytes - 1)
            cd_evals.append(cd.evaluated)
            ex_evals.append(ex.evaluated)
            continue
        key = {"training": "time_s", "inference": "time_s", "memory": "memory_bytes", "communication": "comm_bytes"}
        a, c = getattr(ex, key[obj]), getattr(cd, key[obj])
        gaps.append((c / a - 1) if a else 0.0)
        cd_evals.append(cd.evaluated)
        ex_evals.append(ex.evaluated)
    return {
        "trials": trials,
        "optimal": sum(g <= 1e-9 for g in gaps),
        "max_gap": max(gaps),
        "mean_cd_evaluations": statistics.mean(cd_evals),
        "mean_exhaustive_evaluations": statistics.mean(ex_evals),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gap-trials", type=int, default=20)
    args = ap.parse_args()
    models = [
        bench_model("small (demo-size)", 4, 512, 2048, 1024, 32, 128, 8, {"data": 4, "model": 2}, "2GiB", args.repeats),
        bench_model(
            "48 x 8192 on 2048 devices",
            48,
            8192,
            32768,
            32768,
            2048,
            2048,
            64,
            {"data": 256, "model": 8},
            "80GiB",
            args.repeats,
        ),
    ]
    gap = heuristic_gap(args.gap_trials)
    result = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "models": models,
        "heuristic_gap": gap,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "| model | mesh | planning (median) | searched | plan step | best preset | preset step | predicted speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in models:
        mesh = " × ".join(f"{k}={v}" for k, v in m["mesh"].items())
        best = m["best_preset"]
        pt = m["presets"][best]["time_s"] if best else float("nan")
        speed = f"**{m['speedup_vs_best_preset']:.2f}×**" if best else "n/a (no preset fits)"
        lines.append(
            f"| {m['model']} | {mesh} | {m['planning_s_median']:.2f} s | {m['evaluated']} of {m['space']} "
            f"({m['method']}) | {m['plan_time_s'] * 1e3:.1f} ms | {best} | {pt * 1e3:.1f} ms | {speed} |"
        )
    lines.append("")
    lines.append("Presets (predicted by the same cost model; budget per device in brackets):")
    lines.append("")
    for m in models:
        lines.append(
            f"- {m['model']} ({m['budget']}): "
            + ", ".join(
                f"{k} {v['time_s'] * 1e3:.1f} ms{'' if v['fits'] else ' (does not fit)'}"
                for k, v in m["presets"].items()
            )
            + f"; plan: {', '.join(f'{k}: {v}' for k, v in m['plan']['strategies'].items())}"
        )
    lines.append("")
    lines.append(
        f"Coordinate descent vs exhaustive on {gap['trials']} random 1–3 layer MLPs (with and without budgets): optimal in {gap['optimal']}, "
        f"max gap {gap['max_gap'] * 100:.2f}%, {gap['mean_cd_evaluations']:.0f} vs "
        f"{gap['mean_exhaustive_evaluations']:.0f} assignments costed on average."
    )
    lines.append("")
    lines.append(
        f"jax {jax.__version__}, Python {platform.python_version()}, {platform.machine()}, 2 CPU cores; "
        "times are predictions of einshard's cost model (H100 profile), not measurements."
    )
    (RESULTS / "planner.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
