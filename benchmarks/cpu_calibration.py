"""What a collective and a matrix product cost on this host's simulated CPU devices: the `cpu` profile's numbers.

    python benchmarks/cpu_calibration.py

Prints, as JSON: the host's usable cores and load average, the time of an all-reduce over 2, 4 and 8 simulated
devices (4 KiB, 1 MiB, 16 MiB; the same program without the collective subtracted), and f32 matrix-product FLOP/s
per device (and for the host) with 1, 2, 4 and 8 devices busy at once.
Measured 2026-11-26: on this project's 2-core machine a 4 KiB all-reduce costs 70-130 µs (~45 µs per ring step),
on an idle 16-core host 10-65 µs (~5 µs per ring step); matmul 9 GFLOP/s per device with 8 busy on 2 cores,
190 on 16.  ``einshard.analysis.PROFILES['cpu']`` takes 20 µs per step between them (see its comment).
With 1, 2, 4, 8 devices busy on the 2-core machine (load average 5): 89, 86, 22, 8.7 GFLOP/s per device, 89, 172,
88, 69 for the host: the devices share the cores, what ``Profile.host_cores`` models (``flops · cores / devices``
each once devices outnumber cores).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import json
import statistics
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def med(f, *a, n=50):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


out = {
    "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
    "load": os.getloadavg(),
}
for ndev in (2, 4, 8):
    mesh = jax.make_mesh((ndev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ndev])
    for nbytes in (4096, 1 << 20, 16 << 20):
        n = nbytes // 4
        x = jax.device_put(jnp.ones((ndev, n), jnp.float32), NamedSharding(mesh, P("x", None)))
        f = jax.jit(lambda a: jnp.sum(a, 0), out_shardings=NamedSharding(mesh, P()))  # all-reduce of n floats
        g = jax.jit(lambda a: a * 2)  # no collective, same launch overhead
        out[f"allreduce_{ndev}dev_{nbytes}B_s"] = med(f, x) - med(g, x)
# Matmul FLOP/s per device with 1, 2, 4 and 8 of the simulated devices busy (one k x k product each, in one
# program over a mesh of that many devices): whether the devices share the host's cores (FLOP/s per device falls
# as more are busy, once there are more busy devices than cores) or each has its own.
k = 512
for ndev in (1, 2, 4, 8):
    mesh = jax.make_mesh((ndev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:ndev])
    a = jax.device_put(jnp.ones((ndev * k, k), jnp.float32), NamedSharding(mesh, P("x", None)))
    b = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(mesh, P()))
    t = med(jax.jit(lambda a, b: a @ b), a, b)
    out[f"matmul_flops_per_device_{ndev}_busy"] = 2 * k**3 / t
    out[f"matmul_flops_host_{ndev}_busy"] = ndev * 2 * k**3 / t
print(json.dumps(out, indent=1))
