"""Benchmark the pipeline schedules: GPipe, circular, 1F1B and interleaved 1F1B at several micro-batch counts.

Run from the repository root:

    python benchmarks/bench_pipeline.py            # writes benchmarks/results/pipeline.{json,md}
    python benchmarks/bench_pipeline.py --quick    # smaller model, fewer repeats

For every schedule: the training step's time (``jax.jit(jax.value_and_grad(loss))``, median of >= 3 runs after a
warm-up) against the single-device sequential model measured in the same run; the bubble in theory (the idle share
of ``pipeline_info(...).tick_table``) and as measured; and the per-device memory XLA compiled for the whole step
(``compiled.memory_analysis()``: temporaries, i.e. activations, buffers and gradients, not the arguments).
The global batch is fixed, so more micro-batches mean smaller ones: GPipe's activations stay about the same
while a 1F1B stage keeps at most about S micro-batches, so its memory falls roughly as S/M.

On simulated CPU devices (this script sets them up when no accelerator plugin is installed) the devices
time-share the host's cores, so wall time measures total work, not parallel speed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
SIMULATED = os.environ.get("JAX_PLATFORMS", "").strip() in ("", "cpu") and (
    os.environ.get("JAX_PLATFORMS", "").strip() == "cpu"
    or not any(importlib.util.find_spec(name) is not None for name in ACCELERATOR_PLUGINS)
)
if SIMULATED:
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
from jax.sharding import AxisType  # noqa: E402

import einshard  # noqa: E402
from einshard.lowering import (  # noqa: E402
    PipelineEnd,
    circular_layer_order,
    pipeline,
    pipeline_info,
    vocab_parallel_cross_entropy,
    vocab_parallel_embed,
)

SCHEDULES = {
    "gpipe": dict(schedule="gpipe", repeats=1),
    "circular": dict(schedule="circular", repeats=2),
    "1f1b": dict(schedule="1f1b", repeats=1),
    "interleaved 1f1b": dict(schedule="1f1b", repeats=2),
}


def median_time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def io_layer(p, h):
    """A layer whose backward keeps nothing (its VJP needs no residual): what a pipeline step still keeps with
    it is the step's batch-sized I/O and bookkeeping, the baseline every schedule pays."""
    return h + p["w"][0]


def layer(p, h):
    return jnp.tanh(h @ p["w"]) + h


def sequential(p, x):
    return jax.lax.scan(lambda h, w: (layer(w, h), None), x, p)[0]


def ends_rows(mesh, stored, width: int, batch: int, vocab: int, repeats: int) -> list[dict]:
    """An embedding before the first stage and a head + loss after the last: replicated vs split over the stages."""
    rng = np.random.default_rng(2)
    ends = {
        "embed": {"table": jnp.asarray(rng.standard_normal((vocab, width)), jnp.float32)},
        "head": {"w": jnp.asarray(rng.standard_normal((width, vocab)) / np.sqrt(width), jnp.float32)},
    }
    tokens = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    targets = jnp.asarray(rng.integers(0, vocab, batch), jnp.int32)
    axis = "stage"
    variants = {
        "replicated on every stage": (
            lambda p, t: jnp.take(p["table"], t, axis=0),
            lambda p, h, y: (
                jax.nn.logsumexp(h @ p["w"], axis=-1) - jnp.take_along_axis(h @ p["w"], y[:, None], -1)[:, 0]
            ),
            {".*": None},
            {".*": None},
        ),
        "split over the stages": (
            lambda p, t: vocab_parallel_embed(p["table"], t, axis),
            lambda p, h, y: vocab_parallel_cross_entropy(h @ p["w"], y, axis),
            None,  # default: the first axis (the table's rows) over the stages
            "d v -> d v@stage",
        ),
    }
    rows = []
    for name, (embed, head, embed_layouts, head_layouts) in variants.items():

        def loss(p, t, y, embed=embed, head=head, el=embed_layouts, hl=head_layouts):
            out = pipeline(
                layer,
                p["layers"],
                t,
                microbatches=8,
                mesh=mesh,
                first=PipelineEnd(embed, p["embed"], layouts=el),
                last=PipelineEnd(head, p["head"], layouts=hl, args=(y,)),
            )
            return jnp.mean(out)

        params = {"layers": stored, **ends}
        step = jax.jit(jax.value_and_grad(loss))
        memory = step.lower(params, tokens, targets).compile().memory_analysis()
        t = median_time(step, params, tokens, targets, repeats=repeats)
        rows.append(
            dict(
                ends=name,
                ms=1e3 * t,
                argument_mib=memory.argument_size_in_bytes / 2**20,
                temp_mib=memory.temp_size_in_bytes / 2**20,
                ends_mib=sum(v.size * 4 for v in jax.tree.leaves(ends)) / 2**20,
            )
        )
        print(rows[-1], flush=True)
    return rows


