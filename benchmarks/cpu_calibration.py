"""What a collective, an op and a matrix product cost on this host's simulated CPU devices: the `cpu` profile's numbers.

    python benchmarks/cpu_calibration.py [--repeats 15] [--rounds 3]

Prints, as JSON: the host's usable cores and load average (before and after), and three fits:

* **a collective's time**, per group size (all-reduce over 2, 4 and 8 of the 8 devices of a (4, 2) mesh, 1 KiB
  per device): a chain of k *dependent* all-reduces (each reads the last one's result, so XLA cannot combine
  them) is timed for k = 2, 8, 16, 32, and the least-squares slope of the median time over k is one collective's
  time; divided by the ring's hops (2 (n - 1) for an all-reduce) it is the latency per ring step the profile's
  ``latency`` prices.  The chain lengths run interleaved, ``--rounds`` times, so a burst of load hits them alike.
  (The older form, an all-reduce's program minus the same program without it, subtracted two noisy medians and
  gave negative times on a loaded host; a slope over four chain lengths does not cancel the whole signal.)
* **a merged all-reduce's pieces**: k independent sums over the batch axis (8 devices), which XLA's combiner
  merges into one tuple-shaped all-reduce of k pieces, against the same program with the batch replicated (no
  collective): the slope of the difference over k is what each piece of the merged op costs.  About one
  all-reduce's time each (not a k-th of one) is what ``Profile.combined_latency = 'per_piece'`` models.
* **an op's fixed cost**: the same chain of ops kept apart by ``optimization_barrier`` (no fusion, no collective),
  the slope per op: what each separate kernel XLA:CPU launches costs, which no FLOP count sees.
* **matmul FLOP/s** per device (and for the host) with 1, 2, 4 and 8 devices busy at once: whether the devices
  share the host's cores (``Profile.host_cores``).

A fit whose slope is not positive, or whose chain times do not rise with k (the load swamped them), is reported
with ``"reliable": false``: rerun on a quieter host rather than read it.

Measured 2026-11-26: on this project's 2-core machine a 4 KiB all-reduce costs 70-130 µs (~45 µs per ring step),
on an idle 16-core host 10-65 µs (~5 µs per ring step); matmul 9 GFLOP/s per device with 8 busy on 2 cores,
190 on 16.  ``einshard.analysis.PROFILES['cpu']`` takes 20 µs per step between them (see its comment).
With 1, 2, 4, 8 devices busy on the 2-core machine (load average 5): 89, 86, 22, 8.7 GFLOP/s per device, 89, 172,
88, 69 for the host: the devices share the cores, what ``Profile.host_cores`` models (``flops · cores / devices``
each once devices outnumber cores).
Measured 2026-11-26 22:10 UTC with the chain fit, same 2-core machine at load average 16-17 (nine processes):
one all-reduce 138 µs over 2 devices, 88 µs over 4, 714 µs over 8 (the 2-device chain's medians not monotonic
in k: unreliable at that load), an unfused op ~7 µs: at that load a collective costs 10-100x an op, whatever
its hops, the rendezvous of 8 device threads on 2 busy cores.  k independent sums merged by XLA into one
all-reduce of k pieces (8 devices, same load): 269, 1296, 2681 µs for k = 1, 8, 16 against 210, 461, 644 µs with
the batch replicated (no collective): ~127 µs more per piece, about one all-reduce alone, not a k-th of one:
XLA:CPU runs each piece as its own collective (what ``Profile.combined_latency = 'per_piece'`` prices).
"""

import argparse
import json
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

CHAIN_LENGTHS = (2, 8, 16, 32)


