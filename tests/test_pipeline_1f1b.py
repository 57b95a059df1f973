"""1F1B and interleaved 1F1B: loss and every gradient equal the sequential model; the stash stays O(S), not O(M)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from pipeline_models import HI, D, assert_same, layer, loss_of, make, sequential

import einshard
from einshard._src.lowering.pipeline import pipeline, pipeline_info
from einshard._src.lowering.schedules import idle_fraction, one_f_one_b, render


def _mesh(shape, names, kind=AxisType.Auto):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(kind,) * len(shape), devices=jax.devices()[:n])


# (stages, data, microbatches, repeats): M < S, M = S, M > S, DP, interleaved
QUICK = [(2, 2, 3, 1), (4, 1, 2, 1), (2, 1, 2, 2), (4, 2, 8, 2)]
SLOW = [(1, 2, 2, 1), (2, 1, 1, 1), (4, 1, 4, 1), (4, 2, 6, 1), (8, 1, 9, 1), (2, 2, 4, 3), (4, 1, 4, 2)]
GRID = QUICK + [pytest.param(*cell, marks=pytest.mark.slow) for cell in SLOW]


@pytest.mark.parametrize("stages,data,microbatches,repeats", GRID)
def test_1f1b_equals_sequential(stages, data, microbatches, repeats):
    mesh = _mesh((stages, data), ("stage", "data"))
    params, x, target = make(stages * repeats * 2, data * microbatches * 2)
    want = loss_of(lambda p, x: sequential(layer, p, x))(params, x, target)
    kw = dict(microbatches=microbatches, schedule="1f1b", repeats=repeats, mesh=mesh, data_axis="data")
    assert_same(loss_of(lambda p, x: pipeline(layer, p, x, **kw))(params, x, target), want)
    # NaN in every unused buffer slot and message reaches neither the loss nor any gradient
    polluted = loss_of(lambda p, x: pipeline(layer, p, x, bubble_value=np.nan, **kw))(params, x, target)
    assert_same(polluted, want)


@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
@pytest.mark.parametrize("repeats", [1, 2])
def test_1f1b_tensor_parallel_stages_params_placed_first(kind, repeats):
    mesh = _mesh((2, 2, 2), ("stage", "data", "model"), kind)
    rng = np.random.default_rng(3)
    L, F = 2 * repeats * 2, 8
    params = {
        "w1": (rng.standard_normal((L, D, F)) / 2).astype(np.float32),
        "w2": (rng.standard_normal((L, F, D)) / 3).astype(np.float32),
        "b": (0.1 * rng.standard_normal((L, D))).astype(np.float32),  # replicated over 'model'
    }
    x = rng.standard_normal((8, D)).astype(np.float32)
    target = rng.standard_normal((8, D)).astype(np.float32)

    def mlp(p, h, reduce=lambda v: v):  # Megatron MLP: column- then row-parallel, one psum
        return h + reduce(jnp.dot(jnp.tanh(jnp.dot(h, p["w1"], precision=HI)), p["w2"], precision=HI)) + p["b"]

    def tp_mlp(p, h):
        return mlp(p, h, lambda v: jax.lax.psum(v, "model"))

    layouts = {
        "w1": "layer d f -> layer@stage d f@model",
        "w2": "layer f d -> layer@stage f@model d",
        "b": "layer d -> layer@stage d",
    }
    placed = {k: einshard.einshard(v, layouts[k], mesh=mesh) for k, v in params.items()}
    kw = dict(microbatches=2, schedule="1f1b", repeats=repeats, mesh=mesh, data_axis="data", param_layouts=layouts)
    with jax.set_mesh(mesh):
        got = loss_of(lambda p, x: pipeline(tp_mlp, p, x, **kw))(placed, x, target)
    want = loss_of(lambda p, x: sequential(mlp, p, x))(params, x, target)
    assert_same(got, want)


def _temp_bytes(stages, microbatches, schedule, width=64, rows=8):
    mesh = _mesh((stages,), ("stage",))
    params = {"w": jnp.zeros((stages * 2, width, width)), "b": jnp.zeros((stages * 2, width))}
    x = jnp.zeros((microbatches * rows, width))

    def loss(p, x):
        return jnp.sum(pipeline(layer, p, x, microbatches=microbatches, schedule=schedule, mesh=mesh) ** 2)

    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(params, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, rows * width * 4


def test_1f1b_peak_memory_below_gpipe():
    # XLA's own numbers for the whole training step (jit of grad), per device, M = 4 > S = 2.
    assert _temp_bytes(2, 4, "1f1b")[0] < _temp_bytes(2, 4, "gpipe")[0]


@pytest.mark.slow
def test_1f1b_peak_memory_grows_with_stages_not_microbatches():
    for stages in (2, 4):
        small, mb = _temp_bytes(stages, 2 * stages, "1f1b")
        large, _ = _temp_bytes(stages, 4 * stages, "1f1b")
        g_small, _ = _temp_bytes(stages, 2 * stages, "gpipe")
        g_large, _ = _temp_bytes(stages, 4 * stages, "gpipe")
        assert small < g_small and large < g_large  # M > S: below GPipe's
        extra = 2 * stages  # micro-batches added
        # GPipe keeps every layer input of every extra micro-batch; 1F1B only the extra rows of the
        # input-cotangent buffer (one micro-batch each, two allowed for copies), no activations.
        assert g_large - g_small > 3 * extra * mb
        assert large - small <= 2 * extra * mb
    s2, _ = _temp_bytes(2, 8, "1f1b")
    s4, _ = _temp_bytes(4, 8, "1f1b")
    assert s4 > s2  # the stash grows with the stages (per-device params are equal: 2 layers per stage)


def test_tick_tables_and_info():
    plan = one_f_one_b(4, 8)
    assert plan.act_slots <= 4  # the stash: at most S in-flight activations, for M = 8
    assert idle_fraction(plan.table) == pytest.approx(3 / 11)  # (S-1)/(M+S-1), like GPipe
    lines = render(plan.table).splitlines()
    assert lines[3].split(": ")[1].split()[:4] == [".", ".", ".", "F0"]  # the last stage's first F at tick 3 ...
    assert lines[3].split(": ")[1].split()[4] == "B0"  # ... and its backward right after
    inter = one_f_one_b(2, 4, 2)
    assert idle_fraction(inter.table) == pytest.approx(1 / 9)  # (S-1)/(v·M+S-1)
    every_op = sorted(op.label(2) for row in inter.table for op in row if op)
    assert every_op == sorted(f"{k}{m}.{c}" for k in "FB" for m in range(4) for c in range(2) for _ in range(2))

    mesh = {"stage": 4, "data": 2}
    params, x, _ = make(16, 64)
    infos = {
        name: pipeline_info(params, x, microbatches=8, mesh=mesh, data_axis="data", **kw)
        for name, kw in {
            "gpipe": {},
            "circular": dict(schedule="circular", repeats=2),
            "1f1b": dict(schedule="1f1b"),
            "interleaved": dict(schedule="1f1b", repeats=2),
        }.items()
    }
    for name, info in infos.items():
        assert info.schedule == name.replace("interleaved", "1f1b")
        assert info.tick_table and all(len(row) == 4 for row in info.tick_table)
        idle = sum(label == "." for row in info.tick_table for label in row)
        assert info.bubble_fraction == pytest.approx(idle / (4 * len(info.tick_table)))
        assert info.bubble_fraction == pytest.approx(3 / (8 * info.repeats + 3))
        assert info.render().splitlines()[0].startswith("stage 0:")
    assert infos["1f1b"].activation_bytes < infos["gpipe"].activation_bytes
    assert infos["interleaved"].activation_bytes < infos["circular"].activation_bytes


@pytest.mark.slow
def test_demo_pipeline_trains_with_1f1b_to_the_single_device_loss():
    from einshard_apps.demo import Trainer, load_corpus
    from einshard_apps.models.transformer import Config
    from einshard_apps.presets import PRESETS

    cfg, corpus = Config(layers=2, width=32, heads=8, ffn=64, seq=16), load_corpus()
    ref = Trainer(PRESETS["dp"], {"data": 1, "model": 1}, cfg, corpus, batch=8, devices=jax.devices()[:1])
    want = [ref.step() for _ in range(3)]
    preset = PRESETS["pipeline"]
    t = Trainer(preset, preset.default_mesh(8), cfg, corpus, batch=8, step_options={"schedule": "1f1b"})
    np.testing.assert_allclose([t.step() for _ in range(3)], want, rtol=2e-5, atol=2e-5)
    assert "einshard.pipeline(1f1b)" in "\n".join(t.step_fn.plan(t.state, t.place_batch(0)))
    # The stages own the ends: each device stores 1/S of the embedding table and of the unembedding.
    stages = preset.default_mesh(8)["stage"]
    for path in (("embed", "tokens"), ("unembed",)):
        leaf = t.state["params"]
        for key in path:
            leaf = leaf[key]
        vocab_dim = 0 if path[-1] == "tokens" else 1
        assert leaf.sharding.shard_shape(leaf.shape)[vocab_dim] == leaf.shape[vocab_dim] // stages, path


def test_1f1b_hlo_two_permutes_per_tick_and_one_data_sum():
    import re

    mesh = _mesh((2, 2), ("stage", "data"))
    params, x, _ = make(4, 8)

    def loss(p, x):
        return jnp.sum(pipeline(layer, p, x, microbatches=2, schedule="1f1b", mesh=mesh, data_axis="data") ** 2)

    hlo = jax.jit(jax.grad(loss)).lower(params, x).compile().as_text()
    permutes = len(re.findall(r"= [^=\n]*? collective-permute(-start)?\(", hlo))
    assert permutes == 3  # the forward scan's, then the 1F1B scan's activation and cotangent permutes
    assert "conditional(" in hlo  # idle / forward / backward: one branch per device per tick


@pytest.mark.slow
def test_1f1b_activations_meet_the_issue_goal():
    # Issue 12: 1F1B's activation memory <= (S/M) x GPipe's + one micro-batch, from XLA's numbers: the part of
    # the step's temporaries that grows with the batch, less the I/O a residual-free layer's step keeps too.
    from pipeline_models import activation_bytes

    stages, microbatches, batch, width = 2, 8, 64, 64
    micro = batch // microbatches * width * 4
    gpipe = activation_bytes(stages, microbatches, "gpipe", batch=batch, width=width)
    one_f = activation_bytes(stages, microbatches, "1f1b", batch=batch, width=width)
    assert 0 < one_f <= stages / microbatches * gpipe + micro
