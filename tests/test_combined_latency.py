"""What a collective XLA's combiner merged costs on XLA:CPU: each piece its own latency (issue 20).

XLA's all-reduce combiner merges a data-parallel step's independent gradient all-reduces into one tuple-shaped op.
On a GPU or TPU that op is one collective (its latency paid once: ``Profile.combined_latency == 'once'``); XLA:CPU
runs each piece as a collective of its own (``'per_piece'``), measured on the minimal program below (benchmarks/
cpu_calibration.py: k independent sums merged into one all-reduce cost about k all-reduces alone, not one).  So
on a profile that says so the planner credits merging nothing and ``plan(verify=)`` prices each compiled piece.
(Not yet the ``cpu`` profile's default: see its comment in einshard/_src/analysis/cost.py.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.cost import PROFILES
from einshard._src.planner.scoring import repriced_comm_s, unwalked_compute_s
from einshard._src.planner.verify import read_compiled
from einshard.errors import EinshardError
from einshard.testing import hlo

# XLA:CPU's pricing (whatever host runs the test: a core per device), and the merged-op pricing GPUs and TPUs get.
CPU = dataclasses.replace(PROFILES["cpu"], host_cores=8, combined_latency="per_piece")
MERGING = dataclasses.replace(CPU, combined_latency="once")


def loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


PARAMS = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
BATCH = jax.ShapeDtypeStruct((256, 64), jnp.float32)
step = jax.value_and_grad(loss)


def dp_compiled():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    p = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P())) for k, v in PARAMS.items()}
    x = jax.ShapeDtypeStruct(BATCH.shape, BATCH.dtype, sharding=NamedSharding(mesh, P("data")))
    return jax.jit(step).lower(p, x).compile()


def test_the_cpu_profile_prices_each_piece_of_a_merged_collective():
    compiled = dp_compiled()
    pieces = hlo.normalized(compiled.as_text())
    # The loss and the two gradients' all-reduces, merged by XLA into one tuple op of three pieces.
    assert len({c.name for c in pieces}) == 1 and len(pieces) == 3
    each = sum(c.runs * CPU.collective_time(c.kind, c.group_size, c.sent_bytes, c.array_bytes) for c in pieces)
    assert read_compiled(compiled, CPU)[0] == pytest.approx(each)
    first = pieces[0]
    once = first.runs * CPU.collective_time(
        first.kind, first.group_size, sum(c.sent_bytes for c in pieces), sum(c.array_bytes for c in pieces)
    )
    assert read_compiled(compiled, MERGING)[0] == pytest.approx(once) and once < each


def test_the_planner_credits_merging_only_where_the_profile_merges():
    # The same data-parallel layout priced by the planner (the 'dp' preset) and by explain: priced per piece
    # they agree (every all-reduce its latency, as XLA:CPU runs them) but for what the planner adds to explain's
    # walk (the kernel and element prices, and the collectives priced on the profile's own law, not the ring count
    # the walk ranks on: scoring.unwalked_compute_s, repriced_comm_s); where a merged op pays once, the planner's
    # price is that less the latency, on the profile's law, of the two pieces merged away.
    kw = dict(mesh={"data": 8}, verify=0)
    in_specs = ({"w1": P(), "w2": P()}, P("data"))
    for profile, merged_away in ((CPU, 0), (MERGING, 2)):
        plan = einshard.plan(step, PARAMS, BATCH, profile=profile, **kw)
        dp = next(a for a in plan.alternatives if a.label == "preset dp")
        report = einshard.explain(step, PARAMS, BATCH, mesh={"data": 8}, in_specs=in_specs, profile=profile)
        alpha = report.profile.pricing().collective_time("all-reduce", 8, 0.0, 0.0)
        assert report.comm_count == 3
        walked = report.time_s + unwalked_compute_s(report) + repriced_comm_s(report)
        assert dp.time_s == pytest.approx(walked - merged_away * alpha)


def test_combined_latency_is_checked():
    with pytest.raises(EinshardError, match="combined_latency"):
        dataclasses.replace(CPU, combined_latency="twice")
