"""What a collective, an op and a matrix product cost on this host's simulated CPU devices: the `cpu` profile's numbers.

    python benchmarks/cpu_calibration.py [--repeats 15] [--rounds 3] [--sweep | --groups | --dots]

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

* **the all-reduce's shape** (``allreduce_shape``): the three group sizes' times fitted as ``overhead + latency *
  hops``, whether a collective's cost follows its ring's hops (what ``Profile.latency`` assumes) or is mostly fixed.
* **an op's cost by size** (``--sweep``): chains of dots ((n, n) @ (n, n), n = 8 ... 256), of elementwise kernels
  (a fused ``tanh(y + 0.5) * c``) and of row reductions (``y - sum(y, -1) * c``) on (rows, 128) blocks, each op kept
  apart by ``optimization_barrier``, run on all 8 devices at once (a shard_map: the other devices' threads compete
  for the cores as in a sharded step); the slope between two chain lengths is one op's time.  For dots, the fit
  ``time = op_overhead + FLOPs / rate`` (weighted to the small ones); for the others, seconds per element of the
  large blocks.  What ``Profile.op_overhead`` / ``element_time`` and the ``cpu`` profile's ``flops`` price.
* **a collective's time by kind and group size** (``--groups``, alone: ``group_sweep``): chains of all-reduces,
  all-gathers and reduce-scatters over 2, 4 and 8 devices of the (4, 2) mesh ('model', 'data', both axes), 1 and
  32 KiB per device, each collective on a fresh operand reading a scalar of the last result (its size fixed along
  the chain), minus the same chain without the collective; every configuration once per round, rotated.  Per kind
  and size, the fits ``overhead + latency * hops`` (the ring's) and ``overhead + c * log2(n)``, with their worst
  residuals: the law ``Profile.collective_time`` prices under ``latency_steps``.

* **a dot's time by its result's size** (``--dots``, alone: ``dot_sweep``): products of ``DOT_SHAPES`` on all 8
  devices, equal FLOPs paired with results 4 Ki to 1 Mi elements large, in the weight gradient's form (the left
  operand contracted on its first axis, x^T @ dy) and the forward one; each product on a fresh operand reading a
  scalar of the last result, minus the same chain without it; fitted as ``overhead + FLOPs / rate + elements *
  price`` and as the larger of the two terms: whether a product's result elements cost anything beyond its FLOPs
  (what ``Profile.element_time`` may be charged on: ``planner.scoring.unwalked_compute_s``).

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
Measured 2026-11-27 04:05-04:18 UTC, same 2-core machine: at load 2, an all-reduce over 2, 4, 8 devices 42, 70,
127 µs (28 µs fixed + 7 µs per hop), a merged piece 137 µs; at load 8-13, 41, 103, 244 µs (17 µs per hop, little
fixed: the shape moves with the load, so ``latency`` stays one per-hop price) and 85-235 µs per merged piece.  The
sweep (load 8-13): dots cost 0.1-1.4 µs fixed plus 21-24 GFLOP/s per device with 8 busy, down to 32 x 32 (8 x 8
and 16 x 16 ones: 0.2-24 µs, noise); a row reduction 9-10 ns per element, a fused tanh 32 ns per element, per device
with 8 busy: the FLOPs explain counts run at the profile's rate, and the elementwise work it does not count is
most of a small step's compute (``Profile.element_time``).
Measured 2026-11-27 07:19 UTC with ``--groups --repeats 15 --rounds 7`` (load 3-6; results/
cpu_collectives_by_group.json): over 2, 4, 8 devices an all-reduce 43/77/127 µs (1 KiB) and 50/85/138 (32 KiB), an
all-gather 41/73/124 and 49/94/153, a reduce-scatter 43/76/129 and 48/83/131: the kinds alike, and the 8 devices of
both axes cost what one group of 8 does (7 peers), not a 4-ring plus a 2-ring.  Fitted per kind and size as 29-38 µs
plus 14-17 µs per peer (n - 1), worst residual 4-9%; log2(n) fits as closely only with a fixed part of -6 to +4 µs.
The ratios 4:2 = 1.7-1.9, 8:2 = 2.7-3.2 (``cpu_profile(small_ops=True)``: 30 µs + 14 µs per peer, 1.6 and 2.9).
Measured 2026-11-27 10:43-10:47 UTC with ``--dots --repeats 9 --rounds 7``, twice (load 4-6, then 5-10; results/
cpu_dots.json): the forward form 25-46 GFLOP/s per device (a (1024, 16) @ (16, 1024) product, 1 Mi result elements,
1.0-1.2 ms), the weight gradient's form of the same 33.6 MFLOP 4-20 (a (64, 4096)^T-form one, 4 Ki elements,
4.6-9.2 ms); the price per result element fitted negative (-0.05, -0.13 ns), the max law no closer (residual
73-78%): a product's result elements cost nothing measurable, its form changes its FLOP rate.
"""

