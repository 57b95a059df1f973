"""Which ``combined_latency`` the ``cpu`` profile's planner should use, by measured step time.

    python benchmarks/plan_latency_modes.py [--rounds 40] [--only demo_transformer,hk_stack] [--out PATH]

XLA:CPU runs each piece of a merged (tuple) all-reduce as a collective of its own (benchmarks/cpu_calibration.py):
``Profile.combined_latency = 'per_piece'`` prices that, ``'once'`` credits the merged op with one latency.  Which one
plans faster steps is measured here on the programs of the slow checks that judge the plan by XLA's bytes
(tests/test_planner_reality.py: the demo's, a Flax NNX and an Equinox transformer, batch 64;
tests/test_plan_hand_presets.py: the large ``hk_stack`` / ``kh_llama`` of the external corpus, with and without a
memory budget): the plan made under each mode (``plan_once``, ``plan_per_piece``; ``planb_*`` under the budget),
every hand layout of the program (the tests' presets) and the everything-replicated step are compiled on the Auto
(4, 2) mesh of 8 simulated CPU devices and run in interleaved rounds (every layout once per round, in a rotated
order); per layout the median step time, its split-half noise (odd against even rounds), XLA's bytes, collectives
(pieces of merged ops counted each) and FLOPs per device, and the plan's predicted time.  Layouts that XLA compiles
to the same program run once (``same``).  The load average at the start and the end of each program is recorded:
on a shared 2-core host the absolute times move with it, compare layouts within a program.

``--agreement FLOPS,...`` then prices the measured layouts of the three transformers again under each mode with the
profile's ``flops`` set to each value (the stored plans and presets, priced as ``plan(presets=)`` prices a preset)
and records the Kendall tau of the predicted order against the measured one: which mode ranks the layouts as they
ran, and whether that turns on the compute price.

Writes benchmarks/results/plan_latency_modes.json (or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
from bench_external import _unsplit, split_half_noise  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

import einshard  # noqa: E402
from einshard._src.analysis import cost  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "plan_latency_modes.json"
TINY = ("demo_transformer", "nnx_transformer", "eqx_transformer")
LARGE_FAMILIES = ("hk_stack", "kh_llama")
MODES = ("once", "per_piece")


def profile_with(mode: str) -> cost.Profile:
    return dataclasses.replace(cost.PROFILES["cpu"], combined_latency=mode)


def interleaved(runs: dict[str, tuple[Any, Any]], rounds: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {label: [] for label in runs}
    labels = list(runs)
    for r in range(rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            fn, args = runs[label]
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[label].append(time.perf_counter() - t)
    return samples


def measured(
    costs: dict[str, dict[str, Any]], params: Any, batch: Any, rounds: int, planned: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Run every distinct compiled program in interleaved rounds; one row per layout."""
    from external_corpus.planning import same_programs

    same = same_programs(costs)
    runs = {}
    for label, c in costs.items():
        if same[label] == label:
            psh, bsh = c["shardings"]
            args = (jax.device_put(params, psh), jax.device_put(batch, bsh))
            jax.block_until_ready(c["jitted"](*args))  # warm
            runs[label] = (c["jitted"], args)
    load_start = os.getloadavg()
    samples = interleaved(runs, rounds)
    rows = {
        label: {
            "median_s": statistics.median(samples[same[label]]),
            "noise": split_half_noise(samples[same[label]]),
            "same": same[label],
            "xla_comm_bytes": c["comm_bytes"],
            "xla_collectives": c["collectives"],
            "xla_flops": c["flops"],
            **planned.get(label, {}),
        }
        for label, c in costs.items()
    }
    return {"load_start": load_start, "load_end": os.getloadavg(), "rounds": rounds, "layouts": rows}


def tiny(model: str, rounds: int) -> dict[str, Any]:
    """A test_planner_reality program: its presets and the plan under each mode (planned on the Explicit mesh as
    the test does, compiled on the Auto one)."""
    import planner_models as pm
    from external_corpus.planning import same_program_key

    step, params, batch, presets = getattr(pm, model)()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    layouts = dict(presets)
    planned = {}
    for mode in MODES:
        t = time.process_time()
        r = einshard.plan(
            step, params, batch, mesh=jax.make_mesh((4, 2), ("data", "model")), profile=profile_with(mode)
        )
        planned[f"plan_{mode}"] = {
            "plan_cpu_s": time.process_time() - t,
            "predicted_s": r.time_s,
            "rules": r.rules,
            "data_rule": pm.data_rule(r),
        }
        layouts[f"plan_{mode}"] = (r.rules, pm.data_rule(r))
    layouts["replicated"] = ({".*": "... -> ..."}, "b s -> b s")
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (params, batch))
    costs = {}
    for label, (prules, brule) in layouts.items():
        c = pm.compiled_costs(step, params, batch, prules, brule, mesh)
        c["program"] = same_program_key(c["jitted"].lower(*abstract).compile().as_text())
        costs[label] = c
    return measured(costs, params, batch, rounds, planned)


