"""The ``cpu`` profile knows that simulated devices share the host's cores (issue 20: the profile of the machine
that runs the step).

Eight simulated CPU devices run as threads of one process: on 2 cores they take turns, so a layout that computes
the whole step on every device costs 8x data parallel's FLOPs in wall time, not the same time "in parallel"
(benchmarks/cpu_calibration.py measures a matmul's FLOP/s per device with 1, 2, 4 and 8 devices busy).  The core
counts are given explicitly here (``host_cores=``) or mocked, so these tests do not depend on the host they run on.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import pytest

import einshard
from einshard._src.analysis.cost import PROFILES, Profile, cpu_profile, host_cores, shared_profile
from einshard._src.planner.scoring import repriced_comm_s, unwalked_compute_s
from einshard.errors import EinshardError
from einshard.placement import MeshAxis
from einshard.targets import parse_target

f32 = jnp.float32


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, f32)


def cpu_on(cores: int | None) -> Profile:
    return dataclasses.replace(PROFILES["cpu"], host_cores=cores)


# --- the profile ------------------------------------------------------------------------------------------------


def test_host_cores_is_the_process_affinity(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert host_cores() == 2  # a container limited to 2 of the machine's 64 cores


def test_host_cores_without_affinity_is_the_cpu_count(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)  # macOS, Windows
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert host_cores() == 16
    monkeypatch.setattr(os, "cpu_count", lambda: None)  # undeterminable: one core, never zero
    assert host_cores() == 1


def test_the_cpu_profile_is_this_hosts():
    assert PROFILES["cpu"].host_cores == host_cores()
    # accelerators compute on their own hardware: no sharing
    assert all(PROFILES[k].host_cores is None for k in ("h100", "tpu-v5p"))
    assert parse_target("tpu:v5p:4x4x4").profile.host_cores is None


@pytest.mark.parametrize(
    "cores, devices, share",
    [(2, 8, 2 / 8), (2, 4, 2 / 4), (2, 2, 1.0), (2, 1, 1.0), (16, 8, 1.0), (8, 8, 1.0), (3, 8, 3 / 8)],
)
def test_devices_beyond_the_cores_share_their_flops(cores, devices, share):
    p = cpu_on(cores)
    q = p.on_devices(devices)
    assert q.flops == pytest.approx(p.flops * share, rel=1e-12)
    assert q.compute_time(1e9) == pytest.approx(1e9 / (p.flops * share), rel=1e-12)
    if share == 1.0:
        assert q is p
    else:
        # the sharing is in the flops: the result is not shared again, and keeps its name (the combiner's key)
        assert q.host_cores is None and q.on_devices(devices) is q and q.name == p.name
        assert (q.bandwidth, q.latency, q.narrow_floats) == (p.bandwidth, p.latency, p.narrow_floats)


def test_no_host_cores_means_no_sharing():
    p = cpu_on(None)
    assert p.on_devices(64) is p and PROFILES["h100"].on_devices(8) is PROFILES["h100"]


def test_shared_profile_counts_the_meshs_devices():
    mesh = (MeshAxis("data", 4), MeshAxis("model", 2))
    assert shared_profile(cpu_on(2), mesh).flops == pytest.approx(PROFILES["cpu"].flops / 4)
    assert shared_profile(cpu_on(2), mesh[1:]) is not None and shared_profile(cpu_on(2), mesh[1:]).flops == 1e11
    assert shared_profile("h100", mesh) is PROFILES["h100"]


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "2"])
def test_host_cores_must_be_a_count(bad):
    with pytest.raises(EinshardError, match=r"host_cores= takes a number of cores >= 1 or None, got"):
        Profile("x", flops=1e11, bandwidth=1e10, latency=1e-6, host_cores=bad)


def test_the_cpu_profile_is_built_from_the_mocked_host(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)), raising=False)
    p = cpu_profile()
    assert p.host_cores == 3 and p.on_devices(8).flops == pytest.approx(1e11 * 3 / 8)
    assert cpu_profile(16).on_devices(8) is not None and cpu_profile(16).on_devices(8).flops == 1e11
    assert dataclasses.replace(cpu_profile(), host_cores=PROFILES["cpu"].host_cores) == PROFILES["cpu"]


# --- explain and plan price it ----------------------------------------------------------------------------------


def mlp_loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w0"]) @ p["w1"]) ** 2)


def test_explain_prices_compute_on_the_shared_cores():
    """One 8-device step: its compute takes 4x as long on 2 cores as on 8; a 2-device mesh fits 2 cores."""
    B, D, F = 256, 64, 128
    params, x = {"w0": sds(D, F), "w1": sds(F, D)}, sds(B, D)
    step = jax.value_and_grad(mlp_loss)
    flops = 5 * 2 * B * D * F  # two forward matmuls, dW1, dH, dW0; replicated: every device computes them all
    for mesh, share in (({"data": 8}, 2 / 8), ({"data": 2}, 1.0)):
        reports = {
            cores: einshard.explain(
                step, params, x, mesh=mesh, in_specs=({"w0": None, "w1": None}, None), profile=cpu_on(cores)
            )
            for cores in (None, 2)
        }
        assert reports[None].flops == reports[2].flops == flops
        comm = {c: sum(op.time_s * op.repeat for op in r.ops) - r.flops / r.profile.flops for c, r in reports.items()}
        assert reports[2].profile.flops == pytest.approx(1e11 * share)
        assert reports[2].time_s - reports[None].time_s == pytest.approx(flops / (1e11 * share) - flops / 1e11)
        assert comm[2] == pytest.approx(comm[None], abs=1e-12)  # the collectives are priced alike


def test_a_layout_doing_8x_the_flops_is_not_ranked_first_on_2_cores():
    """A step small enough that, each device on its own core, replicating everything (8x data parallel's FLOPs,
    no collective) is the cheapest layout; on 8 simulated devices over 2 cores its compute dominates and a
    split layout wins."""
    B, D, F = 64, 64, 128
    params, x = {"w0": sds(D, F), "w1": sds(F, D)}, sds(B, D)
    step = jax.value_and_grad(mlp_loss)
    replicated = ({".*": "x y -> x y"}, "b d -> b d")
    full = 5 * 2 * B * D * F
    plans = {
        cores: einshard.plan(
            step,
            params,
            x,
            mesh={"data": 4, "model": 2},
            profile=cpu_on(cores),
            verify=0,
            presets={"replicated": replicated},
        )
        for cores in (8, 2)
    }
    alone, shared = plans[8], plans[2]
    # each device on its own core: the whole step everywhere is the plan (its compute, exactly the full step's FLOPs
    # and the kernel and element prices the walk leaves out: scoring.unwalked_compute_s)
    assert alone.compute_s == pytest.approx(full / 1e11 + unwalked_compute_s(alone.report)) and alone.comm_bytes == 0
    rep = {c: next(a for a in p.alternatives if a.label == "preset replicated") for c, p in plans.items()}
    assert rep[2].compute_s == pytest.approx(4 * rep[8].compute_s)  # 8 devices taking turns on 2 cores
    # on 2 cores: not the replicated layout, and faster than it by the model
    assert shared.compute_s < rep[2].compute_s and shared.time_s < rep[2].time_s
    assert any(e != "x y -> x y" for e in shared.rules.values()) or shared.data_rules[0] != alone.data_rules[0]


@pytest.mark.parametrize(("cores", "devices"), [(2, 8), (4, 8), (2, 2)])
def test_the_small_op_prices_are_shared_like_the_flops(cores, devices):
    """A kernel's fixed cost and the elementwise work take turns on the cores as the FLOPs do: each device's
    share of the host stretches them by devices / cores (no change while every device has a core)."""
    p = cpu_profile(cores, small_ops=True)
    q = p.on_devices(devices)
    stretch = max(1.0, devices / cores)
    assert q.op_overhead == pytest.approx(p.op_overhead * stretch) and q.op_overhead > 0
    assert q.element_time == pytest.approx(p.element_time * stretch) and q.element_time > 0
    assert q.flops == pytest.approx(p.flops / stretch)


def test_the_default_cpu_profile_prices_small_ops_and_flops_only_is_the_option():
    """The default ``cpu`` profile prices the work FLOPs miss and collectives as XLA:CPU runs them (session 19:
    the planned layouts' measured step times, benchmarks/results/plan_prediction.json); ``small_ops=False`` is the
    FLOPs-and-ring-hops profile of sessions 1-18."""
    default, flops_only = cpu_profile(2), cpu_profile(2, small_ops=False)
    assert default == cpu_profile(2, small_ops=True) and PROFILES["cpu"] == cpu_profile()
    assert default.combined_latency == "per_piece" and default.element_time > 0 and default.op_overhead > 0
    assert default.collective_overhead > 0 and default.latency_steps == "peers"
    undone = dict(
        op_overhead=0.0, element_time=0.0, combined_latency="once", collective_overhead=0.0, latency_steps="ring"
    )
    assert dataclasses.replace(default, latency=flops_only.latency, **undone) == flops_only


@pytest.mark.parametrize("field", ["op_overhead", "element_time"])
@pytest.mark.parametrize("bad", [-1e-6, float("nan"), float("inf")])
def test_the_small_op_prices_must_be_finite_and_not_negative(field, bad):
    with pytest.raises(EinshardError, match=field):
        dataclasses.replace(PROFILES["cpu"], **{field: bad})


def test_a_collectives_fixed_part_is_paid_once_whatever_its_hops():
    """``collective_overhead``: each collective pays it once, over 2 devices or 8, on top of its hops and bytes."""
    base = Profile("x", flops=1e11, bandwidth=1e10, latency=7e-6)
    fixed = dataclasses.replace(base, collective_overhead=2.8e-5)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        for n in (2, 4, 8):
            t0 = base.collective_time(kind, n, 1024.0, 2048.0)
            assert fixed.collective_time(kind, n, 1024.0, 2048.0) == pytest.approx(t0 + 2.8e-5)
    assert fixed.collective_time("all-reduce", 1, 1024.0, 1024.0) == 0.0  # one device: no collective
    with pytest.raises(EinshardError, match="collective_overhead"):
        dataclasses.replace(base, collective_overhead=-1.0)


# --- what a collective's latency counts on XLA:CPU (latency_steps) -----------------------------------------------


def test_xla_cpu_runs_a_collective_over_two_axes_as_one_group_of_all_its_devices():
    """The compiled program the 'peers' count rests on: a sum over both axes of a (4, 2) mesh is one all-reduce
    whose replica group holds all 8 devices (XLA:CPU's rendezvous of 8 threads, 7 peers each), not a pass over a
    4-ring and one over a 2-ring (the 'ring' count: 3 + 1 hops per pass)."""
    from jax.sharding import PartitionSpec as P

    from einshard.testing import hlo

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    f = jax.shard_map(
        lambda y: jax.lax.psum(y, ("data", "model")), mesh=mesh, in_specs=P(("data", "model")), out_specs=P()
    )
    text = jax.jit(f).lower(jax.ShapeDtypeStruct((8 * 256,), f32)).compile().as_text()
    ops = hlo.collectives(text)
    assert [(c.kind, c.group_size) for c in ops] == [("all-reduce", 8)]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_under_peers_every_kind_pays_the_groups_peers_whatever_its_axes(n):
    """``latency_steps='peers'`` (measured on XLA:CPU, benchmarks/cpu_calibration.py --groups: an all-reduce, an
    all-gather and a reduce-scatter over one group take the same time, and a group over two mesh axes that of one
    group of as many devices): n - 1 latencies for every kind, over one axis or two."""
    p = cpu_profile(2, small_ops=True)
    assert p.latency_steps == "peers"
    axes = {2: (2,), 4: (4,), 8: (4, 2)}[n]
    expected = p.collective_overhead + p.latency * (n - 1)
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert p.collective_time(kind, n, 0.0, 0.0, axes) == pytest.approx(expected)
        assert p.collective_time(kind, n, 0.0, 0.0) == pytest.approx(expected)  # one axis of n: the same
    assert p.collective_time("all-reduce", n, 1e6, 2e6, axes) == pytest.approx(expected + 1e6 / p.bandwidth)
    assert p.collective_time("collective-permute", n, 0.0, 0.0) == pytest.approx(p.collective_overhead + p.latency)


def test_the_peers_prices_follow_the_measured_group_sizes():
    """The measured law (cpu_calibration.py --groups, 2026-11-27, load 3-6: 41-50, 73-94, 124-153 µs over 2, 4, 8
    devices, every kind, 1-32 KiB): a 4-device collective ~1.7-1.9x a 2-device one, an 8-device one ~2.8-3.1x.
    The ring count priced a 4-device all-reduce at 3x a 2-device one (hops only) and the two-axis 8 at 2x."""
    p = cpu_profile(2, small_ops=True)
    t = {n: p.collective_time("all-reduce", n, 0.0, 0.0, axes) for n, axes in ((2, (2,)), (4, (4,)), (8, (4, 2)))}
    assert 1.6 <= t[4] / t[2] <= 2.0 and 2.6 <= t[8] / t[2] <= 3.2


def test_accelerator_profiles_keep_the_ring_count():
    """GPU and TPU profiles: a ring pass per axis, twice for an all-reduce (the scaling book's law), unchanged."""
    for name in ("h100", "tpu-v5p"):
        p = PROFILES[name]
        assert p.latency_steps == "ring"
        assert p.collective_time("all-reduce", 8, 0.0, 0.0, (4, 2)) == pytest.approx(2 * 4 * p.latency)
        assert p.collective_time("all-gather", 8, 0.0, 0.0, (4, 2)) == pytest.approx(4 * p.latency)


def test_latency_steps_takes_ring_or_peers():
    with pytest.raises(EinshardError, match="latency_steps"):
        dataclasses.replace(PROFILES["cpu"], latency_steps="hops")


# --- the walk ranks on the ring count, the planner prices on the profile's law (Profile.walking / pricing) --------


def mlp_loss_mean(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


def test_the_walk_predicts_xlas_collectives_whatever_law_prices_them():
    """An MLP's data-parallel step with its batch over both axes of a (4, 2) mesh: XLA compiles one all-reduce over
    all 8 devices per sum (the loss, each weight gradient).  Walked on the peers law (30 us + 14 us per peer) the
    walk took the sums one axis at a time (5 all-reduces, 320 KiB: a 4-group and a 2-group, 116 us, priced cheaper
    than one 8-group, 128 us), a form XLA does not compile here; walked on the ring count it predicts XLA's, and the
    plan's time prices those collectives on the peers law."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard._src.analysis.program import trace
    from einshard.testing import hlo

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params = {"w1": sds(64, 256), "w2": sds(256, 64)}
    x = sds(256, 64)
    step = jax.value_and_grad(mlp_loss_mean)
    shard = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    compiled = (
        jax.jit(step, in_shardings=({"w1": shard(P()), "w2": shard(P())}, shard(P(("data", "model")))))
        .lower(params, x)
        .compile()
    )
    xla = hlo.normalized(compiled.as_text())
    in_specs = ({"w1": "x y -> x y", "w2": "x y -> x y"}, "b d -> b@(data,model) d")
    for profile in (cpu_profile(2), cpu_profile(2, small_ops=False)):
        report = trace(step, params, x, mesh=mesh, profile=profile).report(in_specs)
        walked = [(c.kind, c.group_size) for op in report.ops for c in op.collectives for _ in range(op.repeat)]
        assert sorted(walked) == sorted((c.kind, c.group_size) for c in xla for _ in range(c.runs)), profile
        assert report.comm_bytes == sum(c.sent_bytes * c.runs for c in xla)
        assert report.profile.latency_steps == "ring" and report.profile.pricing() == profile.on_devices(8)
    # The plan's price of those collectives: the peers law, each all-reduce 30 us + 7 peers' 14 us and its bytes.
    priced = cpu_profile(2).on_devices(8)
    report = trace(step, params, x, mesh=mesh, profile=cpu_profile(2)).report(in_specs)
    ring_s = sum(c.time * op.repeat for op in report.ops for c in op.collectives)
    peers_s = sum(
        op.repeat * priced.collective_time(c.kind, c.group_size, c.bytes, c.array_bytes)
        for op in report.ops
        for c in op.collectives
    )
    assert repriced_comm_s(report) == pytest.approx(peers_s - ring_s) and peers_s != pytest.approx(ring_s)


def test_a_profile_on_the_ring_count_walks_as_itself():
    for profile in (PROFILES["h100"], PROFILES["tpu-v5p"], cpu_profile(2, small_ops=False)):
        assert profile.walking() is profile and profile.pricing() is profile
    peers = cpu_profile(2)
    walking = peers.walking()
    assert walking.latency_steps == "ring" and walking.collective_overhead == 0.0 and walking.pricing() is peers
    assert walking.walking() is walking  # a walk's profile walked again (a typed step's re-walk) keeps its pricing
    assert shared_profile(peers, (MeshAxis("data", 4), MeshAxis("model", 2))).pricing() == peers.on_devices(8)