import argparse
import json
import math
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


# The size sweep (``--sweep``): per kind, the local (per-device) block each of the 8 devices works on.
DOT_SIDES = (8, 16, 32, 64, 96, 128, 192, 256)  # an (n, n) @ (n, n) product: 2 n^3 FLOPs
ROW_COUNTS = (2, 8, 32, 128, 512, 2048)  # a (rows, 128) block: rows * 128 elements
SWEEP_CHAIN = (2, 12)  # two chain lengths: the slope is one op's time, the program's own overhead cancels


def sweep_chain(kind: str, k: int) -> Callable[..., Any]:
    """k dependent ``kind`` ops per device, each kept a kernel of its own by ``optimization_barrier`` (no fusion),
    on all 8 devices at once (a shard_map over a mesh of 8): what one op of that size costs while the other
    devices' threads compete for the host's cores, as they do in a sharded step."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))

    def body(y: jax.Array) -> jax.Array:
        for _ in range(k):
            if kind == "dot":
                y = y @ y * 0.01
            elif kind == "elementwise":  # what follows a product in a layer: a bias, an activation, a scale
                y = jnp.tanh(y + 0.5) * 1.0001
            else:  # a row reduction (the sum a norm or a softmax takes), broadcast back so the chain continues
                y = y - jnp.sum(y, -1, keepdims=True) * 1e-3
            y = jax.lax.optimization_barrier(y)
        return y

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d")))


def sweep(repeats: int, rounds: int) -> dict[str, Any]:
    """Per op kind and size: one op's time on each of 8 busy devices (the chain's slope), and for dots the least-
    squares fit ``time = op_overhead + flops / rate`` over the sizes (what ``Profile.op_overhead`` and the profile's
    FLOP/s per device price)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    cases = [("dot", (n, n), 2 * n**3) for n in DOT_SIDES]
    cases += [(kind, (r, 128), r * 128) for kind in ("elementwise", "reduction") for r in ROW_COUNTS]
    rows: list[dict[str, Any]] = []
    for kind, shape, work in cases:
        x = jax.device_put(jnp.ones((8 * shape[0], shape[1]), jnp.float32), NamedSharding(mesh, P("d")))
        fns = {k: sweep_chain(kind, k) for k in SWEEP_CHAIN}
        samples: dict[int, list[float]] = {k: [] for k in SWEEP_CHAIN}
        for _ in range(rounds):
            for k in SWEEP_CHAIN:
                samples[k].append(median_time(fns[k], x, n=repeats))
        lo, hi = (statistics.median(samples[k]) for k in SWEEP_CHAIN)
        per_op = (hi - lo) / (SWEEP_CHAIN[1] - SWEEP_CHAIN[0])
        # work: FLOPs of a dot; elements of an elementwise op or of a reduction's input
        rows.append({"kind": kind, "shape": list(shape), "work": work, "per_op_s": per_op, "reliable": per_op > 0})
    dots = [r for r in rows if r["kind"] == "dot" and r["reliable"]]
    fit: dict[str, Any] = {"reliable": False}
    if len(dots) >= 3:
        xs, ys = [float(r["work"]) for r in dots], [r["per_op_s"] for r in dots]
        # weighted by 1/time: the small ops' fixed cost is what the fit is for, not drowned by the large ones
        w = [1.0 / y**2 for y in ys]
        sw, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
        sxx, sxy = sum(wi * x * x for wi, x in zip(w, xs)), sum(wi * x * y for wi, x, y in zip(w, xs, ys))
        slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
        intercept = (sy - slope * sx) / sw
        fit = {
            "op_overhead_s": intercept,
            "flops_per_device": 1.0 / slope if slope > 0 else None,
            "reliable": slope > 0 and intercept >= 0,
        }
    per_element: dict[str, Any] = {}
    for kind in ("elementwise", "reduction"):
        # the large blocks' cost per element (the small ones are the fixed cost, and the noise, of a kernel)
        big = [r for r in rows if r["kind"] == kind and r["work"] >= 16384]
        slope = least_squares_slope(tuple(r["work"] for r in big), [r["per_op_s"] for r in big])
        per_element[kind] = {"s_per_element": slope, "reliable": slope > 0}
    return {"ops": rows, "dot_fit": fit, "per_element_8_busy": per_element}


