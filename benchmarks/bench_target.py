"""Plan time vs depth, and plan + verify on a TPU target through the TPU compiler (issue 21).

1. **Depth**: ``einshard.plan`` (prediction only, ``verify=0``) of a llama-7b-shaped decoder (width 4096,
   bf16, remat) at 2..96 layers, unrolled (a Python loop over per-layer slices) and scanned, on a
   ``tpu:v5p:4x4x4`` target (64 chips, profile and mesh only: nothing compiles).  Wall time of one plan,
   tracing included, and the assignments costed.
2. **Target**: ``einshard plan --model llama-7b --target tpu:v5p:4x4x4 --budget 95GiB --verify`` (the default
   count: the 3 best candidates and the best preset), run as the CLI runs it (``einshard_apps.cli.main``):
   planning, then the TPU compiler (libtpu) on each distinct candidate, shapes only, concurrently.  Wall and
   CPU time of the whole command, peak RSS, the load average, and each compile's start and end (to show that
   they overlap).  Skipped, saying so, without libtpu.

Writes benchmarks/results/target.{json,md}.

    python benchmarks/bench_target.py [--depths 2,8,32,80,96] [--max-evaluations 160] [--only depth|target]
        [--verify K]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import pathlib
import platform
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from einshard.planner import SearchOptions, plan  # noqa: E402
from einshard.targets import libtpu_available  # noqa: E402
from einshard_apps.models import llama  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _plan_once(layers: int, unroll: bool, max_evaluations: int, seq: int, verify: int, budget: str | None) -> dict:
    cfg = llama.sized("llama-7b", layers=layers, unroll=unroll, seq=seq)
    params = llama.shapes(cfg)
    batch = jax.ShapeDtypeStruct((64, cfg.seq + 1), jnp.int32)
    fn = jax.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg))
    # The rows before left their plans' caches (reference cycles: ~1.4 million objects after an 80-layer plan) to the
    # cyclic collector; collected here, not in this row's timing, each row times its own plan as a fresh process
    # would (an 80-layer unrolled plan: 12.3 s CPU after an 80- and a 32-layer plan, 10.1 s after one and this).
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    result = plan(
        fn,
        params,
        batch,
        target="tpu:v5p:4x4x4",
        verify=verify,
        search=SearchOptions(max_evaluations=max_evaluations),
        memory_budget=budget,
    )
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    chosen = next((v for v in result.verification if v.chosen), None)
    return {
        "layers": layers,
        "unrolled": unroll,
        "wall_s": round(wall, 2),
        # This process's CPU time: on the shared 2-core machine the wall time mostly measures the other
        # sessions' load (load average 12 on 2 cores: wall 7x the CPU time); a quiet machine's wall is ~CPU.
        "cpu_s": round(cpu, 2),
        "evaluated": result.evaluated,
        "fits": result.fits,
        "memory_bytes": result.memory_bytes,
        "verified": [v.to_dict() for v in result.verification],
        "chosen_compiled_memory": chosen.compiled_memory if chosen else None,
        "chosen_fits_hbm": chosen.fits_hbm if chosen else None,
    }


def _plan_verify_cli(verify: int | None) -> dict:
    """The issue's command through the CLI's own entry point, timed; each TPU compile's interval recorded."""
    import contextlib
    import io
    import resource
    import threading

    import einshard._src.planner.verify as verify_module
    from einshard_apps.cli import main as cli

    real = verify_module.compile_and_read
    intervals: list[tuple[float, float]] = []
    lock = threading.Lock()

    def timed(lowered, profile):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return real(lowered, profile)
        finally:
            with lock:
                intervals.append((t0, time.perf_counter()))

    verify_module.compile_and_read = timed
    argv = ["plan", "--model", "llama-7b", "--target", "tpu:v5p:4x4x4", "--budget", "95GiB", "--verify"]
    argv += [] if verify is None else [str(verify)]
    load_before = os.getloadavg()
    start, cpu = time.perf_counter(), time.process_time()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli(argv)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    verify_module.compile_and_read = real
    text = out.getvalue()
    print(text)
    first = min((a for a, _ in intervals), default=start)
    return {
        "command": "einshard " + " ".join(argv),
        "exit_code": code,
        "wall_s": round(wall, 1),
        # all threads of this process, libtpu's compile threads included
        "cpu_s": round(cpu, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "load_before": [round(x, 1) for x in load_before],
        "load_after": [round(x, 1) for x in os.getloadavg()],
        "compile_workers": verify_module.compile_workers(),
        "compiles": [[round(a - first, 1), round(b - first, 1)] for a, b in sorted(intervals)],
        "planning_s": round(first - start, 1),
        "output": text,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--depths", default="2,8,32,80,96")
    ap.add_argument("--max-evaluations", type=int, default=160)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--only", choices=["depth", "target"], default=None)
    ap.add_argument("--verify", type=int, default=None, help="--verify K for the target run (default: the CLI's)")
    a = ap.parse_args()
    out: dict = {
        "machine": f"{platform.machine()} {os.cpu_count()} cores",
        "jax": jax.__version__,
        "depth": [],
        "target": None,
    }
    previous = json.loads((RESULTS / "target.json").read_text()) if (RESULTS / "target.json").exists() else {}
    if a.only == "depth":
        out["target"] = previous.get("target")  # kept: this run measured depth only
    elif a.only == "target":
        out["depth"], out["depth_settings"] = previous.get("depth", []), previous.get("depth_settings")
    if a.only in (None, "depth"):
        out["depth_settings"] = {"max_evaluations": a.max_evaluations, "seq": a.seq, "load_before": os.getloadavg()[0]}
        for depth in [int(d) for d in a.depths.split(",")]:
            for unroll in (False, True):
                row = _plan_once(depth, unroll, a.max_evaluations, a.seq, 0, None)
                print(
                    json.dumps({k: row[k] for k in ("layers", "unrolled", "wall_s", "cpu_s", "evaluated")}), flush=True
                )
                out["depth"].append(row)
    if a.only in (None, "target"):
        if not libtpu_available():
            out["target"] = "skipped: libtpu is not installed (pip install 'einshard[tpu]')"
        else:
            out["target"] = _plan_verify_cli(a.verify)
            print(json.dumps({k: v for k, v in out["target"].items() if k != "output"}))
    if a.only in (None, "depth"):
        out["depth_settings"]["load_after"] = os.getloadavg()[0]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "target.json").write_text(json.dumps(out, indent=1))
    lines = [f"# plan on targets ({out['machine']}, jax {out['jax']})", ""]
    lines += ["| layers | unrolled | plan CPU s | plan wall s | costed |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['layers']} | {r['unrolled']} | {r.get('cpu_s', '')} | {r['wall_s']} | {r['evaluated']} |"
        for r in out["depth"]
    ]
    settings = out.get("depth_settings") or {}
    if settings:
        lines += [
            "",
            f"Depth rows: `--only depth --max-evaluations {settings['max_evaluations']} --seq {settings['seq']}`, "
            "llama-7b widths on a `tpu:v5p:4x4x4` target (prediction only), one plan per row, tracing included; "
            "CPU is this process's time, wall is the clock's on this shared machine (load average "
            f"{settings['load_before']:.1f} before, {settings.get('load_after', 0):.1f} after, on "
            f"{os.cpu_count()} cores).",
        ]
    old = (RESULTS / "target.md").read_text() if (RESULTS / "target.md").exists() else ""
    kept = old[old.index("## plan + verify") :] if "## plan + verify" in old else ""  # the hand-written runs
    (RESULTS / "target.md").write_text("\n".join(lines) + "\n" + ("\n" + kept if kept else ""))


if __name__ == "__main__":
    main()
