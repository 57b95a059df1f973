"""Benchmark the lowering layer: collective matmul (sync / async one-way / two-way / XLA auto) and pipelines.

Run from the repository root:

    python benchmarks/bench_lowering.py            # writes benchmarks/results/lowering.{json,md}
    python benchmarks/bench_lowering.py --quick    # smaller problems, 3 repeats less

Times are medians of >= 5 runs after a warm-up, and every ratio is against a
baseline measured in the same run (the single-device matmul for collective
matmuls, the single-device sequential model for pipelines).

On simulated CPU devices (``--xla_force_host_platform_device_count``; what
this script sets up when no GPU/TPU backend is installed) the devices share
the host's cores and CPU collectives are synchronous copies: communication
cannot overlap with compute, so the asynchronous rings can only show their
per-step overhead there.  Their advantage has to be measured on accelerators,
where the same script runs unchanged (device count from JAX; on GPU consider
``XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import time

ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")


def _has_accelerator_plugin() -> bool:
    if os.environ.get("JAX_PLATFORMS", "").strip() not in ("", "cpu"):
        return True
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return False
    return any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)


SIMULATED = not _has_accelerator_plugin()
if SIMULATED:
    # Only without an accelerator: simulate 8 devices on the host.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from einshard._src.core.collectives import KINDS  # noqa: E402
from einshard.lowering import allgather_einsum, einsum_reduce_scatter, pipeline, pipeline_info  # noqa: E402

COLLECTIVES = KINDS  # the one collective vocabulary (einshard._src.core.collectives)


def count_collectives(compiled_text: str) -> dict[str, int]:
    """Collectives in compiled HLO (async pairs counted once, by their -start)."""
    return {op: len(re.findall(rf"= [^=\n]*? {op}(-start)?\(", compiled_text)) for op in COLLECTIVES}


def median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_collective_matmul(n_dev: int, size: tuple[int, int, int], repeats: int, dtype) -> list[dict]:
    devices = jax.devices()[:n_dev]
    mesh = jax.make_mesh((n_dev,), ("x",), axis_types=(AxisType.Auto,), devices=devices)
    B, D, F = size
    rng = np.random.default_rng(0)
    rows = []

    # ---- all-gather on a free axis: X[B_x, D] @ W[D, F_x] -> Y[B, F_x] (Megatron-SP input projection)
    x = jax.device_put(jnp.asarray(rng.standard_normal((B, D)), dtype), NamedSharding(mesh, P("x", None)))
    w = jax.device_put(jnp.asarray(rng.standard_normal((D, F)), dtype), NamedSharding(mesh, P(None, "x")))
    floor_x = jax.device_put(np.asarray(x), devices[0])
    floor_w = jax.device_put(np.asarray(w), devices[0])
    floor = jax.jit(lambda a, b: a @ b)
    t_floor = median_time(floor, floor_x, floor_w, repeats=repeats)
    variants = {}
    for schedule in ("sync", "one-way", "two-way"):
        body = (lambda s: lambda a, b: allgather_einsum("bd,df->bf", a, b, axis_name="x", dim=0, schedule=s))(schedule)
        variants[schedule] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P("x", None), P(None, "x")), out_specs=P(None, "x"))
        )
    variants["auto (XLA)"] = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P(None, "x")))
    for name, fn in variants.items():
        t = median_time(fn, x, w, repeats=repeats)
        hlo = fn.lower(x, w).compile().as_text()
        rows.append(
            dict(
                case="all-gather-matmul (free axis)",
                variant=name,
                ms=1e3 * t,
                vs_single_device=t / t_floor,
                collectives=count_collectives(hlo),
            )
        )
    rows.append(
        dict(
            case="all-gather-matmul (free axis)",
            variant="1 device (floor)",
            ms=1e3 * t_floor,
            vs_single_device=1.0,
            collectives={},
        )
    )

    # ---- reduce-scatter: H[B, F_x] @ W2[F_x, D] -> Y[B_x, D] (Megatron-SP output projection)
    h = jax.device_put(jnp.asarray(rng.standard_normal((B, F)), dtype), NamedSharding(mesh, P(None, "x")))
    w2 = jax.device_put(jnp.asarray(rng.standard_normal((F, D)), dtype), NamedSharding(mesh, P("x", None)))
    t_floor2 = median_time(
        floor, jax.device_put(np.asarray(h), devices[0]), jax.device_put(np.asarray(w2), devices[0]), repeats=repeats
    )
    variants = {}
    for schedule in ("sync", "one-way", "two-way"):
        body = (lambda s: lambda a, b: einsum_reduce_scatter("bf,fd->bd", a, b, axis_name="x", dim=0, schedule=s))(
            schedule
        )
        variants[schedule] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None))
        )
    variants["auto (XLA)"] = jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P("x", None)))
    for name, fn in variants.items():
        t = median_time(fn, h, w2, repeats=repeats)
        hlo = fn.lower(h, w2).compile().as_text()
        rows.append(
            dict(
                case="matmul-reduce-scatter",
                variant=name,
                ms=1e3 * t,
                vs_single_device=t / t_floor2,
                collectives=count_collectives(hlo),
            )
        )
    rows.append(
        dict(
            case="matmul-reduce-scatter",
            variant="1 device (floor)",
            ms=1e3 * t_floor2,
            vs_single_device=1.0,
            collectives={},
        )
    )
    return rows


def bench_pipeline(n_dev: int, width: int, batch: int, repeats: int) -> list[dict]:
    stages = min(4, n_dev)
    data = n_dev // stages
    mesh = jax.make_mesh(
        (stages, data), ("stage", "data"), axis_types=(AxisType.Auto,) * 2, devices=jax.devices()[: stages * data]
    )
    layers = 2 * stages
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.standard_normal((layers, width, width)) / np.sqrt(width), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)

    def layer(p, h):
        return jnp.tanh(h @ p["w"])

    def sequential(p, x):
        return jax.lax.scan(lambda h, w: (layer(w, h), None), x, p)[0]

    one = jax.devices()[0]
    seq = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(sequential(p, x) ** 2)))
    t_seq = median_time(seq, jax.device_put(params, one), jax.device_put(x, one), repeats=repeats)
    rows = []
    configs = [("gpipe", m, 1) for m in (stages, 2 * stages, 4 * stages)] + [
        ("circular", stages, 2),
        ("circular", 2 * stages, 2),
    ]
    for schedule, m, r in configs:
        if (batch // data) % m:
            continue
        kw = dict(microbatches=m, schedule=schedule, repeats=r, mesh=mesh, data_axis="data")
        step = jax.jit(jax.value_and_grad(lambda p, x, kw=kw: jnp.mean(pipeline(layer, p, x, **kw) ** 2)))
        t = median_time(step, params, x, repeats=repeats)
        info = pipeline_info(params, x, **kw)
        # Simulated devices time-share the host's cores, so wall time tracks the *total* work,
        # bubble iterations included (SPMD stages compute on garbage there): efficiency vs 1 stage.
        # On accelerators the stages run in parallel: efficiency vs S stages (and the data axis).
        parallel = 1 if SIMULATED else stages * data
        measured = 1 - t_seq / (parallel * t)
        hlo = step.lower(params, x).compile().as_text()
        rows.append(
            dict(
                schedule=schedule,
                stages=stages,
                data=data,
                microbatches=m,
                repeats=r,
                ms=1e3 * t,
                vs_sequential=t / t_seq,
                bubble_theory=info.bubble_fraction,
                bubble_measured=measured,
                activation_kib=info.activation_bytes / 1024,
                collectives=count_collectives(hlo),
            )
        )
    rows.append(
        dict(
            schedule="sequential (1 device)",
            stages=1,
            data=1,
            microbatches=1,
            repeats=1,
            ms=1e3 * t_seq,
            vs_sequential=1.0,
        )
    )
    return rows


def write_markdown(result: dict, path: pathlib.Path) -> None:
    lines = [
        "# Lowering benchmarks",
        "",
        f"Devices: {result['devices']} x {result['device_kind']} ({'simulated on the host CPU' if result['simulated'] else 'accelerator'}); "
        f"jax {result['jax']}; medians of {result['repeats']} runs after a warm-up; host: {result['host_cpus']} CPUs, "
        f"load average {result['host_load_average_at_start']:.1f} at the start (other work on the host makes timings noisy).",
        "",
    ]
    if result["simulated"]:
        lines += [
            "**These are simulated CPU devices: they share the host's cores and CPU collectives are synchronous,",
            "so communication cannot overlap with compute. The async rings can only show their overhead here;",
            "their advantage must be measured on GPU/TPU (the script runs there unchanged).**",
            "",
        ]
    lines += [
        f"## Collective matmul, {result['matmul_size']} (B, D, F), {result['dtype']}",
        "",
        "| case | variant | ms | x 1-device matmul | all-gather | reduce-scatter | all-reduce | collective-permute |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["collective_matmul"]:
        c = row["collectives"]
        lines.append(
            f"| {row['case']} | {row['variant']} | {row['ms']:.2f} | {row['vs_single_device']:.2f} | "
            + " | ".join(
                str(c.get(op, "")) for op in ("all-gather", "reduce-scatter", "all-reduce", "collective-permute")
            )
            + " |"
        )
    lines += [
        "",
        "## Pipeline (forward + backward step)",
        "",
        "| schedule | stages x data | micro-batches | repeats | ms | x sequential | bubble (theory) | bubble (measured) | activations kept (KiB/device) | collective-permute |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["pipeline"]:
        if "bubble_theory" not in row:
            lines.append(f"| {row['schedule']} | 1 | | | {row['ms']:.2f} | 1.00 | | | | |")
            continue
        lines.append(
            f"| {row['schedule']} | {row['stages']} x {row['data']} | {row['microbatches']} | {row['repeats']} | {row['ms']:.2f} | "
            f"{row['vs_sequential']:.2f} | {row['bubble_theory']:.3f} | {row['bubble_measured']:.3f} | "
            f"{row['activation_kib']:.0f} | {row['collectives']['collective-permute']} |"
        )
    lines += [
        "",
        "Bubble (theory) is (S-1)/(R*M+S-1). Bubble (measured) is 1 - T_sequential / (P * T_pipeline), with P = 1 on",
        "simulated devices (they time-share the cores, so the time measures total work, garbage bubble iterations included)",
        "and P = stages x data on accelerators (parallel efficiency lost, bubble plus communication). On simulated devices",
        "the per-iteration cost of synchronising the device threads at every ppermute dominates small micro-batches,",
        "so the measured bubble there is an upper bound dominated by overhead, not the schedule's bubble.",
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small problems, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    n_dev = jax.device_count()
    repeats = args.repeats or (5 if args.quick else 7)
    if SIMULATED:
        size = (512, 512, 1024) if args.quick else (2048, 2048, 4096)
        width, batch = (128, 128) if args.quick else (1024, 512)
        dtype = jnp.float32
    else:
        size = (4096, 4096, 8192) if args.quick else (8192, 8192, 16384)
        width, batch = (1024, 1024) if args.quick else (4096, 4096)
        dtype = jnp.bfloat16
    result = dict(
        devices=n_dev,
        device_kind=jax.devices()[0].device_kind,
        platform=jax.default_backend(),
        simulated=SIMULATED,
        jax=jax.__version__,
        python=platform.python_version(),
        repeats=repeats,
        host_cpus=os.cpu_count(),
        host_load_average_at_start=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        matmul_size=size,
        dtype=str(jnp.dtype(dtype)),
        note=(
            "Simulated CPU devices share the host cores and run collectives synchronously: communication cannot "
            "overlap, so async collective matmul shows only its overhead here."
            if SIMULATED
            else "Accelerator run."
        ),
    )
    result["collective_matmul"] = bench_collective_matmul(n_dev, size, repeats, dtype)
    result["pipeline"] = bench_pipeline(n_dev, width, batch, repeats)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lowering.json").write_text(json.dumps(result, indent=2))
    write_markdown(result, out / "lowering.md")
    print((out / "lowering.md").read_text())


if __name__ == "__main__":
    main()