# The collective-by-group-size sweep (``--groups``): kinds, groups (the mesh axes of the (4, 2) mesh a group spans,
# its size) and the f32 elements each device sends into one collective (its local operand: V / n for an all-gather,
# V for an all-reduce and a reduce-scatter).
GROUP_KINDS = ("all-reduce", "all-gather", "reduce-scatter")
GROUPS: tuple[tuple[int, Any], ...] = ((2, "model"), (4, "data"), (8, ("data", "model")))
GROUP_ELEMENTS = (256, 8192)  # 1 KiB and 32 KiB of f32 per device


def group_chain(kind: str, axes: Any, n: int, elements: int, k: int) -> Callable[..., Any]:
    """k dependent ``kind`` collectives over ``axes`` (a group of ``n``), each on a fresh operand of ``elements`` f32
    per device that reads the last result (a scalar of it, added): XLA neither combines nor elides them, and the
    operand's size stays the same along the chain (an all-gather's result would otherwise grow, a reduce-scatter's
    shrink).  ``kind`` None: the same chain with no collective (the add and the read alone, subtracted)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def body(x: jax.Array) -> jax.Array:
        acc = jnp.zeros((), x.dtype)
        for _ in range(k):
            y = x + acc * 1e-6
            if kind == "all-reduce":
                y = jax.lax.psum(y, axes)
            elif kind == "all-gather":
                y = jax.lax.all_gather(y, axes, tiled=True)
            elif kind == "reduce-scatter":
                y = jax.lax.psum_scatter(y, axes, tiled=True)
            else:
                y = jax.lax.optimization_barrier(y)
            acc = y[0]
        return x + acc

    del n, elements  # the shapes come from the argument; kept in the signature for the cache key's readability
    spec = P(("data", "model"))
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _fit_law(rows: list[dict[str, Any]], steps: Callable[[str, int], float]) -> dict[str, Any]:
    """Least squares ``time = overhead + per_step * steps(kind, n)`` over ``rows`` (one kind and size, three groups)
    and the fit's largest relative residual."""
    xs = tuple(steps(r["kind"], r["n"]) for r in rows)
    ys = [r["per_op_s"] for r in rows]
    slope = least_squares_slope(xs, ys)  # type: ignore[arg-type]
    overhead = statistics.mean(ys) - slope * statistics.mean(xs)
    worst = max(abs(overhead + slope * x - y) / y for x, y in zip(xs, ys)) if all(y > 0 for y in ys) else None
    return {"overhead_s": overhead, "per_step_s": slope, "max_rel_residual": worst}


def _ring_steps(kind: str, n: int) -> float:
    """Hops of one ring pass (two for an all-reduce), as ``Profile.collective_time`` counts them on one axis."""
    return float(2 * (n - 1) if kind == "all-reduce" else n - 1)


def _log_steps(kind: str, n: int) -> float:
    """Rounds of a recursive-doubling exchange (two for an all-reduce)."""
    return (2.0 if kind == "all-reduce" else 1.0) * math.log2(n)


