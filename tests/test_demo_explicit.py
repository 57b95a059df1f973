"""The demo transformer on Explicit axes (``jax.make_mesh``'s default): the model says the layouts JAX cannot infer
(``out_sharding=`` on its lookups and matmuls, ``jax.sharding.reshard`` of the positions and the scanned layers,
``auto_axes`` around the target lookup in the split vocabulary), so JAX types its training step under every preset;
trained there, explained there and planned there, it gives the losses and layouts it gives on Auto axes."""

from __future__ import annotations

import jax
import numpy as np
import planner_models as pm
import pytest
from jax.sharding import AxisType

import einshard
from einshard_apps.demo import Trainer, load_corpus
from einshard_apps.models import transformer as tm
from einshard_apps.presets import PRESETS

CFG = tm.Config(layers=2, width=32, heads=8, ffn=64, seq=16)
JIT_PRESETS = ("dp", "fsdp", "tp", "hybrid", "fsdp-tp")  # the layouts jax.jit lays out (the others are shard_maps)
FAST = ("hybrid", "fsdp-tp")  # Megatron with the batch split, and the 2-D one: the most ops JAX refused


def typed_step_lowers(preset_name: str, mesh: jax.sharding.Mesh) -> None:
    """Trace and lower the demo's training step with its arguments typed by the preset on ``mesh``."""
    from einshard_apps.presets import expressions_for

    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tm.init(CFG, 0))
    preset = PRESETS[preset_name]
    exprs = expressions_for(params, preset.params)
    typed = jax.tree.map(
        lambda s, e: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=einshard.sharding(e, s.shape, mesh=mesh)),
        params,
        exprs,
    )
    shape = (8, CFG.seq + 1)
    batch = jax.ShapeDtypeStruct(shape, np.int32, sharding=einshard.sharding(preset.batch, shape, mesh=mesh))
    jax.jit(jax.value_and_grad(tm.loss_fn)).lower(typed, batch)


@pytest.mark.parametrize("name", JIT_PRESETS)
def test_jax_types_the_demo_step_under_every_preset(name):
    sizes = PRESETS[name].default_mesh(8)
    typed_step_lowers(name, jax.make_mesh(tuple(sizes.values()), tuple(sizes)))  # raises where JAX refuses an op
    report = einshard.check_explicit(
        jax.grad(tm.loss_fn),
        jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tm.init(CFG, 0)),
        jax.ShapeDtypeStruct((8, CFG.seq + 1), np.int32),
        mesh=sizes,
        in_specs=(PRESETS[name].params, PRESETS[name].batch),
    )
    assert report.ok, str(report)


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow) for n in JIT_PRESETS])
def test_a_preset_trains_on_explicit_axes_to_the_loss_it_has_on_auto_axes(name):
    preset, corpus = PRESETS[name], load_corpus()
    runs = {}
    for explicit in (False, True):
        t = Trainer(preset, preset.default_mesh(8), CFG, corpus, batch=8, explicit_axes=explicit)
        assert set(t.mesh.axis_types) == {AxisType.Explicit if explicit else AxisType.Auto}
        runs[explicit] = ([t.step() for _ in range(3)], t.state)
    np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=2e-6, atol=2e-6)
    for typed, untyped in zip(jax.tree.leaves(runs[True][1]), jax.tree.leaves(runs[False][1])):
        assert typed.sharding.spec == untyped.sharding.spec  # the state stays laid out as the preset says


@pytest.fixture(scope="module")
def demo():
    return pm.demo_transformer(batch=16)


@pytest.mark.parametrize("name", JIT_PRESETS)
def test_explain_on_explicit_axes_finds_nothing_jax_refuses(demo, name):
    step, params, batch, presets = demo
    report = einshard.explain(
        step, params, batch, mesh=jax.make_mesh((4, 2), ("data", "model")), in_specs=presets[name]
    )
    assert report.explicit is None or not report.explicit.findings
    assert not str(report).startswith("REFUSED")


def test_the_plan_on_explicit_axes_refuses_no_candidate_and_runs_to_the_auto_loss(demo):
    step, params, batch, presets = demo
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    r = einshard.plan(step, params, batch, mesh=mesh, profile="cpu", verify=3, presets=presets)
    assert r.verification and not any(v.refused for v in r.verification), [(v.label, v.refused) for v in r.verification]
    assert not r.needs_auto_axes and all(v.compiled_axes == "the mesh's" for v in r.verification)
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    losses = {}
    for on in (mesh, auto):
        placed_p, placed_b = r.place(params, batch, mesh=on)
        with jax.set_mesh(on):
            loss, grads = jax.jit(step)(placed_p, placed_b)
        losses[on] = float(loss)
    ref_loss, _ = step(params, batch)
    assert losses[mesh] == pytest.approx(losses[auto], rel=1e-6) == pytest.approx(float(ref_loss), rel=1e-5)
