"""explain's profile and memory on a real accelerator: a one-device training step, predicted vs measured.

On the machine it runs on (a GPU when one is lent; the CPU otherwise) this checks what the cost model assumes
about that machine, with nothing simulated:

1. the profile ``explain`` picks by default from ``jax.devices()[0].device_kind`` (its name is on the report's
   first line);
2. the profile's FLOP/s against a measured bf16 matrix product on the device (the peak it can be held to);
3. ``plan`` as a user runs it there (no profile, no budget): its budget is the device's memory;
4. a decoder training step (``benchmarks/transformer.py``: scanned layers, remat, ``value_and_grad``) on a
   one-device mesh: explain's peak bytes against the device compiler's ``memory_analysis()``, and explain's
   predicted step time (FLOPs / profile FLOP/s, no collectives on one device) against the measured median.

    python benchmarks/gpu_check.py [--small] [--out results/gpu_check.json]

Medians of ``--repeats`` timed runs after a warm-up; times on a shared CPU machine are noisy, on a lent GPU not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from transformer import make_step  # noqa: E402

import einshard  # noqa: E402


def _median_seconds(fn: Any, *args: Any, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_flops(n: int, repeats: int) -> float:
    """Measured bf16 FLOP/s of an n×n×n matrix product on the first device."""
    key = jax.random.key(0)
    a = jax.random.normal(key, (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / _median_seconds(mm, a, b, repeats=repeats)


def decoder_case(width: int, layers: int, batch: int, seq: int, vocab: int, repeats: int) -> dict[str, Any]:
    heads = max(1, width // 128)
    step = make_step(heads)
    key = jax.random.key(0)
    ks = jax.random.split(key, 8)

    def w(k: Any, *shape: int) -> jax.Array:
        return (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)

    params = {
        "emb": w(ks[0], vocab, width),
        "layers": {
            "wq": w(ks[1], layers, width, width),
            "wk": w(ks[2], layers, width, width),
            "wv": w(ks[3], layers, width, width),
            "wo": w(ks[4], layers, width, width),
            "w1": w(ks[5], layers, width, 4 * width),
            "w2": w(ks[6], layers, 4 * width, width),
        },
    }
    tokens = jax.random.randint(ks[7], (batch, seq), 0, vocab)
    mesh = jax.make_mesh((1,), ("data",))
    report = einshard.explain(step, params, tokens, mesh=mesh)
    jitted = jax.jit(step)
    compiled = jitted.lower(params, tokens).compile()
    mem = compiled.memory_analysis()
    compiled_peak = (
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    )
    measured = _median_seconds(jitted, params, tokens, repeats=repeats)
    return {
        "shape": {"width": width, "layers": layers, "batch": batch, "seq": seq, "vocab": vocab, "dtype": "bfloat16"},
        "headline": report.headline(),
        "profile": report.profile.name,
        "explain_flops": report.flops,
        "explain_peak_bytes": report.peak_bytes,
        "compiled_peak_bytes": int(compiled_peak),
        "peak_ratio": report.peak_bytes / compiled_peak,
        "predicted_s": report.time_s,
        "measured_s": measured,
        "measured_over_predicted": measured / report.time_s,
        "achieved_flops": report.flops / measured,
    }


def plan_case(width: int, layers: int, batch: int, seq: int, vocab: int) -> dict[str, Any]:
    """``plan`` for this machine, as a user runs it (no profile=, no memory_budget=), shapes only: its budget must
    be the device's own memory (what the runtime lets a program allocate) and its profile the device's."""
    step = make_step(max(1, width // 128))
    bf16 = jnp.bfloat16
    params = {
        "emb": jax.ShapeDtypeStruct((vocab, width), bf16),
        "layers": {
            name: jax.ShapeDtypeStruct((layers, *shape), bf16)
            for name, shape in {
                "wq": (width, width),
                "wk": (width, width),
                "wv": (width, width),
                "wo": (width, width),
                "w1": (width, 4 * width),
                "w2": (4 * width, width),
            }.items()
        },
    }
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    stats = jax.devices()[0].memory_stats() or {}
    result = einshard.plan(step, params, tokens, mesh=mesh)
    return {
        "shape": {"width": width, "layers": layers, "batch": batch, "seq": seq, "vocab": vocab, "dtype": "bfloat16"},
        "devices": jax.device_count(),
        "device_bytes_limit": stats.get("bytes_limit"),
        "plan_budget": result.memory_budget,
        "budget_is_the_device_limit": result.memory_budget == stats.get("bytes_limit"),
        "first_line": str(result).splitlines()[0],
        "fits": result.fits,
        "memory_bytes": result.memory_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="CPU-sized shapes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = jax.devices()[0]
    out: dict[str, Any] = {
        "jax": jax.__version__,
        "platform": dev.platform,
        "device_kind": str(getattr(dev, "device_kind", dev.platform)),
        "default_profile": einshard.analysis.get_profile(None).name,
    }
    profile = einshard.analysis.get_profile(None)
    n = 512 if a.small else 8192
    out["matmul_n"] = n
    out["matmul_flops"] = matmul_flops(n, a.repeats)
    out["profile_flops"] = profile.flops
    out["matmul_over_profile"] = out["matmul_flops"] / profile.flops
    shapes = (
        [dict(width=128, layers=2, batch=2, seq=64, vocab=512)]
        if a.small
        else [
            dict(width=2048, layers=8, batch=8, seq=2048, vocab=32000),
            dict(width=4096, layers=4, batch=4, seq=2048, vocab=32000),
        ]
    )
    out["decoder"] = [decoder_case(**s, repeats=a.repeats) for s in shapes]
    out["plan"] = [plan_case(**s) for s in shapes]
    text = json.dumps(out, indent=1, default=lambda x: float(np.asarray(x)))
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