def group_sweep(repeats: int, rounds: int) -> dict[str, Any]:
    """Per collective kind, group size (2, 4, 8 of the (4, 2) mesh's devices) and operand size: one collective's time
    (the chain's slope over ``CHAIN_LENGTHS`` minus the same chain's without the collective), every configuration
    timed once per round, interleaved; then, per kind and size, the fits ``overhead + latency * hops`` (the ring's
    hops, what ``Profile.collective_time`` prices) and ``overhead + c * log2(n)``, with their worst residuals, and the
    ratio of the 4-device to the 2-device time (what decides where the planner puts the gradient pieces)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    configs = [(kind, n, axes, e) for kind in GROUP_KINDS for n, axes in GROUPS for e in GROUP_ELEMENTS]
    configs += [(None, 1, None, e) for e in GROUP_ELEMENTS]  # the baselines: no collective
    fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
    args: dict[int, jax.Array] = {}
    for kind, n, axes, e in configs:
        args.setdefault(e, jax.device_put(jnp.ones((8 * e,), jnp.float32), NamedSharding(mesh, P(("data", "model")))))
        for k in CHAIN_LENGTHS:
            fn = group_chain(str(kind) if kind else "", axes, n, e, k)
            jax.block_until_ready(fn(args[e]))  # compile outside the timing
            fns[(kind, n, e, k)] = fn
    samples: dict[tuple[Any, ...], list[float]] = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotated: a burst of load hits all alike
            samples[key].append(median_time(fns[key], args[key[2]], n=repeats))
    slope: dict[tuple[Any, ...], float] = {}
    for kind, n, _, e in configs:
        medians = [statistics.median(samples[(kind, n, e, k)]) for k in CHAIN_LENGTHS]
        slope[(kind, n, e)] = least_squares_slope(CHAIN_LENGTHS, medians)
    rows = [
        {
            "kind": kind,
            "n": n,
            "elements_per_device": e,
            "per_op_s": slope[(kind, n, e)] - slope[(None, 1, e)],
            "baseline_per_step_s": slope[(None, 1, e)],
        }
        for kind, n, _, e in configs
        if kind is not None
    ]
    fits = []
    for kind in GROUP_KINDS:
        for e in GROUP_ELEMENTS:
            sel = [r for r in rows if r["kind"] == kind and r["elements_per_device"] == e]
            by_n = {r["n"]: r["per_op_s"] for r in sel}
            fits.append(
                {
                    "kind": kind,
                    "elements_per_device": e,
                    "ring_hops": _fit_law(sel, _ring_steps),
                    "log2": _fit_law(sel, _log_steps),
                    "ratio_4_to_2": by_n[4] / by_n[2] if by_n[2] > 0 else None,
                    "ratio_8_to_2": by_n[8] / by_n[2] if by_n[2] > 0 else None,
                    "reliable": all(r["per_op_s"] > 0 for r in sel),
                }
            )
    return {"ops": rows, "fits": fits}


# The dot sweep (``--dots``, alone: ``dot_sweep``): per product, (M, K, N) of an (M, K) @ (K, N) on each device, and
# whether the left operand is stored (K, M) and contracted on its first axis (``'tn'``: a weight gradient's
# dot_general, x^T @ dy contracting the batch) or (M, K) on its last (``'nn'``: a forward activation product).  The
# sizes pair the same FLOPs with outputs 64x apart (a weight gradient's small result over a long contraction against
# an activation's large result over a short one), so a per-result-element cost separates from the FLOPs.
DOT_SHAPES: tuple[tuple[int, int, int, str], ...] = (
    (64, 4096, 64, "tn"),  # 33.6 MFLOP, 4 Ki out: a weight gradient over 4096 rows
    (64, 1024, 64, "tn"),  # 8.4 MFLOP, 4 Ki out
    (256, 1024, 256, "tn"),  # 134 MFLOP, 64 Ki out
    (256, 256, 256, "tn"),  # 33.6 MFLOP, 64 Ki out
    (512, 64, 512, "nn"),  # 33.6 MFLOP, 256 Ki out: an activation product over a 64-wide contraction
    (512, 16, 512, "nn"),  # 8.4 MFLOP, 256 Ki out
    (1024, 16, 1024, "nn"),  # 33.6 MFLOP, 1 Mi out
    (256, 256, 256, "nn"),  # 33.6 MFLOP, 64 Ki out: the same product stored as a forward one
    (2048, 8, 512, "nn"),  # 16.8 MFLOP, 1 Mi out
)


def dot_chain(m: int, k_dim: int, n: int, form: str, k: int, with_dot: bool) -> Callable[..., Any]:
    """k dependent products per device on all 8 devices at once, each on a fresh left operand that reads a scalar of
    the last result (added, then ``optimization_barrier``: the add is a kernel of its own, not fused into the dot);
    ``with_dot`` False: the same chain with no product (the add and the read alone, subtracted)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    contract = ((0,), (0,)) if form == "tn" else ((1,), (0,))

    def body(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        acc = jnp.zeros((), lhs.dtype)
        for _ in range(k):
            a = jax.lax.optimization_barrier(lhs + acc * 1e-6)
            if with_dot:
                y = jax.lax.dot_general(a, rhs, (contract, ((), ())))
                acc = jax.lax.optimization_barrier(y)[0, 0]
            else:
                acc = a[0, 0]
        return acc[None]

    del m, k_dim, n  # the shapes come from the arguments; kept in the signature for the cache key's readability
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P("d")))