def temp_bytes(step, *args) -> int:
    return step.lower(*args).compile().memory_analysis().temp_size_in_bytes


def run(width: int, batch: int, microbatch_counts: tuple[int, ...], repeats: int) -> dict:
    n_dev = jax.device_count()
    stages = min(4, n_dev)
    mesh = jax.make_mesh((stages,), ("stage",), axis_types=(AxisType.Auto,), devices=jax.devices()[:stages])
    layers = 2 * stages
    rng = np.random.default_rng(1)
    raw = {"w": jnp.asarray(rng.standard_normal((layers, width, width)) / np.sqrt(width) / 2, jnp.float32)}
    # Stored as a pipeline keeps them: split over the stages (circular schedules: in circular order, so that
    # the step does not reorder them).
    stored = {
        r: einshard.einshard(circular_layer_order(raw, stages, r) if r > 1 else raw, "l d f -> l@stage d f", mesh=mesh)
        for r in (1, 2)
    }
    x = jnp.asarray(rng.standard_normal((batch, width)), jnp.float32)
    x2 = jnp.concatenate([x, x])  # the same step at twice the batch: what grows with it is activations and I/O
    one = jax.devices()[0]
    seq = jax.jit(jax.value_and_grad(lambda p, x: jnp.mean(sequential(p, x) ** 2)))
    seq_args = (jax.device_put(raw, one), jax.device_put(x, one))
    t_seq = median_time(seq, *seq_args, repeats=repeats)
    seq_temp = seq.lower(*seq_args).compile().memory_analysis().temp_size_in_bytes
    rows = []
    for m in microbatch_counts:
        io_opts = dict(microbatches=m, mesh=mesh)
        io_step = jax.jit(jax.value_and_grad(lambda p, x, o=io_opts: jnp.mean(pipeline(io_layer, p, x, **o) ** 2)))
        io_mib = (temp_bytes(io_step, stored[1], x2) - temp_bytes(io_step, stored[1], x)) / 2**20
        for name, kw in SCHEDULES.items():
            if kw["repeats"] > 1 and m % stages:
                continue
            opts = dict(microbatches=m, mesh=mesh, layers_in_circular_order=True, **kw)
            params = stored[kw["repeats"]]
            step = jax.jit(jax.value_and_grad(lambda p, x, o=opts: jnp.mean(pipeline(layer, p, x, **o) ** 2)))
            temp, temp2 = temp_bytes(step, params, x), temp_bytes(step, params, x2)
            t = median_time(step, params, x, repeats=repeats)
            info = pipeline_info(params, x, microbatches=m, mesh=mesh, **kw)
            parallel = 1 if SIMULATED else stages
            rows.append(
                dict(
                    schedule=name,
                    stages=stages,
                    microbatches=m,
                    repeats=kw["repeats"],
                    ticks=len(info.tick_table),
                    ms=1e3 * t,
                    vs_sequential=t / t_seq,
                    bubble_theory=info.bubble_fraction,
                    bubble_measured=1 - t_seq / (parallel * t),
                    temp_mib=temp / 2**20,
                    # temp(2B) - temp(B): the part that grows with the batch (activations, the step's
                    # batch-sized I/O buffers); 2 temp(B) - temp(2B): the rest (gradients, accumulators).
                    batch_mib=(temp2 - temp) / 2**20,
                    fixed_mib=(2 * temp - temp2) / 2**20,
                    io_mib=io_mib,
                    activation_mib=(temp2 - temp) / 2**20 - io_mib,
                    activation_model_mib=info.activation_bytes / 2**20,
                    microbatch_mib=np.prod(info.microbatch_shape) * 4 / 2**20,
                )
            )
            print(rows[-1], flush=True)
    ends = ends_rows(mesh, stored[1], width, batch, 8 * width, repeats)
    return dict(
        ends=ends,
        devices=n_dev,
        device_kind=jax.devices()[0].device_kind,
        simulated=SIMULATED,
        jax=jax.__version__,
        python=platform.python_version(),
        repeats=repeats,
        host_cpus=os.cpu_count(),
        host_load_average_at_start=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        width=width,
        batch=batch,
        layers=layers,
        sequential_ms=1e3 * t_seq,
        sequential_temp_mib=seq_temp / 2**20,
        rows=rows,
    )


