"""The planner's predicted step time against the measured one, per layout, on the planned external families.

    python benchmarks/plan_prediction.py [--rounds 60] [--only keras_vit,hk_stack] [--out PATH] [--flops-only]

For each family of ``external_corpus.planning.PLANNED``: the plan (made with the hand layouts as presets, so each
hand layout is priced by the same model: ``plan.alternatives``' ``preset hand_*``), every hand layout, and the
everything-replicated reference, compiled with ``jax.jit`` on the Auto (4, 2) mesh of 8 simulated CPU devices, run
in interleaved rounds (every layout once per round, rotated); per layout the median step time, its split-half
noise (odd against even rounds), the planner's predicted time (and its compute part) and XLA's collectives
(pieces of merged ops counted each), bytes and FLOPs per device.  The load average at the start and the end of
each family is recorded: on a shared 2-core host the absolute times move with it, compare layouts within a family.

The ``cpu`` profile is ``cost.cpu_profile()``, which prices the elementwise work on the activations the forward
products write, each merged all-reduce's piece paying its latency and a collective by its group's peers (the default
since session 19: ``small_ops=True``).  ``--flops-only`` plans and prices with ``cost.cpu_profile(small_ops=False)``,
the default of sessions 1-18 (FLOPs and ring hops only).  benchmarks/results/plan_prediction_small_ops.json is
session 18's ``--small-ops`` run (``--rounds 200``, load 19-22, 2026-11-27 11:04-11:16 UTC): each family planned the
replicated step, measured 0.96x (kh_llama, against tp), 1.09x (keras_vit, against dp; split-half noise 10% and 4%),
0.84x (hk_stack, tp), 0.82x (kh_t5, dp_tp; noise 23%) the fastest hand layout; session 17's (``--rounds 300``, load
8-12) 0.89/0.95/0.80/0.88x; keras_vit's replicated step and its fastest hand layouts trade places from run to run
(1.05-1.35x in two other runs).  benchmarks/results/plan_prediction.json is this profile's run (session 19: the
results file's ``rounds``, ``load_start``/``load_end`` and ``when``).

Writes benchmarks/results/plan_prediction.json (or ``--out``).
"""

from __future__ import annotations

import argparse
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
from external_corpus import specs_for  # noqa: E402
from external_corpus.families import FAMILIES  # noqa: E402
from external_corpus.planning import (  # noqa: E402
    PLANNED,
    _exact_rules,
    compiled,
    hand_presets,
    layouts,
    plan_for,
    same_programs,
)

OUT = ROOT / "benchmarks" / "results" / "plan_prediction.json"


def predicted_and_measured(name: str, rounds: int) -> dict[str, Any]:
    fam = FAMILIES[name]()
    presets = hand_presets(fam)
    replicated = jax.tree.map(_unsplit, specs_for(fam, "dp"))
    presets["hand_replicated"] = (_exact_rules(replicated[0]), [_exact_rules(replicated[1])])
    plan = plan_for(fam, presets=presets)
    predicted = {
        a.label.removeprefix("preset hand_"): (a.time_s, a.compute_s)
        for a in plan.alternatives
        if a.label.startswith("preset hand_")
    }
    predicted["plan"] = (plan.time_s, plan.report.flops / plan.report.profile.flops)
    candidates = layouts(fam, plan)
    candidates["replicated"] = replicated
    costs = {label: compiled(fam, exprs) for label, exprs in candidates.items()}
    same = same_programs(costs)
    runs = {}
    for label, c in costs.items():
        if same[label] == label:
            psh, bsh = c["shardings"]
            args = (jax.device_put(fam.params, psh), jax.device_put(fam.batch, bsh))
            jax.block_until_ready(c["jitted"](*args))  # warm
            runs[label] = (c["jitted"], args)
    load_start = os.getloadavg()
    samples: dict[str, list[float]] = {label: [] for label in runs}
    labels = list(runs)
    for r in range(rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            fn, args = runs[label]
            t = time.perf_counter()
            jax.block_until_ready(fn(*args))
            samples[label].append(time.perf_counter() - t)
    rows = {
        label: {
            "measured_s": statistics.median(samples[same[label]]),
            "noise": split_half_noise(samples[same[label]]),
            "same_program_as": same[label],
            "predicted_s": predicted[label][0],
            "predicted_compute_s": predicted[label][1],
            "xla_collectives": costs[label]["collectives"],
            "xla_comm_bytes": costs[label]["comm_bytes"],
            "xla_flops": costs[label]["flops"],
        }
        for label in costs
    }
    return {
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "rounds": rounds,
        # the planner's profile (its combined_latency, the host's shared FLOP/s): the one pricing the walk's collectives
        "profile": repr(plan.report.profile.pricing()),
        "plan_strategies": plan.strategies,
        "layouts": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--only", default="", help="comma-separated families (default: all of PLANNED)")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument(
        "--flops-only", action="store_true", help="plan with cost.cpu_profile(small_ops=False), sessions 1-18's default"
    )
    a = parser.parse_args()
    if a.flops_only:
        from einshard._src.analysis import cost

        # planning.plan_for plans with the default profile (the tests' call): the cpu entry, swapped for the run
        cost.PROFILES["cpu"] = cost.cpu_profile(small_ops=False)
    out = Path(a.out)
    result: dict[str, Any] = json.loads(out.read_text()) if out.exists() and a.only else {}
    result["jax"] = jax.__version__
    result["when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    result.setdefault("families", {})
    for name in a.only.split(",") if a.only else PLANNED:
        row = predicted_and_measured(name, a.rounds)
        result["families"][name] = row
        for label, c in row["layouts"].items():
            print(
                f"{name:10s} {label:11s} measured {c['measured_s'] * 1e3:7.2f} ms ±{c['noise']:.0%}  "
                f"predicted {c['predicted_s'] * 1e3:7.3f} ms  collectives {c['xla_collectives']:4d}  "
                f"MFLOP {c['xla_flops'] / 1e6:.2f}  (= {c['same_program_as']})",
                flush=True,
            )
        out.write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
