"""The external corpus (tests/external_corpus): the planner against hand layouts, and explain's / plan's cost.

1. **Step time** on a (4, 2) mesh of this machine's simulated CPU devices, for the families the planner is checked
   on (``external_corpus.planning.PLANNED``): the plan and each hand layout (dp, tp, dp_tp, fsdp...) compiled with
   ``jax.jit`` (gradients out like the parameters), run in interleaved rounds (each round runs every layout once,
   in a rotated order, so drift hits all alike); medians, and ratios to the ``dp`` layout measured in the same run
   and to the fastest hand layout.  XLA's bytes and FLOPs per device with them.
2. **What the analysis costs**, on every family (dp_tp layout, the gradient step): explain's trace + walk and
   ``einshard.plan``'s time, as ratios to ``lower + compile`` of the same step measured in the same run.

Writes benchmarks/results/external.json.

    python benchmarks/bench_external.py [--rounds 40] [--repeats 3] [--only kh_llama,hk_stack] [--skip-analysis]
    python benchmarks/bench_external.py --scale large [--rounds 20] [--max-rounds 80] [--only hk_stack]

``--scale large`` measures the families' planning size (``external_corpus.families.LARGE``: a step that replicated
is slow enough that the plan must split): the plan, the plan under a memory budget that replicated parameters
exceed (``plan_budget``), every hand layout (with ``dp_all`` / ``fsdp_all`` over both mesh axes) and the
everything-replicated reference; writes benchmarks/results/external_large.json/.md and docs/planner.md's block.

``--only`` re-measures the named families' step times and keeps the other rows of external.json (each family is
minutes of planning and compiling on a shared 2-core machine).  The noise of a median is reported as the
split-half spread: the medians of the odd and the even rounds, |a - b| / median (a drift or a burst of load from
another process shows there, not as a difference between layouts, since every round runs every layout).
Layouts that XLA compiles to the same program (the same HLO, bar the module's name and source metadata: the plan
choosing ``dp_all``'s shardings) are run once and shown as one row, ``dp_all = plan``; with ``--max-rounds`` the
rounds go on, ``--rounds`` at a time, while a plan's ratio to the fastest hand layout is within the split-half
noise, and each family's note says whether the difference it reports is beyond that noise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import jax  # noqa: E402
from external_corpus import specs_for  # noqa: E402
from external_corpus.compare import mesh_of  # noqa: E402
from external_corpus.families import FAMILIES, LARGE  # noqa: E402
from external_corpus.planning import (  # noqa: E402
    PLANNED,
    compiled,
    hand_layouts_that_fit,
    layouts,
    plan_for,
    same_programs,
    step_of,
    tight_budget,
    worse_than_hand,
)

import einshard  # noqa: E402
from einshard._src.analysis.program import trace  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "external.json"
LARGE_OUT = ROOT / "benchmarks" / "results" / "external_large.json"
LARGE_TABLE = ROOT / "benchmarks" / "results" / "external_large.md"
PLANNER_DOC = ROOT / "docs" / "planner.md"
LARGE_START, LARGE_END = (
    "<!-- planner-large-bench: start (benchmarks/bench_external.py --scale large) -->",
    "<!-- planner-large-bench: end -->",
)
TABLE = ROOT / "benchmarks" / "results" / "external.md"
DOC = ROOT / "docs" / "analysis.md"
START, END = (
    "<!-- external-corpus-bench: start (benchmarks/bench_external.py) -->",
    "<!-- external-corpus-bench: end -->",
)


def interleaved_samples(
    runs: dict[str, tuple[Any, Any]], rounds: int, max_rounds: int, same: dict[str, str], fitting: tuple[str, ...] = ()
) -> dict[str, list[float]]:
    """Step times of every layout in interleaved rounds (each round runs every layout once, in a rotated order):
    ``rounds`` at least, then more, ``rounds`` at a time up to ``max_rounds``, while a difference the table
    claims (a plan against the fastest hand layout) is within the split-half noise of either median."""
    samples: dict[str, list[float]] = {label: [] for label in runs}
    labels = list(runs)
    r = 0
    while True:
        for _ in range(rounds):
            for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
                fn, args = runs[label]
                t = time.perf_counter()
                jax.block_until_ready(fn(*args))
                samples[label].append(time.perf_counter() - t)
            r += 1
        unresolved = unresolved_claims({k: samples[same[k]] for k in same}, same, fitting)
        if not unresolved or r + rounds > max_rounds:
            return samples
        print(f"  {r} rounds: within the noise: {', '.join(unresolved)}; measuring more", flush=True)


def unresolved_claims(
    samples: dict[str, list[float]], same: dict[str, str], fitting: tuple[str, ...] = ()
) -> list[str]:
    """The plans whose ratio to the fastest hand layout (for ``plan_budget``: of those that fit its budget,
    ``fitting``) is within the split-half noise of the two medians (a plan that is a hand layout's program
    claims nothing)."""
    med = {k: statistics.median(v) for k, v in samples.items()}
    hand = [k for k in med if k not in NOT_HAND]
    out = []
    for label in ("plan", "plan_budget"):
        if label not in med or same[label] != label:
            continue
        among = [k for k in hand if k in fitting] if label == "plan_budget" and fitting else hand
        best = min(among, key=med.__getitem__)
        difference = abs(med[label] / med[best] - 1)
        noise = max(split_half_noise(samples[label]), split_half_noise(samples[best]))
        if difference <= noise:
            out.append(f"{label} vs {best} ({difference:.0%} at ±{noise:.0%})")
    return out


def step_times(name: str, rounds: int, scale: str = "tiny", max_rounds: int | None = None) -> dict[str, Any]:
    max_rounds = max_rounds or rounds
    fam = (FAMILIES if scale == "tiny" else LARGE)[name]()
    plan = plan_for(fam)
    candidates = layouts(fam, plan)
    # Every parameter and the batch replicated: no collective, every device computes the whole step.  Not a hand
    # layout anyone would write for a large model, but the reference that says whether a plan replicating
    # everything (what the cost model picks when collectives cost more than the FLOPs they save) is right here.
    candidates["replicated"] = jax.tree.map(_unsplit, candidates["dp"])
    budgeted: dict[str, Any] = {}
    if scale != "tiny":
        # Also planned under a memory budget that replicated parameters exceed: fsdp / tp are forced, and the
        # plan is compared with the hand layouts that fit the budget (by the planner's memory model).
        budget = tight_budget(fam)
        plan_b = plan_for(fam, memory_budget=budget)
        candidates["plan_budget"] = layouts(fam, plan_b)["plan"]
        budgeted = {
            "memory_budget": budget,
            "plan_budget_fits": plan_b.fits,
            "plan_budget_rules": plan_b.rules,
            "plan_budget_data_rules": list(plan_b.data_rules),
            "hand_layouts_that_fit": sorted(hand_layouts_that_fit(fam, budget)),
        }
    costs = {label: compiled(fam, exprs) for label, exprs in candidates.items()}
    # A layout XLA compiles to the same program as an earlier one (the plan choosing dp_all's shardings) is that
    # layout: run once, reported as one row ("dp_all = plan"), so that no difference between identical programs is
    # read as a difference between layouts.
    same = same_programs(costs)
    runs = {}
    for label, c in costs.items():
        if same[label] != label:
            continue
        psh, bsh = c["shardings"]
        args = (jax.device_put(fam.params, psh), jax.device_put(fam.batch, bsh))
        jax.block_until_ready(c["jitted"](*args))  # warm
        runs[label] = (c["jitted"], args)
    fits = tuple(budgeted.get("hand_layouts_that_fit", ()))
    samples = interleaved_samples(runs, rounds, max_rounds, same, fits)
    samples = {label: samples[same[label]] for label in costs}
    med = {label: statistics.median(s) for label, s in samples.items()}
    hand = [k for k in med if k not in NOT_HAND]
    best_label = min(hand, key=med.__getitem__)
    best_hand = med[best_label]
    fitting = [k for k in hand if k in budgeted.get("hand_layouts_that_fit", ())]
    if fitting:
        budgeted["best_fitting_hand"] = min(fitting, key=med.__getitem__)
        budgeted["plan_budget_to_best_fitting_hand"] = med["plan_budget"] / med[budgeted["best_fitting_hand"]]
        budgeted["xla_bytes_worse_than_fitting_hand"] = worse_than_hand(
            {"plan": costs["plan_budget"]} | {k: costs[k] for k in fitting}
        )
    return {
        "best_hand": best_label,
        "rounds": len(samples[best_label]),
        "resolved": unresolved_claims(samples, same, tuple(budgeted.get("hand_layouts_that_fit", ()))) == [],
        "plan_rules": plan.rules,
        "plan_data_rules": list(plan.data_rules),
        "plan_complete": plan.report.complete,
        "xla_bytes_worse_than_hand": worse_than_hand({k: costs[k] for k in costs if k not in NOT_HAND or k == "plan"}),
        **budgeted,
        "layouts": {
            label: {
                "median_s": med[label],
                "ratio_to_dp": med[label] / med["dp"],
                "ratio_to_best_hand": med[label] / best_hand,
                "noise": split_half_noise(samples[label]),
                "same_program_as": same[label],
                "xla_comm_bytes": costs[label]["comm_bytes"],
                "xla_collectives": costs[label]["collectives"],
                "xla_flops": costs[label]["flops"],
            }
            for label in costs
        },
    }


# Layouts in the step-time table that are not hand layouts: the plans and the everything-replicated reference.
NOT_HAND = ("plan", "plan_budget", "replicated")


def _unsplit(expr: str) -> str:
    """'b s -> b@data s' -> 'b s -> b s'."""
    lhs = expr.split("->")[0].strip()
    return f"{lhs} -> {lhs}"


def split_half_noise(samples: list[float]) -> float:
    """|median(odd rounds) - median(even rounds)| / median: how far the median moves with the rounds sampled."""
    return abs(statistics.median(samples[0::2]) - statistics.median(samples[1::2])) / statistics.median(samples)


def _timed(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def analysis_cost(name: str, repeats: int) -> dict[str, Any]:
    fam = FAMILIES[name]()
    mesh = mesh_of("auto")
    pexpr, bexpr = specs_for(fam, "dp_tp")
    place = lambda e, a: einshard.sharding(e, a.shape, mesh=mesh)  # noqa: E731
    psh, bsh = jax.tree.map(place, pexpr, fam.params), jax.tree.map(place, bexpr, fam.batch)
    step = step_of(fam)
    out_specs = [jax.sharding.PartitionSpec()] + [s.spec for s in jax.tree.leaves(psh)]

    def compile_() -> None:
        # a fresh jit each time: lower + compile, not the cache
        jax.jit(lambda p, b: step(p, b), in_shardings=(psh, bsh)).lower(fam.params, fam.batch).compile()

    def explain_() -> None:
        trace(step, fam.params, fam.batch, mesh=mesh).report((pexpr, bexpr), out_specs)

    row: dict[str, Any] = {"compile_s": _timed(compile_, repeats)}
    for label, fn in (("explain_s", explain_), ("plan_s", lambda: plan_for(fam))):
        try:
            row[label] = _timed(fn, repeats)
            row[label.replace("_s", "_to_compile")] = row[label] / row["compile_s"]
        except Exception as e:  # noqa: BLE001 -- recorded: explain raising is one of the corpus's findings
            row[label.replace("_s", "_error")] = f"{type(e).__name__}: {e}"[:300]
    return row


def table_rows(row: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(row label, numbers) per distinct compiled program: layouts XLA compiled alike share one row, named
    ``dp_all = plan`` (rows measured before programs were compared have no ``same_program_as``: one row each)."""
    layouts = row["layouts"]
    names: dict[str, list[str]] = {}
    for label, c in layouts.items():
        names.setdefault(c.get("same_program_as", label), []).append(label)
    return [(" = ".join(alike), layouts[first]) for first, alike in names.items()]