def write_markdown(result: dict, path: pathlib.Path) -> None:
    lines = [
        "# Pipeline schedules",
        "",
        f"Devices: {result['devices']} x {result['device_kind']}"
        f" ({'simulated on the host CPU' if result['simulated'] else 'accelerator'}); jax {result['jax']}; "
        f"{result['layers']} layers of width {result['width']}, global batch {result['batch']}, one stage axis "
        f"(S = {result['rows'][0]['stages']}), params stored split over the stages; "
        f"medians of {result['repeats']} runs after a warm-up; host: {result['host_cpus']} CPUs, load average "
        f"{result['host_load_average_at_start']:.1f} at the start (timings on a shared host are noisy).",
        "",
        "| schedule | M | R | ticks | ms | x sequential | bubble (theory) | bubble (measured) "
        "| XLA temp (MiB/device) | fixed part | batch part | activations (batch part - I/O) | in micro-batches "
        "| x GPipe's | 1F1B goal: (S/M) x GPipe's + 1 micro-batch | 1F1B goal met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    gpipe = {r["microbatches"]: r["activation_mib"] for r in result["rows"] if r["schedule"] == "gpipe"}
    for r in result["rows"]:
        base = gpipe[r["microbatches"]]
        goal = r["stages"] / r["microbatches"] * base + r["microbatch_mib"]
        met = "yes" if r["activation_mib"] <= goal else "no"
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['repeats']} | {r['ticks']} | {r['ms']:.1f} | "
            f"{r['vs_sequential']:.2f} | {r['bubble_theory']:.3f} | {r['bubble_measured']:.3f} | "
            f"{r['temp_mib']:.2f} | {r['fixed_mib']:.2f} | {r['batch_mib']:.2f} | {r['activation_mib']:.2f} | "
            f"{r['activation_mib'] / r['microbatch_mib']:.0f} | {r['activation_mib'] / base:.2f} | {goal:.2f} | "
            f"{met if '1f1b' in r['schedule'] else ''} |"
        )
    lines += [
        f"| sequential (1 device) | | | | {result['sequential_ms']:.1f} | 1.00 | | | "
        f"{result['sequential_temp_mib']:.2f} | | | | | | | |",
        "",
        "Ticks: the whole training step's lock-step iterations (forward and backward; a 1F1B step is the forward-only",
        "scan plus the 1F1B-ordered backward scan, whose forward ticks recompute). Bubble (theory): the idle share of",
        "the tick table, (S-1)/(R*M+S-1) for every schedule. Bubble (measured): 1 - T_sequential / (P * T_step) with",
        "P = 1 on simulated devices (they time-share the cores: the time measures total work, bubbles and the 1F1B",
        "recompute included) and P = S on accelerators.",
        "",
        "Memory: XLA temp is the compiled step's temporaries per device (`memory_analysis().temp_size_in_bytes`).",
        "The same step compiled at twice the batch separates it: *batch part* = temp(2B) - temp(B) grows with the",
        "batch (activations kept for the backward, and the step's batch-sized I/O buffers: the pipeline's output,",
        "its cotangent, the input micro-batches), *fixed part* = 2 temp(B) - temp(2B) does not (parameter",
        "gradients and their accumulators). *I/O*: the batch part of the same GPipe step (same M and shapes) with a",
        "layer whose backward keeps nothing (`h + b`), i.e. what every schedule keeps besides activations;",
        "*activations* = batch part - I/O. The goal (issue 12) is checked on the activations: 1F1B's stash holds",
        "at most S stage inputs (plus one visit's internals while it runs), GPipe every layer input of M+S-1 ticks.",
        "",
        "## Pipeline ends: embedding and head+loss replicated vs split over the stages",
        "",
        "GPipe, M = 8, the same layers; an embedding (vocabulary 8 x width rows) before the first stage and a head",
        "with per-example cross entropy after the last (`einshard.lowering.PipelineEnd`). Per-device bytes from",
        "XLA (`memory_analysis()`: arguments = the parameters and batch one device holds).",
        "",
        "| ends | ms | x replicated | argument MiB/device | temp MiB/device | embedding + head MiB (global) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    ref = result["ends"][0]["ms"]
    for r in result["ends"]:
        lines.append(
            f"| {r['ends']} | {r['ms']:.1f} | {r['ms'] / ref:.2f} | {r['argument_mib']:.2f} | {r['temp_mib']:.2f} | "
            f"{r['ends_mib']:.2f} |"
        )
    lines.append("")
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    width, batch = (128, 64) if args.quick else (512, 256)
    result = run(width, batch, (4, 8, 16), repeats)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pipeline.json").write_text(json.dumps(result, indent=2, default=float))
    write_markdown(result, out / "pipeline.md")
    print((out / "pipeline.md").read_text())


if __name__ == "__main__":
    main()
