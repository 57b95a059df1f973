"""How long einshard.plan takes, and how its layout does against hand-written presets when XLA compiles and runs it.

1. **Planning time** (median of ``--repeats`` runs, tracing included) on:
   ``einshard plan --model transformer`` (the demo's 2-layer transformer,
   H100 profile), the same model, a Flax NNX and an Equinox 2-layer transformer
   (``tests/planner_models.py``) with the ``cpu`` profile, and a 48-layer
   d=8192 transformer on a 2048-device mesh (predictions only).
2. **Measured against reality** on a (4, 2) mesh of this machine's simulated
   CPU devices: the plan (``cpu`` profile) and each preset (dp, fsdp, tp,
   hybrid, fsdp-tp, written for the model) compiled with ``jax.jit``: XLA's
   bytes sent per device (HLO collectives), FLOPs per device
   (``cost_analysis``), and the measured step time (median of ``--steps``
   runs, the layouts interleaved round-robin in one process so drift hits all
   alike).
3. The descent's gap to exhaustive search on random small MLPs.

Writes benchmarks/results/planner.{json,md}.

    python benchmarks/bench_planner.py [--repeats 3] [--steps 60] [--gap-trials 10]
    python benchmarks/bench_planner.py --only gap --gap-trials 30   # the gap alone, merged into planner.json
    python benchmarks/bench_planner.py --only large                 # the 48-layer predictions alone, merged
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import random
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # the measured (4, 2) mesh
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import planner_models as pm  # noqa: E402
from transformer import make_step, shapes  # noqa: E402

import einshard  # noqa: E402
from einshard import planner as pl  # noqa: E402

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


def bench_model(name, layers, d, f, vocab, batch, seq, heads, mesh, budget, repeats):  # the large model
    params, tokens = shapes(layers, d, f, vocab, batch, seq)
    step = make_step(heads)
    times, cpu, result = [], [], None
    for _ in range(repeats):
        jax.clear_caches()
        t, c = time.perf_counter(), time.process_time()
        result = einshard.plan(
            step, params, tokens, mesh=mesh, profile="h100", memory_budget=budget, presets=presets(mesh)
        )
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    assert result is not None
    pre = {a.label.removeprefix("preset "): a for a in result.alternatives if a.label.startswith("preset ")}
    fitting = [a for a in pre.values() if a.fits]
    best = min(fitting, key=lambda a: a.time_s) if fitting else None
    return {
        "model": name,
        "layers": layers,
        "d_model": d,
        "d_ff": f,
        "params": sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(params)),
        "mesh": mesh,
        "budget": budget,
        "planning_s_median": statistics.median(times),
        "planning_s_all": times,
        "planning_cpu_s_median": statistics.median(cpu),
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


def large_model(repeats: int) -> dict:
    """The 48-layer, 8192-wide transformer on 2048 devices (data=256 x model=8), planned from shapes (predictions)."""
    return bench_model(
        "48 x 8192 on 2048 devices", 48, 8192, 32768, 32768, 2048, 2048, 64, {"data": 256, "model": 8}, "80GiB", repeats
    )


def heuristic_gap(trials: int, seed: int = 0) -> dict:
    """Coordinate descent vs exhaustive search on random 1-3 layer MLPs, with and without budgets."""

    make = pm.mlp_step  # the tests' MLP (tests/planner_models.py)

    rng = random.Random(seed)
    gaps, cd_evals, ex_evals, cases = [], [], [], []
    for _ in range(trials):
        n = rng.choice([1, 2, 2, 3])
        dims = [rng.choice([16, 64, 256, 1024]) for _ in range(n + 1)]
        b = rng.choice([8, 64, 256, 4096])
        mesh = rng.choice([{"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8}, {"data": 2, "model": 2}])
        obj = rng.choice(list(pl.OBJECTIVES))
        params = {f"w{i}": jax.ShapeDtypeStruct((dims[i], dims[i + 1]), jnp.float32) for i in range(n)}
        x = jax.ShapeDtypeStruct((b, dims[0]), jnp.float32)
        # the dp preset's memory does not depend on the budget: cost only the starts (dp, fsdp)
        starts = pl.plan(
            make(n),
            params,
            x,
            mesh=mesh,
            profile="h100",
            objective=obj,
            search=pl.SearchOptions(exhaustive_limit=0, max_evaluations=1),
        )
        dp = next(a for a in starts.alternatives if a.label == "preset dp")
        frac = rng.choice([None, 0.5, 0.9])
        budget = None if frac is None else int(frac * dp.memory_bytes)
        kw = dict(mesh=mesh, profile="h100", objective=obj, memory_budget=budget)
        ex = pl.plan(make(n), params, x, search=pl.SearchOptions(exhaustive_limit=10**6), **kw)
        cd = pl.plan(make(n), params, x, search=pl.SearchOptions(exhaustive_limit=0), **kw)
        key = {"training": "time_s", "inference": "time_s", "memory": "memory_bytes", "communication": "comm_bytes"}
        what = key[obj] if ex.fits else "memory_bytes"  # nothing fits: both return the least memory
        a, c = getattr(ex, what), getattr(cd, what)
        gaps.append((c / a - 1) if a else 0.0)
        cd_evals.append(cd.evaluated)
        ex_evals.append(ex.evaluated)
        cases.append(
            {"dims": dims, "batch": b, "mesh": mesh, "objective": obj, "budget": budget, "space": ex.space}
            | {"gap": gaps[-1], "descent_evaluated": cd.evaluated}
        )
    return {
        "trials": trials,
        "optimal": sum(g <= 1e-9 for g in gaps),
        "max_gap": max(gaps),
        "mean_cd_evaluations": statistics.mean(cd_evals),
        "mean_exhaustive_evaluations": statistics.mean(ex_evals),
        "cases": cases,
    }


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def planning_time(name, build, profile, repeats, mesh=None):
    """Planning time of ``einshard.plan`` on a corpus model (shapes only, as the CLI does)."""
    step, params, batch, presets = build()
    mesh = mesh or {"data": 4, "model": 2}
    times, cpu, r = [], [], None
    for _ in range(repeats):
        jax.clear_caches()
        t, c = time.perf_counter(), time.process_time()
        r = einshard.plan(step, _abstract(params), _abstract(batch), mesh=mesh, profile=profile)
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    assert r is not None
    return {
        "model": name,
        "profile": profile,
        "planning_s_median": statistics.median(times),
        "planning_s_all": times,
        "planning_cpu_s_median": statistics.median(cpu),
        "load_average": os.getloadavg()[0],
        "evaluated": r.evaluated,
        "space": r.space,
        "method": r.method,
        "strategies": r.strategies,
    }


def measured(name, build, steps):
    """The plan and every preset compiled and run on a (4, 2) mesh of simulated CPU devices."""
    step, params, batch, presets = build()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    r = einshard.plan(step, _abstract(params), _abstract(batch), mesh=mesh, profile="cpu")
    layouts = {"plan": (r.rules, pm.data_rule(r))} | presets
    runs = {}
    for label, (prules, brule) in layouts.items():
        xla = pm.compiled_costs(step, params, batch, prules, brule, mesh)
        sh_p, sh_b = xla["shardings"]
        args = (jax.device_put(params, sh_p), jax.device_put(batch, sh_b))
        jax.block_until_ready(xla["jitted"](*args))  # warm
        runs[label] = {"xla": xla, "args": args, "times": []}
    labels = list(runs)
    for i in range(steps):  # round-robin, the order reversed every other round: drift and load hit all alike
        for label in labels if i % 2 == 0 else labels[::-1]:
            run = runs[label]
            t = time.perf_counter()
            jax.block_until_ready(run["xla"]["jitted"](*run["args"]))
            run["times"].append(time.perf_counter() - t)
    out = {}
    for label, run in runs.items():
        ts = sorted(run["times"])
        out[label] = {
            "step_s_median": statistics.median(ts),
            "step_s_q1": ts[len(ts) // 4],
            "step_s_q3": ts[(3 * len(ts)) // 4],
            "xla_comm_bytes": run["xla"]["comm_bytes"],
            "xla_collectives": run["xla"]["collectives"],
            "xla_flops": run["xla"]["flops"],
        }
    best = min((k for k in out if k != "plan"), key=lambda k: out[k]["step_s_median"])
    dominated = [
        k
        for k in out
        if k != "plan"
        and out[k]["xla_flops"] <= out["plan"]["xla_flops"]
        and out[k]["xla_comm_bytes"] <= out["plan"]["xla_comm_bytes"]
        and (out[k]["xla_flops"] < out["plan"]["xla_flops"] or out[k]["xla_comm_bytes"] < out["plan"]["xla_comm_bytes"])
    ]
    return {
        "model": name,
        "load_average": os.getloadavg(),
        "plan_strategies": r.strategies,
        "layouts": out,
        "best_preset": best,
        "plan_vs_best_preset": out["plan"]["step_s_median"] / out[best]["step_s_median"],
        "presets_beating_plan_on_flops_and_bytes": dominated,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gap-trials", type=int, default=10)
    ap.add_argument("--markdown-only", action="store_true", help="rewrite planner.md from planner.json")
    ap.add_argument(
        "--only",
        choices=["gap", "large"],
        help="re-measure one section only and merge it into the existing planner.json (the others kept as measured)",
    )
    args = ap.parse_args()
    if args.markdown_only:
        write_markdown(json.loads((RESULTS / "planner.json").read_text()))
        return
    if args.only:
        result = json.loads((RESULTS / "planner.json").read_text())
        if args.only == "gap":
            result["heuristic_gap"] = heuristic_gap(args.gap_trials) | {"jax": jax.__version__}
        else:
            result["large"] = large_model(args.repeats) | {"jax": jax.__version__}
        (RESULTS / "planner.json").write_text(json.dumps(result, indent=2) + "\n")
        write_markdown(result)
        return
    planning = [
        planning_time("demo transformer (einshard plan --model transformer)", cli_transformer, "h100", args.repeats),
        planning_time("demo transformer, 2 layers d=32", pm.demo_transformer, "cpu", args.repeats),
        planning_time("Flax NNX transformer, 2 layers d=32", pm.nnx_transformer, "cpu", args.repeats),
        planning_time("Equinox transformer, 2 layers d=32", pm.eqx_transformer, "cpu", args.repeats),
    ]
    large = large_model(1)
    reality = [measured("demo transformer", pm.demo_transformer, args.steps)]
    reality.append(measured("Flax NNX transformer", pm.nnx_transformer, args.steps))
    reality.append(measured("Equinox transformer", pm.eqx_transformer, args.steps))
    gap = heuristic_gap(args.gap_trials)
    result = {
        "jax": jax.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "planning": planning,
        "large": large,
        "measured": reality,
        "heuristic_gap": gap,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planner.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result)


def write_markdown(result: dict) -> None:
    """benchmarks/results/planner.md from the results (``--markdown-only`` rewrites it from planner.json)."""
    planning, large, reality, gap = result["planning"], result["large"], result["measured"], result["heuristic_gap"]
    lines = [
        "Planning time (median, tracing included, this 2-core machine shared with other jobs):",
        "",
        "| model | profile | planning (wall) | planning (CPU time of the process) | assignments costed |",
        "|---|---|---|---|---|",
    ]

    def cpu(m: dict) -> str:
        return f"{m['planning_cpu_s_median']:.1f} s" if "planning_cpu_s_median" in m else "–"

    for m in planning:
        lines.append(
            f"| {m['model']} | {m['profile']} | {m['planning_s_median']:.1f} s | {cpu(m)} "
            f"| {m['evaluated']} of {m['space']:.3g} ({m['method']}) |"
        )
    versus = (
        f"vs best preset {large['best_preset']}, {large['speedup_vs_best_preset']:.2f}×"
        if large["best_preset"] is not None
        else "no preset fits the budget"
    )
    fits = "" if large["plan_fits"] else ", over the budget"
    lines.append(
        f"| {large['model']} (predicted: plan {large['plan_time_s'] * 1e3:.0f} ms{fits}, {versus}) | h100 "
        f"| {large['planning_s_median']:.1f} s | {cpu(large)} | {large['evaluated']} of {large['space']:.3g} |"
    )
    loads = [m["load_average"] for m in planning if "load_average" in m]
    if loads:
        lines += ["", f"Load average (1 min) while planning: {min(loads):.1f}–{max(loads):.1f} on 2 cores."]
    lines += [
        "",
        "Measured on a (4, 2) mesh of simulated CPU devices (one process, layouts interleaved, the order reversed "
        "every other round; XLA's own counts, per step: a collective inside a while loop, the demo's `lax.scan` "
        "over layers, counted once per iteration; FLOPs are `cost_analysis()`'s):",
        "",
        "| model | layout | step (median) | vs best preset | XLA bytes sent/device | XLA collectives | XLA MFLOP/device |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in reality:
        best = m["layouts"][m["best_preset"]]["step_s_median"]
        for label, v in m["layouts"].items():
            name = "**plan**" if label == "plan" else label
            lines.append(
                f"| {m['model']} | {name} | {v['step_s_median'] * 1e3:.2f} ms "
                f"(IQR {v['step_s_q1'] * 1e3:.2f}–{v['step_s_q3'] * 1e3:.2f}) | {v['step_s_median'] / best:.2f}× "
                f"| {v['xla_comm_bytes'] / 1e3:.0f} kB | {v['xla_collectives']} | {v['xla_flops'] / 1e6:.1f} |"
            )
    lines.append("")
    for m in reality:
        dom = m["presets_beating_plan_on_flops_and_bytes"]
        plan_bytes = m["layouts"]["plan"]["xla_comm_bytes"]
        best_bytes = m["layouts"][m["best_preset"]]["xla_comm_bytes"]
        load = f" (load average {m['load_average'][0]:.1f})" if "load_average" in m else ""
        lines.append(
            f"- {m['model']}: plan = {', '.join(f'{k}: {v}' for k, v in m['plan_strategies'].items() if v != 'replicated')}; "
            f"{m['plan_vs_best_preset']:.2f}× the best preset's ({m['best_preset']}) measured step{load}; "
            f"XLA bytes {plan_bytes / 1e3:.0f} kB vs its {best_bytes / 1e3:.0f} kB; "
            + (
                f"beaten on both FLOPs and bytes by {', '.join(dom)}"
                if dom
                else "no preset beats it on both FLOPs and bytes"
            )
        )
    lines.append("")
    lines.append(
        f"Descent vs exhaustive on {gap['trials']} random 1–3 layer MLPs (with and without budgets): optimal in "
        f"{gap['optimal']}, max gap {gap['max_gap'] * 100:.2f}%, {gap['mean_cd_evaluations']:.0f} vs "
        f"{gap['mean_exhaustive_evaluations']:.0f} assignments costed on average"
        + (_worst(gap) if gap.get("cases") and gap["max_gap"] > 1e-9 else "")
        + "."
    )
    lines.append("")
    lines.append(
        f"jax {result['jax']}, Python {result['python']}, {result['machine']}, 2 CPU cores shared by "
        "several jobs (8 simulated devices on them: measured times are relative, within one run)."
    )
    (RESULTS / "planner.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _worst(gap: dict) -> str:
    w = max(gap["cases"], key=lambda c: c["gap"])
    mesh = "×".join(f"{k} {v}" for k, v in w["mesh"].items())
    budget = "no budget" if w["budget"] is None else f"budget {w['budget'] / 2**20:.2f} MiB"
    return (
        f" (the worst: widths {w['dims']}, batch {w['batch']}, mesh {mesh}, objective {w['objective']}, {budget}; "
        f"{w['descent_evaluated']} of {w['space']} assignments costed)"
    )


def cli_transformer():
    """What ``einshard plan --model transformer`` plans: the demo's default sizes, batch 16."""
    from einshard_apps.models import transformer as tm

    cfg = tm.Config()
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tm.init(cfg, 0))
    batch = jax.ShapeDtypeStruct((16, cfg.seq + 1), jnp.int32)
    return jax.value_and_grad(tm.loss_fn), params, batch, {}


if __name__ == "__main__":
    main()
