"""``plan`` for the machine it runs on knows its accelerators' memory (issue 20: the profile of the machine that runs
the step is the default; so is its memory).

On a GPU/TPU ``memory_budget=None`` means what one device lets a program allocate (``memory_stats()['bytes_limit']``),
so a plan that does not fit on the user's GPU is never chosen; on a CPU there is still no limit (host memory is not a
device's).  The GPU is mocked here (tests run on CPU devices); benchmarks/gpu_check.py runs the same on a lent GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard._src.analysis.cost import default_profile
from einshard._src.planner import inputs

f32 = jnp.float32


class _FakeGPU:
    platform = "gpu"
    device_kind = "NVIDIA H200"

    def __init__(self, limit: int | None, raises: bool = False) -> None:
        self.limit, self.raises = limit, raises

    def memory_stats(self) -> dict[str, int] | None:
        if self.raises:
            raise RuntimeError("memory_stats is not implemented for this runtime")
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


def _mlp_step(params, batch):
    def loss(p):
        h = jnp.tanh(batch @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    return jax.value_and_grad(loss)(params)


PARAMS = {"w1": jax.ShapeDtypeStruct((512, 2048), f32), "w2": jax.ShapeDtypeStruct((2048, 512), f32)}
BATCH = jax.ShapeDtypeStruct((64, 512), f32)


def test_devices_memory_on_cpu_is_no_limit():
    assert inputs.devices_memory({"data": 4}) is None
    assert inputs.devices_memory(jax.make_mesh((8,), ("data",))) is None


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        ([_FakeGPU(80 * 2**30)], 80 * 2**30),
        ([_FakeGPU(None)], None),  # a runtime that reports no limit: no budget, not a guess
        ([_FakeGPU(80 * 2**30, raises=True)], None),
    ],
)
def test_devices_memory_reads_the_runtimes_limit(monkeypatch, devices, expected):
    monkeypatch.setattr(jax, "devices", lambda *a: devices)
    assert inputs.devices_memory({"data": 4}) == expected


def test_the_smallest_device_of_a_concrete_mesh_is_the_budget(monkeypatch):
    # A concrete mesh's devices: one GPU with less memory free to programs bounds them all.
    mesh = jax.sharding.Mesh(np.array([_FakeGPU(80 * 2**30), _FakeGPU(70 * 2**30)]), ("data",))
    from einshard._src.core import mesh as mesh_module

    monkeypatch.setattr(mesh_module, "resolve_mesh", lambda *a, **k: mesh)
    assert inputs.devices_memory(None) == 70 * 2**30


def test_plan_on_an_accelerator_is_budgeted_by_its_memory(monkeypatch):
    # The memory a mocked GPU reports is just under the bytes per device of the layout planned without a budget on
    # its profile: the plan must choose another layout that fits, the one memory_budget= would give, and name the
    # budget and the device's profile on its first line.
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGPU(2**40)])
    profile = default_profile()  # the mocked GPU's: 'h100 (for NVIDIA H200)'
    free = einshard.plan(_mlp_step, PARAMS, BATCH, mesh={"data": 8}, profile=profile)  # profile given: no budget
    assert free.memory_budget is None
    limit = int(free.memory_bytes * 0.99)
    assert any(a.memory_bytes <= limit for a in free.alternatives)  # the premise: a smaller layout exists
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGPU(limit)])
    planned = einshard.plan(_mlp_step, PARAMS, BATCH, mesh={"data": 8})
    given = einshard.plan(_mlp_step, PARAMS, BATCH, mesh={"data": 8}, profile=profile, memory_budget=limit)
    assert planned.memory_budget == limit and planned.fits and planned.memory_bytes <= limit
    layout = (planned.rules, planned.data_rules)
    assert layout != (free.rules, free.data_rules) and layout == (given.rules, given.data_rules)
    first = str(planned).splitlines()[0]
    assert "budget none" not in first and "NVIDIA H200" in first


def test_a_given_profile_or_budget_is_not_this_machines(monkeypatch):
    monkeypatch.setattr(jax, "devices", lambda *a: [_FakeGPU(2**20)])
    # profile= names other hardware: this machine's memory says nothing about it
    assert einshard.plan(_mlp_step, PARAMS, BATCH, mesh={"data": 8}, profile="h100").memory_budget is None
    # memory_budget= given wins
    given = einshard.plan(_mlp_step, PARAMS, BATCH, mesh={"data": 8}, memory_budget="1GiB")
    assert given.memory_budget == 2**30
