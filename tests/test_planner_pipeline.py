"""Pipeline candidates in einshard.plan: costed with pipeline_info's schedule model, chosen where memory forces it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

import einshard
from einshard._src.planner.pipelines import PipelineSearch
from einshard.errors import EinshardError

MESH = {"data": 4, "model": 2}
# Adam state in every run: objective="memory" would otherwise count none, and budgets are compared across runs.
KW = dict(mesh=MESH, profile="h100", optimizer_bytes_per_param=8.0)


def stacked_mlp(layers=4, d=32, f=64, batch=64, seq=64):
    """Activation-heavy: a long sequence through a stack of residual MLP layers under lax.scan."""
    params = {
        "layers": {
            "w1": jax.ShapeDtypeStruct((layers, d, f), jnp.float32),
            "w2": jax.ShapeDtypeStruct((layers, f, d), jnp.float32),
        }
    }
    x = jax.ShapeDtypeStruct((batch, seq, d), jnp.float32)

    def loss(p, x):
        def body(h, w):
            return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None

        h, _ = jax.lax.scan(body, x, p["layers"])
        return jnp.mean(h**2)

    return jax.value_and_grad(loss), params, x


@pytest.mark.slow
def test_pipeline_loses_without_a_memory_constraint():
    step, params, x = stacked_mlp()
    r = einshard.plan(step, params, x, **KW, pipeline=PipelineSearch(x))
    assert r.pipeline is None
    pipes = [a for a in r.alternatives if a.label.startswith("pipeline")]
    assert {a.label.split()[1] for a in pipes} == {"gpipe", "circular", "1f1b", "interleaved"}
    assert all(a.time_s > r.time_s for a in pipes)  # the bubble and the permutes cost time


@pytest.mark.slow
def test_pipeline_wins_where_only_it_meets_the_budget():
    step, params, x = stacked_mlp()
    least = einshard.plan(step, params, x, **KW, objective="memory")
    search = PipelineSearch(x)
    low = einshard.plan(step, params, x, **KW, objective="memory", pipeline=search)
    assert low.pipeline is not None and low.memory_bytes < least.memory_bytes
    budget = (low.memory_bytes + least.memory_bytes) // 2  # no jit layout fits it, a pipeline does
    r = einshard.plan(step, params, x, **KW, memory_budget=budget, pipeline=search)
    assert r.fits and r.pipeline is not None and r.memory_bytes <= budget
    assert any(k != "batch" and v.startswith("pipeline(") for k, v in r.strategies.items())
    stage = r.pipeline.candidate.stage_axis
    assert all(e.split("->")[1].split()[0] == f"l@{stage}" for e in r.rules.values())
    # the same budget without pipelines: nothing fits
    assert not einshard.plan(step, params, x, **KW, memory_budget=budget).fits


@pytest.mark.slow
def test_tight_activation_budget_chooses_1f1b():
    step, params, x = stacked_mlp()
    only = einshard.plan(step, params, x, **KW, objective="memory", pipeline=PipelineSearch(x, schedules=("1f1b",)))
    assert only.pipeline is not None
    others = PipelineSearch(x, schedules=("gpipe", "circular", "interleaved"))
    rest = einshard.plan(step, params, x, **KW, objective="memory", pipeline=others)
    assert only.memory_bytes < rest.memory_bytes  # 1F1B stashes about S micro-batches, GPipe all M
    r = einshard.plan(step, params, x, **KW, memory_budget=only.memory_bytes, pipeline=PipelineSearch(x))
    assert r.fits and r.pipeline is not None and r.pipeline.candidate.schedule == "1f1b"
    assert r.pipeline.candidate.pipeline_kwargs()["schedule"] == "1f1b"
    info = einshard.pipeline_info(params, x, mesh=MESH, **r.pipeline.candidate.pipeline_kwargs())
    assert info.activation_bytes == r.pipeline.info.activation_bytes


def test_pipeline_search_needs_stacked_layers_and_valid_options():
    with pytest.raises(EinshardError, match="schedule"):
        PipelineSearch(jax.ShapeDtypeStruct((8, 4), jnp.float32), schedules=("zigzag",))
    with pytest.raises(EinshardError, match="leading batch axis"):
        PipelineSearch(3)
    params = {"w": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    x = jax.ShapeDtypeStruct((16, 8), jnp.float32)
    step = jax.value_and_grad(lambda p, x: jnp.mean((x @ p["w"]) ** 2))
    with pytest.raises(EinshardError, match="stacked layers"):
        einshard.plan(step, params, x, **KW, pipeline=PipelineSearch(x))


def test_a_pipeline_chosen_on_explicit_axes_says_jax_refuses_the_step_as_written():
    """On Explicit axes (jax.make_mesh's default) the pipeline's layout is traced typed as the jit path's choice is:
    JAX refuses the step as written with the layers split over the stage axis (lax.scan takes only an unsplit
    leading axis), and the plan says so on its first line, in its warning and its explanation, with JAX's own
    error; the pipeline itself, einshard.pipeline with the plan's arguments, runs there to the step's numbers."""
    step, shapes, xs = stacked_mlp()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    options = dict(profile="h100", optimizer_bytes_per_param=8.0, objective="memory", pipeline=PipelineSearch(xs))
    r = einshard.plan(step, shapes, xs, mesh=mesh, verify=0, **options)
    assert r.pipeline is not None
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.1, s.dtype), shapes)
    x = jnp.asarray(rng.standard_normal(xs.shape), xs.dtype)
    placed_p, placed_x = r.place(params, x, mesh=mesh)
    with jax.set_mesh(mesh), pytest.raises(Exception) as raised:
        jax.jit(step)(placed_p, placed_x)  # what JAX does with the step as written, laid out as planned
    jax_says = f"{type(raised.value).__name__}: {str(raised.value).splitlines()[0]}"
    assert r.needs_auto_axes.startswith(jax_says) and "test_planner_pipeline.py:" in r.needs_auto_axes
    assert "NEEDS jax.sharding.auto_axes" in str(r).splitlines()[0] and r.needs_auto_axes in r.warning
    assert "einshard.pipeline(layer_fn, params, x, **plan.pipeline.candidate.pipeline_kwargs())" in r.explanation
    assert r.to_dict()["needs_auto_axes"] == r.needs_auto_axes

    def layer(w, h):
        return h + jnp.tanh(h @ w["w1"]) @ w["w2"]

    def piped(p, x):
        return jnp.mean(
            einshard.pipeline(layer, p["layers"], x, mesh=mesh, **r.pipeline.candidate.pipeline_kwargs()) ** 2
        )

    with jax.set_mesh(mesh):
        loss, grads = jax.jit(jax.value_and_grad(piped))(placed_p, placed_x)
    ref_loss, ref_grads = step(params, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(g, ref, rtol=1e-4, atol=1e-7)
    # On Auto axes (and from sizes) the step as written runs the layout: nothing of the kind is said.
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    for on in (auto, MESH):
        untyped = einshard.plan(step, shapes, xs, mesh=on, verify=0, **options)
        assert untyped.pipeline is not None and not untyped.needs_auto_axes
        assert "NEEDS" not in str(untyped) and "Explicit" not in untyped.explanation