def large(name: str, rounds: int) -> dict[str, Any]:
    """A test_plan_hand_presets family at its planning size: the plan under each mode, without and with the tests'
    memory budget (``planb_*``), every hand layout and the replicated step."""
    import external_corpus.planning as planning
    from external_corpus.families import LARGE

    fam = LARGE[name]()
    budget = planning.tight_budget(fam)
    layouts: dict[str, Any] = {}
    planned = {}
    saved = cost.PROFILES["cpu"]
    for mode in MODES:
        # planning.plan_for plans with the default profile (the tests' call): the cpu entry, swapped for the run
        cost.PROFILES["cpu"] = profile_with(mode)
        try:
            t = time.process_time()
            p = planning.plan_for(fam)
            planned[f"plan_{mode}"] = {"plan_cpu_s": time.process_time() - t, "predicted_s": p.time_s}
            layouts[f"plan_{mode}"] = planning.layouts(fam, p)["plan"]
            pb = planning.plan_for(fam, memory_budget=budget)
            planned[f"planb_{mode}"] = {"predicted_s": pb.time_s, "fits": pb.fits}
            layouts[f"planb_{mode}"] = planning.layouts(fam, pb)["plan"]
        finally:
            cost.PROFILES["cpu"] = saved
    for strategy in fam.rules:
        layouts[strategy] = planning.specs_for(fam, strategy)
    layouts["replicated"] = jax.tree.map(_unsplit, layouts["dp"])
    costs = {label: planning.compiled(fam, exprs) for label, exprs in layouts.items()}
    row = measured(costs, fam.params, fam.batch, rounds, planned)
    row["memory_budget"] = budget
    row["hand_layouts_that_fit"] = sorted(planning.hand_layouts_that_fit(fam, budget))
    return row


def kendall_tau(predicted: dict[str, float], measured: dict[str, float]) -> float:
    """(concordant - discordant) / (their sum) over the pairs of layouts: 1 the same order, -1 reversed."""
    labels = list(predicted)
    signs = [
        (predicted[a] - predicted[b]) * (measured[a] - measured[b])
        for i, a in enumerate(labels)
        for b in labels[i + 1 :]
    ]
    concordant, discordant = sum(x > 0 for x in signs), sum(x < 0 for x in signs)
    return (concordant - discordant) / max(1, concordant + discordant)


def agreement(model: str, row: dict[str, Any], flops: list[float]) -> dict[str, Any]:
    """Per mode and FLOP/s: each measured layout's predicted time and the order's Kendall tau against the medians."""
    import planner_models as pm

    step, params, batch, presets = getattr(pm, model)()
    layouts = row["layouts"]
    priced = dict(presets)
    for mode in MODES:
        priced[f"plan_{mode}"] = (layouts[f"plan_{mode}"]["rules"], layouts[f"plan_{mode}"]["data_rule"])
    priced["replicated"] = ({".*": "... -> ..."}, "b s -> b s")
    measured_s = {label: layouts[label]["median_s"] for label in priced}
    # One evaluation of the search: only the presets' prices are read.
    search = einshard.planner.SearchOptions(exhaustive_limit=0, max_evaluations=1)
    out = {}
    for mode in MODES:
        for f in flops:
            profile = dataclasses.replace(profile_with(mode), flops=f)
            r = einshard.plan(
                step,
                params,
                batch,
                mesh=jax.make_mesh((4, 2), ("data", "model")),
                profile=profile,
                presets=priced,
                search=search,
            )
            predicted = {
                a.label.removeprefix("preset "): a.time_s for a in r.alternatives if a.label.startswith("preset ")
            }
            out[f"{mode} flops={f:.0e}"] = {"kendall_tau": kendall_tau(predicted, measured_s), "predicted_s": predicted}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--only", default="", help="comma-separated programs (default: all)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--agreement", default="", help="comma-separated FLOP/s: rank the stored measurements' layouts (no new runs)"
    )
    a = parser.parse_args()
    if a.agreement:
        stored = json.loads(Path(a.out).read_text())
        for name in a.only.split(",") if a.only else TINY:
            row = stored["programs"][name]
            row["agreement"] = agreement(name, row, [float(x) for x in a.agreement.split(",")])
            print(name, {k: round(v["kendall_tau"], 2) for k, v in row["agreement"].items()}, flush=True)
            Path(a.out).write_text(json.dumps(stored, indent=1, default=str))
        return
    out = Path(a.out)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() and a.only else {}
    result["jax"] = jax.__version__
    result.setdefault("programs", {})
    for name in a.only.split(",") if a.only else TINY + LARGE_FAMILIES:
        row = tiny(name, a.rounds) if name in TINY else large(name, a.rounds)
        result["programs"][name] = row
        print(f"{name}: load {row['load_start'][0]:.1f} -> {row['load_end'][0]:.1f}, {a.rounds} rounds", flush=True)
        for label, c in row["layouts"].items():
            print(
                f"  {label:15s} {c['median_s'] * 1e3:9.2f} ms ±{c['noise']:4.0%}  bytes {c['xla_comm_bytes']:11.0f}  "
                f"collectives {c['xla_collectives']:4d}  MFLOP {c['xla_flops'] / 1e6:9.2f}  (= {c['same']})",
                flush=True,
            )
        out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
