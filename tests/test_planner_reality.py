"""The planner measured against XLA: on the demo's transformer and a Flax NNX transformer, on a (4, 2) mesh.

Each hand-written preset (dp, fsdp, tp, hybrid, fsdp-tp, written for that
model as a practitioner would) and the plan are compiled with ``jax.jit``
(gradients returned laid out like the parameters) and XLA's own numbers are
read: bytes sent per device (summed over the HLO collectives) and FLOPs per
device (``cost_analysis``).  The criterion, by XLA's count: **no preset beats
the plan on both** (at most its FLOPs and at most its bytes, one strictly).

Why not "the plan's bytes ≤ every preset's": a layout that replicates the
batch sends nothing and computes everything on every device; bytes alone
would reward it.  The FLOPs say what that costs.
"""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType

import einshard

pytest.importorskip("flax")

import planner_models as pm  # noqa: E402

AUTO = dict(axis_types=(AxisType.Auto, AxisType.Auto))


def dominated_by(step, params, batch, presets, result, mesh):
    """The presets that beat the plan on both of XLA's counts, with the numbers."""
    plan_xla = pm.compiled_costs(step, params, batch, result.rules, pm.data_rule(result), mesh)
    beaten = []
    for name, (prules, brule) in presets.items():
        xla = pm.compiled_costs(step, params, batch, prules, brule, mesh)
        no_worse = xla["flops"] <= plan_xla["flops"] and xla["comm_bytes"] <= plan_xla["comm_bytes"]
        better = xla["flops"] < plan_xla["flops"] or xla["comm_bytes"] < plan_xla["comm_bytes"]
        if no_worse and better:
            beaten.append((name, xla["flops"], xla["comm_bytes"], plan_xla["flops"], plan_xla["comm_bytes"]))
    return beaten


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        "demo_transformer",
        pytest.param(
            "nnx_transformer",
            marks=pytest.mark.xfail(
                strict=True,
                reason="explain prices the NNX hybrid layout at 1.4 MiB sent where XLA sends 0.59 MB, and a "
                "batch-over-model × TP-over-data layout below it; the plan (55 MFLOP, 0.595 MB) loses to hybrid "
                "(30 MFLOP, 0.588 MB) by XLA's count (issue 10: explain's collectives on NNX models)",
            ),
        ),
    ],
)
def test_no_preset_beats_the_plan_on_both_flops_and_bytes(model):
    step, params, batch, presets = getattr(pm, model)()
    # planned on an Explicit mesh (jax.make_mesh's default; only shapes matter), compiled on an Auto one
    r = einshard.plan(step, params, batch, mesh=jax.make_mesh((4, 2), ("data", "model")), profile="cpu")
    mesh = jax.make_mesh((4, 2), ("data", "model"), **AUTO)
    assert dominated_by(step, params, batch, presets, r, mesh) == []


@pytest.mark.slow
def test_the_planned_layout_trains_like_one_device():
    """The plan's rules, placed and run: the same loss and gradients as the unsharded step."""
    import numpy as np

    step, params, batch, _ = pm.demo_transformer(batch=16)
    mesh = jax.make_mesh((4, 2), ("data", "model"), **AUTO)
    r = einshard.plan(step, params, batch, mesh=mesh, profile="cpu")
    placed_p, placed_b = r.place(params, batch, mesh=mesh)
    loss, grads = jax.jit(step)(placed_p, placed_b)
    ref_loss, ref_grads = step(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-6)