def _dot_law_fit(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Least squares, relative (each row weighted by 1/time), of the two laws a dot's time could follow beyond a fixed
    cost: ``sum`` (FLOPs / rate + out_elements * per_element) and ``max`` (the larger of the two; per_element
    scanned, rate fitted at each), with each law's worst relative residual: which one the measurement picks."""
    import numpy as np

    t = np.array([r["per_op_s"] for r in rows])
    f = np.array([float(r["flops"]) for r in rows])
    e = np.array([float(r["out_elements"]) for r in rows])
    w = 1.0 / t
    a = np.stack([np.ones_like(f), f, e], axis=1) * w[:, None]
    (c0, per_flop, per_el), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    fit_sum = c0 + per_flop * f + per_el * e
    best = (float("inf"), 0.0, 0.0, 0.0)  # (worst relative residual, overhead, per FLOP, per element)
    for per_el_max in np.geomspace(1e-12, 1e-7, 121):
        for per_flop_max in np.geomspace(1e-13, 1e-9, 121):
            pred = np.maximum(per_flop_max * f, per_el_max * e)
            c = float(np.median(t - pred))
            err = float(np.max(np.abs(c + pred - t) / t))
            if err < best[0]:
                best = (err, c, float(per_flop_max), float(per_el_max))
    return {
        "sum": {
            "overhead_s": float(c0),
            "flops_per_s": float(1 / per_flop) if per_flop > 0 else None,
            "s_per_out_element": float(per_el),
            "max_rel_residual": float(np.max(np.abs(fit_sum - t) / t)),
        },
        "max": {
            "overhead_s": best[1],
            "flops_per_s": 1 / best[2],
            "s_per_out_element": best[3],
            "max_rel_residual": best[0],
        },
    }


def dot_sweep(repeats: int, rounds: int) -> dict[str, Any]:
    """Per product of ``DOT_SHAPES``, one product's time on each of 8 busy devices (the chain's slope over
    ``SWEEP_CHAIN`` minus the same chain's without the product), every configuration once per round, rotated; then
    the two laws' fits (``_dot_law_fit``): what XLA:CPU spends on a dot per FLOP and per element it writes, the
    weight gradient's product (small result, long contraction) beside the activation's (large result, short one)."""
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    fns: dict[tuple[Any, ...], Callable[..., Any]] = {}
    args: dict[tuple[int, int, int, str], tuple[jax.Array, jax.Array]] = {}
    for m, kd, n, form in DOT_SHAPES:
        lhs_shape = (kd, m) if form == "tn" else (m, kd)
        lhs = jax.device_put(jnp.ones((8 * lhs_shape[0], lhs_shape[1]), jnp.float32), NamedSharding(mesh, P("d")))
        rhs = jax.device_put(jnp.ones((8 * kd, n), jnp.float32), NamedSharding(mesh, P("d")))
        args[(m, kd, n, form)] = (lhs, rhs)
        for with_dot in (True, False):
            for k in SWEEP_CHAIN:
                fn = dot_chain(m, kd, n, form, k, with_dot)
                jax.block_until_ready(fn(lhs, rhs))  # compile outside the timing
                fns[(m, kd, n, form, with_dot, k)] = fn
    samples: dict[tuple[Any, ...], list[float]] = {key: [] for key in fns}
    keys = list(fns)
    for r in range(rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:  # rotated: a burst of load hits all alike
            samples[key].append(median_time(fns[key], *args[key[:4]], n=repeats))
    rows = []
    span = SWEEP_CHAIN[1] - SWEEP_CHAIN[0]
    for m, kd, n, form in DOT_SHAPES:
        per = {
            d: (
                statistics.median(samples[(m, kd, n, form, d, SWEEP_CHAIN[1])])
                - statistics.median(samples[(m, kd, n, form, d, SWEEP_CHAIN[0])])
            )
            / span
            for d in (True, False)
        }
        rows.append(
            {
                "m_k_n": [m, kd, n],
                "form": form,
                "flops": 2 * m * kd * n,
                "out_elements": m * n,
                "per_op_s": per[True] - per[False],
                "baseline_per_step_s": per[False],
            }
        )
    reliable = all(r["per_op_s"] > 0 for r in rows)
    return {"ops": rows, "fits": _dot_law_fit(rows) if reliable else None, "reliable": reliable}


def collective_shape(rows: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One all-reduce's time over 2, 4 and 8 devices fitted as ``overhead + latency * hops`` (hops = 2 (n - 1)):
    the part every collective pays whatever its ring (``Profile.collective_overhead``) and the part per ring step
    (``Profile.latency``)."""
    hops = tuple(2 * (n - 1) for n in rows)
    times = [rows[n]["per_step_s"] for n in rows]
    per_hop = least_squares_slope(hops, times)
    return {
        "collective_overhead_s": statistics.mean(times) - per_hop * statistics.mean(hops),
        "latency_per_hop_s": per_hop,
        "reliable": all(rows[n]["reliable"] for n in rows) and per_hop > 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15, help="runs per median")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the chain lengths")
    parser.add_argument("--sweep", action="store_true", help="also the op-size sweep (dots, elementwise, reductions)")
    parser.add_argument(
        "--groups", action="store_true", help="only the collective sweep by kind and group size (group_sweep)"
    )
    parser.add_argument(
        "--dots", action="store_true", help="only the dot sweep: FLOPs against result elements (dot_sweep)"
    )
    a = parser.parse_args()
    out: dict[str, Any] = {
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_before": os.getloadavg(),
    }
    if a.dots:
        out["dots"] = dot_sweep(a.repeats, a.rounds)
        out["load_after"] = os.getloadavg()
        print(json.dumps(out, indent=1))
        return
    if a.groups:
        out["groups"] = group_sweep(a.repeats, a.rounds)
        out["load_after"] = os.getloadavg()
        print(json.dumps(out, indent=1))
        return
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    x = jax.device_put(jnp.ones((8, 256), jnp.float32), NamedSharding(mesh, P(("data", "model"))))
    by_group: dict[int, dict[str, Any]] = {}
    for n, axes in ((2, "model"), (4, "data"), (8, ("data", "model"))):
        row = fit_chain(mesh, x, axes, a.repeats, a.rounds)
        row["per_ring_step_s"] = row["per_step_s"] / (2 * (n - 1))
        out[f"allreduce_{n}dev_1KiB"] = by_group[n] = row
    out["allreduce_shape"] = collective_shape(by_group)
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
    if a.sweep:
        out["sweep"] = sweep(max(3, a.repeats // 2), a.rounds)
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