def plan_against_hand(row: dict[str, Any], plan: str = "plan") -> str:
    """What a row says of a plan against the fastest hand layout: the hand layout it is, or the ratio and whether
    it is beyond the split-half noise of the two medians."""
    c, best = row["layouts"][plan], row["layouts"][row["best_hand"]]
    if c.get("same_program_as", plan) != plan:
        return f"the plan compiles to {c['same_program_as']}'s program"
    noise = max(c["noise"], best["noise"])
    ratio = c["ratio_to_best_hand"]
    within = "within" if abs(ratio - 1) <= noise else "beyond"
    return f"{ratio:.2f}× ({within} the noise, ±{noise:.0%})"


def summary(result: dict[str, Any]) -> str:
    """The docs' generated block: step-time ratios and the analysis' cost, from external.json."""
    lines = [START, f"Measured on {result['machine']} (jax {result['jax']}).", ""]
    lines += [
        "| family | layout | XLA bytes/device | XLA collectives | XLA MFLOP/device | median step | ± noise | "
        "vs best hand |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in result["step_time"].items():
        for k, c in table_rows(row):
            noise = f"{c['noise'] * 100:.0f}%" if "noise" in c else "–"
            lines.append(
                f"| {name} | {k} | {c['xla_comm_bytes'] / 1e3:.0f} kB | {c['xla_collectives']} | "
                f"{c['xla_flops'] / 1e6:.2f} | {c['median_s'] * 1e3:.2f} ms | {noise} | {c['ratio_to_best_hand']:.2f}× |"
            )
    lines += [
        "",
        "Step time: the median of interleaved rounds; ± noise: the split-half spread of that median (odd against "
        "even rounds); vs best hand: the ratio to the fastest hand layout's median. XLA's numbers are from the "
        "compiled step (`.compile().as_text()`, `cost_analysis()`). explain's trace + walk and plan's time as "
        "ratios to lower + compile of the same step"
        + (f" ({result['analysis_cost_note']})" if result.get("analysis_cost_note") else "")
        + ":",
        "",
        "| family | explain / compile | plan / compile |",
        "|---|---|---|",
    ]
    for name, row in result["analysis_cost"].items():
        ex = f"{row['explain_to_compile']:.2f}" if "explain_to_compile" in row else "raised"
        pl = f"{row['plan_to_compile']:.1f}" if "plan_to_compile" in row else "raised"
        lines.append(f"| {name} | {ex} | {pl} |")
    lines.append(END)
    return "\n".join(lines)


def write_doc(text: str) -> None:
    """The block in docs/analysis.md, and benchmarks/results/external.md (docs/benchmarks.md's copy of it, by
    benchmarks/update_docs.py)."""
    doc = DOC.read_text()
    head, rest = doc.split(START, 1)
    DOC.write_text(head + text + rest.split(END, 1)[1])
    body = text.removeprefix(START).removesuffix(END).strip()
    TABLE.write_text("# The planner against hand layouts on the external corpus\n\n" + body + "\n")


def large_summary(result: dict[str, Any]) -> str:
    """docs/planner.md's generated block: the large families' step times, with and without a memory budget."""
    lines = [LARGE_START, f"Measured on {result['machine']} (jax {result['jax']}); {result['load']}.", ""]
    lines += [
        "| family | layout | XLA bytes/device | XLA collectives | XLA MFLOP/device | median step | ± noise | "
        "vs best hand |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, row in result["step_time"].items():
        for k, c in table_rows(row):
            lines.append(
                f"| {name} | {k} | {c['xla_comm_bytes'] / 1e3:.0f} kB | {c['xla_collectives']} | "
                f"{c['xla_flops'] / 1e6:.0f} | {c['median_s'] * 1e3:.1f} ms | {c['noise'] * 100:.0f}% | "
                f"{c['ratio_to_best_hand']:.2f}× |"
            )
        beaten = row["xla_bytes_worse_than_hand"]
        notes.append(
            f"- {name}: {row['rounds']} rounds; the plan vs the fastest hand layout ({row['best_hand']}): "
            f"{plan_against_hand(row)}; hand layouts sending >10% fewer XLA bytes at no "
            f"more FLOPs: {', '.join(beaten) or 'none'}."
        )
        if "memory_budget" in row:
            fit = ", ".join(row["hand_layouts_that_fit"]) or "none"
            line = (
                f"- {name} under a budget of {row['memory_budget'] / 2**20:.1f} MiB/device (halfway between the "
                f"planner's fsdp and dp presets; hand layouts that fit it: {fit}): plan_budget"
            )
            if "best_fitting_hand" in row:
                worse = ", ".join(row["xla_bytes_worse_than_fitting_hand"]) or "none"
                alike = row["layouts"]["plan_budget"].get("same_program_as", "plan_budget")
                if alike != "plan_budget":
                    versus = f"compiles to {alike}'s program"
                else:
                    noise = max(row["layouts"][k]["noise"] for k in ("plan_budget", row["best_fitting_hand"]))
                    ratio = row["plan_budget_to_best_fitting_hand"]
                    versus = (
                        f"{ratio:.2f}× ({'within' if abs(ratio - 1) <= noise else 'beyond'} the noise, ±{noise:.0%})"
                    )
                line += (
                    f" {versus} against the fastest of them ({row['best_fitting_hand']}); fitting hand layouts "
                    f"sending >10% fewer XLA bytes at no more FLOPs: {worse}."
                )
            notes.append(line)
    lines += ["", *notes, "", LARGE_END]
    return "\n".join(lines)


def write_large_doc(text: str) -> None:
    doc = PLANNER_DOC.read_text()
    head, rest = doc.split(LARGE_START, 1)
    PLANNER_DOC.write_text(head + text + rest.split(LARGE_END, 1)[1])
    body = text.removeprefix(LARGE_START).removesuffix(LARGE_END).strip()
    LARGE_TABLE.write_text("# The planner against hand layouts on the large external families\n\n" + body + "\n")


def main_large(a: argparse.Namespace) -> None:
    """``--scale large``: step times of the large families (external_large.json), the docs' block in planner.md."""
    if a.doc_only:
        write_large_doc(large_summary(json.loads(LARGE_OUT.read_text())))
        return
    old: dict[str, Any] = json.loads(LARGE_OUT.read_text()) if LARGE_OUT.exists() and a.only else {}
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    result: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, 8 simulated CPU devices, mesh (data=4, model=2)",
        "jax": jax.__version__,
        "load": f"load average {load} at the start",
        "step_time": {k: v for k, v in old.get("step_time", {}).items() if k in LARGE},
    }
    for name in a.only.split(",") if a.only else LARGE:
        result["step_time"][name] = step_times(name, a.rounds, scale="large", max_rounds=a.max_rounds)
        print(name, {k: round(v["ratio_to_best_hand"], 2) for k, v in result["step_time"][name]["layouts"].items()})
        LARGE_OUT.write_text(json.dumps(result, indent=1, default=str))
    write_large_doc(large_summary(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=0,
        help="measure more rounds (--rounds at a time, up to this many) while a plan's difference to the fastest "
        "hand layout is within the split-half noise (default: --rounds, no more)",
    )
    parser.add_argument("--doc-only", action="store_true", help="regenerate the docs block from external.json")
    parser.add_argument("--only", default="", help="comma-separated families: re-measure their step times only")
    parser.add_argument("--skip-analysis", action="store_true", help="keep the analysis-cost rows of external.json")
    parser.add_argument(
        "--scale",
        choices=("tiny", "large"),
        default="tiny",
        help="large: the families' planning size (external_corpus.families.LARGE), step times only, also under a "
        "memory budget; writes external_large.json/.md and docs/planner.md's block",
    )
    a = parser.parse_args()
    if a.scale == "large":
        main_large(a)
        return
    if a.doc_only:
        write_doc(summary(json.loads(OUT.read_text())))
        return
    old: dict[str, Any] = json.loads(OUT.read_text()) if OUT.exists() and (a.only or a.skip_analysis) else {}
    result: dict[str, Any] = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores, 8 simulated CPU devices, mesh (data=4, model=2)",
        "jax": jax.__version__,
        "step_time": {k: v for k, v in old.get("step_time", {}).items() if k in PLANNED},
        "analysis_cost": old.get("analysis_cost", {}) if a.skip_analysis else {},
    }
    if a.skip_analysis:  # the docs say the analysis-cost table is not from this run
        result["analysis_cost_note"] = old.get("analysis_cost_note") or "measured in an earlier run than the step times"
    for name in a.only.split(",") if a.only else PLANNED:
        result["step_time"][name] = step_times(name, a.rounds, max_rounds=a.max_rounds)
        print(name, {k: round(v["ratio_to_best_hand"], 2) for k, v in result["step_time"][name]["layouts"].items()})
        OUT.write_text(json.dumps(result, indent=1, default=str))
    for name in () if a.skip_analysis else FAMILIES:
        result["analysis_cost"][name] = analysis_cost(name, a.repeats)
        print(name, result["analysis_cost"][name])
        OUT.write_text(json.dumps(result, indent=1, default=str))
    write_doc(summary(result))


if __name__ == "__main__":
    main()
