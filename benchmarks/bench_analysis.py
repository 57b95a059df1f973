"""How long ``einshard.analyze`` takes per einsum, against XLA compiling the same einsum (the baseline).

    PYTHONPATH=. python benchmarks/bench_analysis.py [--reps 50]

For each einsum: the median over ``reps`` runs of

* ``first``: a first analysis (every analysis cache emptied before each run, untimed: the plans; the
  parser's cache of the text stays warm, as in every earlier version of this table, and since 2026-11 with
  it what is read from the text alone: its axes, annotations, axis classes, each side's splits as written
  and the einsum axes each mesh axis it names splits; before 2026-11 the emptying,
  which frees the last run's plan, was timed with it),
* ``first, text re-read``: the same with what is read from the parsed text emptied too (``first`` as
  measured before 2026-11, when that was an analysis cache),
* ``cold``: the same with every einshard cache emptied (``einshard.clear_caches()``: the text is parsed again),
* ``new sizes``: the same expression with sizes not seen before (its structure is cached, its plan is not:
  a model whose layers repeat an einsum at other shapes),
* ``+ alternatives``: ``first``, then reading ``plan.alternatives`` (priced and ranked on first read),
* ``cached``: a repeat (the same einsum again, as a model's layers repeat),
* ``compile``: ``jax.jit(einsum, in_shardings, out_shardings).lower(...).compile()`` on simulated CPU
  devices, for the einsums whose mesh fits on 8 (median of ``min(reps, 5)``, each on a fresh function).

Writes benchmarks/results/analysis.json and analysis.md.  Goals (issue 10): first ≤ 100 µs, cached ≤ 3 µs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402

import einshard  # noqa: E402
from einshard._src.analysis.einsum import analyze as api  # noqa: E402

CASES = [
    # name, expression, mesh, sizes
    ("DP", "b@data x, x y -> b@data y", {"data": 8}, {"b": 1024, "x": 4096, "y": 4096}),
    ("column TP", "b x, x y@model -> b y@model", {"model": 8}, {"b": 1024, "x": 4096, "y": 16384}),
    ("row TP", "b x@model, x@model y -> b? y?", {"model": 8}, {"b": 1024, "x": 16384, "y": 4096}),
    ("DP x TP", "b@data x, x y@model -> b@data y@model", {"data": 4, "model": 2}, {"b": 1024, "x": 4096, "y": 16384}),
    ("FSDP layout", "b@data x, x@data y -> b@data y", {"data": 8}, {"b": 1024, "x": 4096, "y": 4096}),
    ("issue example", "b x@data, x y@model -> b? y?", {"data": 4, "model": 2}, {"b": 1024, "x": 4096, "y": 16384}),
    (
        "attention scores",
        "b h@model q d, b h@model k d -> b h@model q k",
        {"data": 4, "model": 2},
        {"b": 8, "h": 16, "q": 512, "k": 512, "d": 64},
    ),
    (
        "k@(data,model)",
        "b x@(data,model), x@(data,model) y -> b? y?",
        {"data": 4, "model": 2},
        {"b": 1024, "x": 4096, "y": 4096},
    ),
    (
        "3 operands",
        "b x@data, x y, y z@model -> b? z?",
        {"data": 4, "model": 2},
        {"b": 512, "x": 1024, "y": 1024, "z": 1024},
    ),
    (
        "2048 chips",
        "b@data s d@model, d@model f@fsdp -> b@data s f",
        {"data": 64, "fsdp": 4, "model": 8},
        {"b": 2048, "s": 4096, "d": 8192, "f": 28672},
    ),
]


def clear() -> None:
    # Every analysis cache (plans); the parser's cache of the text, and what is read from it, stay warm.
    api.clear_analysis_caches()


def clear_with_text() -> None:
    # ``clear``, and what is read from the parsed text (its parse stays cached): ``first`` before 2026-11.
    api.clear_analysis_caches()
    api.prepare_text.cache_clear()


def analyze(expr: str, mesh: dict[str, int], sizes: dict[str, int]) -> einshard.EinsumPlan:
    return einshard.analyze(expr, mesh=mesh, sizes=sizes, dtype="bf16", profile="h100")


def median_time(fn, reps: int, setup=None) -> float:
    """The median of ``reps`` timed calls of ``fn``; ``setup`` (untimed) runs before each."""
    return median_times(fn, reps, setup)[0]


def median_times(fn, reps: int, setup=None) -> tuple[float, float]:
    """Medians of ``reps`` calls of ``fn``: wall time, and this process's CPU time (which a loaded machine
    stretches less: time waiting for a core is not counted); ``setup`` (untimed) runs before each."""
    wall, cpu = [], []
    for _ in range(reps):
        if setup is not None:
            setup()
        c = time.process_time()
        t = time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def compile_time(plan: einshard.EinsumPlan, reps: int) -> float | None:
    devices = math.prod(m.size for m in plan.mesh)
    if devices > len(jax.devices()):
        return None
    mesh = jax.make_mesh(
        tuple(m.size for m in plan.mesh),
        tuple(m.name for m in plan.mesh),
        axis_types=(AxisType.Auto,) * len(plan.mesh),
        devices=jax.devices()[:devices],
    )
    letters = {}
    for op in plan.operands:
        for a in op.axes:
            letters.setdefault(a, "abcdefghijklmnopqrstuvwxyz"[len(letters)])
    eq = ",".join("".join(letters[a] for a in op.axes) for op in plan.operands)
    eq += "->" + "".join(letters[a] for a in plan.out_layout.axes)
    args = [
        jax.ShapeDtypeStruct(op.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))
        for op, spec in zip(plan.operands, plan.in_specs, strict=True)
    ]
    out = NamedSharding(mesh, plan.out_spec)
    times = []
    for _ in range(max(5, min(reps, 5))):
        f = jax.jit(lambda *xs: jnp.einsum(eq, *xs), out_shardings=out)  # a fresh function: no compile cache
        t = time.perf_counter()
        f.lower(*args).compile()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results"))
    args = parser.parse_args()
    reps = max(5, args.reps)
    load_before = os.getloadavg()[0]
    rows = []
    for name, expr, mesh, sizes in CASES:
        analyze(expr, mesh, sizes)  # warm the parser and imports

        def first(expr=expr, mesh=mesh, sizes=sizes):
            analyze(expr, mesh, sizes)

        # the caches are emptied before each run, untimed (emptying them frees the last run's plan)
        t_first, cpu_first = median_times(first, reps, setup=clear)
        t_reread = median_time(first, reps, setup=clear_with_text)
        t_cold = median_time(first, reps, setup=einshard.clear_caches)

        def with_alternatives(expr=expr, mesh=mesh, sizes=sizes):
            analyze(expr, mesh, sizes).alternatives  # noqa: B018

        t_alts = median_time(with_alternatives, reps, setup=clear)
        scales = iter(range(2, 2 + 10 * reps))  # each run a size not seen before (multiples keep every split)

        def new_sizes(expr=expr, mesh=mesh, sizes=sizes, scales=scales):
            k = next(scales)
            analyze(expr, mesh, {a: s * k for a, s in sizes.items()})

        t_new = median_time(new_sizes, reps)
        analyze(expr, mesh, sizes)
        t_cached = median_time(lambda expr=expr, mesh=mesh, sizes=sizes: analyze(expr, mesh, sizes), reps)
        plan = analyze(expr, mesh, sizes)
        t_compile = compile_time(plan, reps)
        rows.append(
            {
                "name": name,
                "expression": expr,
                "mesh": mesh,
                "strategy": plan.strategy,
                "options": 1 + len(plan.alternatives),
                "first_us": t_first * 1e6,
                "first_text_reread_us": t_reread * 1e6,
                "cold_us": t_cold * 1e6,
                "first_cpu_us": cpu_first * 1e6,
                "new_sizes_us": t_new * 1e6,
                "with_alternatives_us": t_alts * 1e6,
                "cached_us": t_cached * 1e6,
                "compile_ms": None if t_compile is None else t_compile * 1e3,
                "compile_over_first": None if t_compile is None else t_compile / t_first,
            }
        )
        print(
            f"{name:18s} first {t_first * 1e6:8.1f} µs  re-read {t_reread * 1e6:8.1f} µs  cold {t_cold * 1e6:8.1f} µs  new sizes {t_new * 1e6:8.1f} µs  "
            f"+alternatives {t_alts * 1e6:8.1f} µs  cached {t_cached * 1e6:6.1f} µs  "
            + (f"compile {t_compile * 1e3:7.1f} ms ({t_compile / t_first:6.0f}x)" if t_compile else "compile n/a"),
            flush=True,
        )
    result = {
        "benchmark": "einshard.analyze per einsum (median of reps), vs XLA compile of the same einsum",
        "reps": reps,
        "goal_us": 100,
        "median_first_us": statistics.median(r["first_us"] for r in rows),
        "median_first_text_reread_us": statistics.median(r["first_text_reread_us"] for r in rows),
        "median_cold_us": statistics.median(r["cold_us"] for r in rows),
        "median_first_cpu_us": statistics.median(r["first_cpu_us"] for r in rows),
        "median_new_sizes_us": statistics.median(r["new_sizes_us"] for r in rows),
        "median_with_alternatives_us": statistics.median(r["with_alternatives_us"] for r in rows),
        "median_cached_us": statistics.median(r["cached_us"] for r in rows),
        "machine": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "devices": f"{len(jax.devices())} simulated {jax.devices()[0].platform}",
            # Times on a shared machine stretch with its load: recorded so runs can be compared.
            "load_average_1min": [load_before, os.getloadavg()[0]],
        },
        "cases": rows,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(result, indent=2, ensure_ascii=False) + "\n")
    lines = [
        "# einshard.analyze: time per einsum",
        "",
        f"Median of {reps} runs; python {result['machine']['python']}, jax {result['machine']['jax']}, "
        f"{result['machine']['cpus']} CPUs, {result['machine']['devices']} devices, 1-minute load average "
        f"{load_before:.1f} → {os.getloadavg()[0]:.1f} (times stretch with load on a shared machine).  "
        "`first`: every analysis cache emptied before the run, untimed (the parser's cache of the text stays "
        "warm, with what is read from the text alone: axes, annotations, axis classes, each side's splits as "
        "written); `re-read`: `first` with "
        "that read again from the cached parse (`first` before 2026-11); `cold`: every einshard cache emptied (`einshard.clear_caches()`: the text parsed again); "
        "`new sizes`: the "
        "expression seen before at other sizes (its parsed structure cached, not its plan); `+ alts`: `first`, "
        "then reading `plan.alternatives` (priced on first read); `cached`: the same einsum again (a model's "
        "repeated layers); "
        "`compile`: `jax.jit(...).lower(...).compile()` of the same einsum with the same shardings (fresh function).",
        "",
        "| einsum | mesh | strategy | options | first (µs) | re-read (µs) | cold (µs) | new sizes (µs) | + alts (µs) "
        "| cached (µs) | XLA compile (ms) | compile / first |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mesh_text = " ".join(f"{k}={v}" for k, v in r["mesh"].items())
        comp = "n/a (mesh > 8 devices)" if r["compile_ms"] is None else f"{r['compile_ms']:.1f}"
        ratio = "" if r["compile_over_first"] is None else f"{r['compile_over_first']:.0f}×"
        lines.append(
            f"| `{r['expression']}` | {mesh_text} | {r['strategy']} | {r['options']} | {r['first_us']:.0f} | "
            f"{r['first_text_reread_us']:.0f} | {r['cold_us']:.0f} | "
            f"{r['new_sizes_us']:.0f} | {r['with_alternatives_us']:.0f} | {r['cached_us']:.1f} | {comp} | {ratio} |"
        )
    lines += [
        "",
        f"Median over einsums: first {result['median_first_us']:.0f} µs, "
        f"re-read {result['median_first_text_reread_us']:.0f} µs, cold {result['median_cold_us']:.0f} µs, "
        f"new sizes "
        f"{result['median_new_sizes_us']:.0f} µs, with alternatives {result['median_with_alternatives_us']:.0f} µs, "
        f"cached {result['median_cached_us']:.1f} µs (goals: first ≤ {result['goal_us']} µs, cached ≤ 3 µs); "
        f"first in CPU time (this process's, not stretched by waiting for a core) "
        f"{result['median_first_cpu_us']:.0f} µs.",
        "",
    ]
    (out / "analysis.md").write_text("\n".join(lines))
    print(
        f"median first {result['median_first_us']:.0f} µs, cold {result['median_cold_us']:.0f} µs, cached {result['median_cached_us']:.1f} µs"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