def median_time(f: Callable[..., Any], *args: Any, n: int) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def least_squares_slope(xs: tuple[int, ...], ys: list[float]) -> float:
    mx, my = statistics.mean(xs), statistics.mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def chain(mesh: jax.sharding.Mesh, k: int, axes: Any) -> Callable[..., Any]:
    """k dependent steps per device: an all-reduce over ``axes`` each (None: an unfused op each)."""

    def body(y: jax.Array) -> jax.Array:
        for _ in range(k):
            y = y * 1.0001
            y = jax.lax.psum(y, axes) if axes is not None else jax.lax.optimization_barrier(jnp.sin(y))
        return y

    spec = P(("data", "model"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def fit_chain(mesh: jax.sharding.Mesh, x: jax.Array, axes: Any, repeats: int, rounds: int) -> dict[str, Any]:
    """The slope of the chain's median time over its length (each length compiled once, timed interleaved)."""
    fns = {k: chain(mesh, k, axes) for k in CHAIN_LENGTHS}
    samples: dict[int, list[float]] = {k: [] for k in CHAIN_LENGTHS}
    for _ in range(rounds):
        for k in CHAIN_LENGTHS:
            samples[k].append(median_time(fns[k], x, n=repeats))
    medians = [statistics.median(samples[k]) for k in CHAIN_LENGTHS]
    slope = least_squares_slope(CHAIN_LENGTHS, medians)
    rising = all(a <= b for a, b in zip(medians, medians[1:]))
    return {"per_step_s": slope, "medians_s": medians, "reliable": slope > 0 and rising}


def merged_sums(k: int, out: NamedSharding) -> Callable[..., Any]:
    """k independent sums over the batch axis: with the batch split, one all-reduce of k pieces (XLA's combiner)."""
    return jax.jit(lambda x: [jnp.sum(x * (1.0 + i), axis=0) for i in range(k)], out_shardings=out)


def fit_merged(repeats: int, rounds: int) -> dict[str, Any]:
    """Per piece of a merged all-reduce: the slope over k of (batch split - batch replicated) medians."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    split = jax.device_put(jnp.ones((128, 64), jnp.float32), NamedSharding(mesh, P("d")))
    whole = jax.device_put(jnp.ones((128, 64), jnp.float32), NamedSharding(mesh, P()))
    fns = {k: merged_sums(k, NamedSharding(mesh, P())) for k in CHAIN_LENGTHS}
    with_ar: dict[int, list[float]] = {k: [] for k in CHAIN_LENGTHS}
    without: dict[int, list[float]] = {k: [] for k in CHAIN_LENGTHS}
    for _ in range(rounds):
        for k in CHAIN_LENGTHS:
            with_ar[k].append(median_time(fns[k], split, n=repeats))
            without[k].append(median_time(fns[k], whole, n=repeats))
    diff = [statistics.median(with_ar[k]) - statistics.median(without[k]) for k in CHAIN_LENGTHS]
    slope = least_squares_slope(CHAIN_LENGTHS, diff)
    return {"per_piece_s": slope, "difference_s": diff, "reliable": slope > 0 and all(d > 0 for d in diff)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15, help="runs per median")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the chain lengths")
    a = parser.parse_args()
    out: dict[str, Any] = {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_before": os.getloadavg(),
    }
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((8, 256), jnp.float32), NamedSharding(mesh, P(("data", "model"))))
    for n, axes in ((2, "model"), (4, "data"), (8, ("data", "model"))):
        row = fit_chain(mesh, x, axes, a.repeats, a.rounds)
        row["per_ring_step_s"] = row["per_step_s"] / (2 * (n - 1))
        out[f"allreduce_{n}dev_1KiB"] = row
    out["merged_allreduce_8dev_piece"] = fit_merged(a.repeats, a.rounds)
    out["unfused_op"] = fit_chain(mesh, x, None, a.repeats, a.rounds)
    # Matmul FLOP/s per device with 1, 2, 4 and 8 of the simulated devices busy (one k x k product each, in one
    # program over a mesh of that many devices): whether the devices share the host's cores (FLOP/s per device
    # falls as more are busy, once there are more busy devices than cores) or each has its own.
    k = 512
    for ndev in (1, 2, 4, 8):
        sub = jax.make_mesh((ndev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ndev])
        lhs = jax.device_put(jnp.ones((ndev * k, k), jnp.float32), NamedSharding(sub, P("x", None)))
        rhs = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(sub, P()))
        t = median_time(jax.jit(lambda a, b: a @ b), lhs, rhs, n=a.repeats)
        out[f"matmul_flops_per_device_{ndev}_busy"] = 2 * k**3 / t
        out[f"matmul_flops_host_{ndev}_busy"] = ndev * 2 * k**3 / t
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
