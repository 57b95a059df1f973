"""einshard.plan: brute-force optimality on small programs, textbook choices, real-mesh application, budgets."""

from __future__ import annotations

import itertools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from planner_models import mlp_forward, mlp_step

import einshard
from einshard._src import planner as pl
from einshard._src.analysis.program import trace
from einshard._src.planner.combining import combined_report
from einshard.errors import EinshardError

P = jax.sharding.PartitionSpec
f32 = jnp.float32


def sds(*shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


KEY = {"training": "time_s", "inference": "time_s", "memory": "memory_bytes", "communication": "comm_bytes"}


def brute_force(fn, params, batch, mesh, profile, objective, budget):
    """Every assignment of the planner's candidate space, costed independently: a fresh trace, specs
    from the expressions' own PartitionSpecs, memory = peak + Adam state computed here."""
    mesh_axes = pl._mesh_axes(mesh)
    groups, leaves = pl._groups(params, mesh_axes)
    total = sum(g.nbytes for g in groups)
    cands = [pl._param_candidates(g, mesh_axes, g.nbytes < pl.SMALL_GROUP_FRACTION * total) for g in groups]
    bcands = pl._batch_candidates([tuple(batch.shape)], mesh_axes)
    traced = trace(fn, params, batch, mesh=mesh, profile=profile)
    opt = 8 if objective == "training" else 0
    names = [jax.tree_util.keystr(p) for p, _ in leaves]
    out_leaves = jax.tree_util.tree_leaves(traced.out_shape)
    rows = []
    for assign in itertools.product(*[range(len(c)) for c in cands], range(len(bcands))):
        leaf_specs = {}
        opt_bytes = 0.0
        for g, c, i in zip(groups, cands, assign):
            dims = c[i].dims
            spec = P(*[(d if len(d) > 1 else d[0]) if d else None for d in dims])
            for leaf in g.leaves:
                leaf_specs[names[leaf]] = spec
            split = math.prod(dict((m.name, m.size) for m in mesh_axes)[m] for d in dims for m in d)
            opt_bytes += sum(math.prod(s) for s in g.shapes) / split * opt
        b = bcands[assign[-1]].dims
        bspec = P(None if not b[0] else b[0][0] if len(b[0]) == 1 else b[0], b[1][0] if b[1] else None)
        p_specs = jax.tree_util.tree_map_with_path(lambda path, _, s=leaf_specs: s[jax.tree_util.keystr(path)], params)
        out_specs = None
        if objective == "training":  # (loss, grads): grads laid out like params
            out_specs = [None] + [leaf_specs[n] for n in names]
            assert len(out_specs) == len(out_leaves)
        # the planner's costing: explain's walk, α charged once per collective XLA combines (where the profile's
        # backend runs a combined op as one collective: not XLA:CPU, Profile.combined_latency)
        r, combined = combined_report(traced, (p_specs, bspec), out_specs)
        time_s = r.time_s - (combined.saved_s if r.profile.combined_latency == "once" else 0.0)
        memory = r.peak_bytes + int(opt_bytes)
        fits = budget is None or memory <= budget
        primary = {"training": time_s, "inference": time_s, "memory": memory, "communication": r.comm_bytes}
        rows.append((fits, primary[objective], memory, r))
    feasible = [row for row in rows if row[0]]
    if feasible:
        return min(row[1] for row in feasible), True
    return min(row[2] for row in rows), False


MESHES = [{"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8}, {"data": 2, "model": 2}, {"a": 2, "b": 2}]


@settings(max_examples=12)
@given(
    n_layers=st.integers(1, 2),
    dims=st.lists(st.sampled_from([16, 64, 256]), min_size=3, max_size=3),
    batch=st.sampled_from([8, 64, 1024]),
    mesh=st.sampled_from(MESHES),
    objective=st.sampled_from(pl.OBJECTIVES),
    budget_frac=st.sampled_from([None, 0.5, 0.9]),
    heuristic=st.booleans(),
)
# A draw where the descent stopped at y@model (3.80e-5 s) short of the optimum y@(data,model) (3.61e-5 s).
@example(
    n_layers=2,
    dims=[16, 256, 256],
    batch=1024,
    mesh={"data": 2, "model": 4},
    objective="training",
    budget_frac=0.5,
    heuristic=True,
)
# A draw where nothing fits and the descent's least memory (8704 B) was short of the optimum (8192 B), which has every
# group and the batch on the other mesh axis: the descent now goes on from every relabelling when nothing fits.
@example(
    n_layers=2,
    dims=[64, 16, 64],
    batch=64,
    mesh={"data": 2, "model": 4},
    objective="inference",
    budget_frac=0.5,
    heuristic=True,
)
# A draw where every descent stopped at a Megatron pair (1.20e-5 s) once open values took their readers' splits: the
# optimum (1.01e-5 s) has w0's rows over (data, model), w1 whole and the features over data, reached from the
# parameters split over every mesh axis (search.guided_descent's third start).
@example(
    n_layers=2,
    dims=[256, 64, 16],
    batch=64,
    mesh={"data": 2, "model": 4},
    objective="training",
    budget_frac=0.5,
    heuristic=True,
)
def test_plan_equals_brute_force_optimum(n_layers, dims, batch, mesh, objective, budget_frac, heuristic):
    params = {f"w{i}": sds(dims[i], dims[i + 1]) for i in range(n_layers)}
    x = sds(batch, dims[0])
    fn = mlp_step(n_layers) if objective == "training" else mlp_forward(n_layers)
    budget = None
    if budget_frac is not None:  # a budget between the smallest and the data-parallel memory
        dp = pl.plan(fn, params, x, mesh=mesh, profile="h100", objective=objective)
        preset = next(a for a in dp.alternatives if a.label == "preset dp")
        budget = int(budget_frac * preset.memory_bytes)
    best, feasible = brute_force(fn, params, x, mesh, "h100", objective, budget)
    result = pl.plan(
        fn,
        params,
        x,
        mesh=mesh,
        profile="h100",
        objective=objective,
        memory_budget=budget,
        search=pl.SearchOptions(
            exhaustive_limit=0 if heuristic else 10**6,
            # No random restarts (the default): the relabel and forced moves get the descent out of the local
            # optima of coupled groups (tests/test_planner_descent.py has cases where it stopped short before them).
            restarts=0,
            max_evaluations=10**6,
        ),
    )
    assert result.method == ("coordinate descent" if heuristic else "exhaustive")
    assert result.fits == feasible
    got = getattr(result, KEY[objective]) if feasible else result.memory_bytes
    assert got == pytest.approx(best, rel=1e-9, abs=1e-15)


def test_plan_numbers_are_explains():
    """explain() on the chosen rules gives the planner's time and communication (inference: no out_specs)."""
    params = {"w0": sds(64, 256), "w1": sds(256, 64)}
    x = sds(32, 64)
    fn = mlp_forward(2)
    r = einshard.plan(fn, params, x, mesh={"data": 4, "model": 2}, profile="h100", objective="inference")
    exprs = {k: r.rules[f"^\\['{k}'\\]$"] for k in params}
    rep = einshard.explain(
        fn, params, x, mesh={"data": 4, "model": 2}, profile="h100", in_specs=(exprs, r.data_rules[0]["^$"])
    )
    assert rep.time_s == pytest.approx(r.time_s) and rep.comm_bytes == pytest.approx(r.comm_bytes)
    assert rep.peak_bytes == r.memory_bytes  # inference: no optimizer state


# ---------------------------------------------------------------------------
# Textbook results (H100 profile, meshes from sizes only)


def big_mlp(batch):
    return {"w0": sds(4096, 16384), "w1": sds(16384, 4096)}, sds(batch, 4096)


def test_data_parallel_when_the_model_fits_and_the_batch_is_large():
    params, x = big_mlp(65536)
    r = einshard.plan(mlp_step(2), params, x, mesh={"data": 8}, profile="h100")
    assert r.data_rules[0]["^$"] == "b s -> b@data s"
    assert set(r.rules.values()) == {"x y -> x y"}
    assert "replicated" in r.explanation and r.fits


def test_fsdp_when_the_model_does_not_fit():
    params, x = big_mlp(65536)
    free = einshard.plan(mlp_step(2), params, x, mesh={"data": 8}, profile="h100")
    dp_memory = free.memory_bytes
    r = einshard.plan(mlp_step(2), params, x, mesh={"data": 8}, profile="h100", memory_budget=int(dp_memory * 0.7))
    assert r.fits and r.memory_bytes <= int(dp_memory * 0.7)
    assert r.data_rules[0]["^$"] == "b s -> b@data s"
    assert any("fsdp(data" in s for k, s in r.strategies.items() if k != "batch")
    assert "data parallel does not fit" in r.explanation
    assert r.time_s >= free.time_s  # fitting costs time


def test_tensor_parallel_when_the_per_device_batch_is_small():
    # 64 tokens on 8 GPUs: far below H100's compute/communication threshold (~2200 tokens per GPU), so
    # the gradient all-reduce of data parallelism costs more than TP's activation collectives.
    params, x = big_mlp(64)
    r = einshard.plan(mlp_step(2), params, x, mesh={"data": 4, "model": 2}, profile="h100")
    strategies = [s for k, s in r.strategies.items() if k != "batch"]
    assert all("tp(" in s for s in strategies), r
    dp = next(a for a in r.alternatives if a.label == "preset dp")
    assert r.time_s < dp.time_s


def test_pipeline_candidates_for_a_stacked_layer_axis():
    params = {"layers": {"w1": sds(8, 64, 256), "w2": sds(8, 256, 64)}}
    groups, _ = pl._groups(params, pl._mesh_axes({"stage": 4, "model": 2}))
    assert all(g.stacked and g.names[0] == "l" for g in groups)
    mesh_axes = pl._mesh_axes({"stage": 4, "model": 2})
    exprs = {g.expression(c) for g in groups[:1] for c in pl._param_candidates(g, mesh_axes, False)}
    assert "l x y -> l@stage x y" in exprs and "l x y -> l x y@model" in exprs
    assert "l x y -> l@model x y" in exprs  # any mesh axis may serve as stages
    # pruned: the layer axis (8) does not split over 16 devices, a weight axis must divide
    groups16, _ = pl._groups({"layers": {"w": sds(8, 6, 10)}}, pl._mesh_axes({"stage": 16}))
    cands = pl._param_candidates(groups16[0], pl._mesh_axes({"stage": 16}), False)
    assert [c.dims for c in cands] == [((), (), ())]


# ---------------------------------------------------------------------------
# Groups, rules, results


def test_groups_generalise_layer_indices_and_rules_apply_on_a_real_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def loss(p, x):
        h = x
        for layer in p["layers"]:
            h = jnp.tanh(h @ layer["w1"]) @ layer["w2"]
        return jnp.mean(h**2)

    rng = np.random.default_rng(0)
    params = {
        "layers": [
            {"w1": rng.normal(size=(32, 64)).astype(np.float32), "w2": rng.normal(size=(64, 32)).astype(np.float32)}
            for _ in range(3)
        ]
    }
    x = rng.normal(size=(16, 32)).astype(np.float32)
    r = einshard.plan(jax.value_and_grad(loss), params, x, mesh=mesh, profile="cpu")
    assert set(r.rules) == {r"^\['layers'\]\[\d+\]\['w1'\]$", r"^\['layers'\]\[\d+\]\['w2'\]$"}
    placed_params = einshard.einshard(params, r.rules, mesh=mesh)
    placed_x = einshard.einshard(x, r.data_rules[0], mesh=mesh)
    value, grads = jax.jit(jax.value_and_grad(loss))(placed_params, placed_x)
    ref_value, ref_grads = jax.value_and_grad(loss)(params, x)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    np.testing.assert_allclose(grads["layers"][1]["w2"], ref_grads["layers"][1]["w2"], rtol=1e-4, atol=1e-6)
    # place() does the same
    again = r.place(params, x, mesh=mesh)
    assert again[0]["layers"][0]["w1"].sharding == placed_params["layers"][0]["w1"].sharding


def test_budget_violation_returns_the_least_bad_and_says_so():
    params, x = big_mlp(4096)
    r = einshard.plan(mlp_step(2), params, x, mesh={"data": 4, "model": 2}, profile="h100", memory_budget="1MiB")
    assert not r.fits
    assert "no layout fits" in r.warning and "WARNING" in r.explanation and "DOES NOT FIT" in str(r)
    # least bad = least memory of everything costed, including the presets
    assert r.memory_bytes <= min(a.memory_bytes for a in r.alternatives)


def test_result_serialises(tmp_path):
    params = {"w0": sds(64, 256), "w1": sds(256, 64)}
    r = einshard.plan(
        mlp_step(2), params, sds(32, 64), mesh={"data": 2, "model": 2}, profile="h100", memory_budget="1GiB"
    )
    path = tmp_path / "rules.json"
    r.save_rules(str(path))
    assert json.loads(path.read_text())["params"] == r.rules
    d = json.loads(json.dumps(r.to_dict()))
    assert d["rules"] == r.rules and d["fits"] and d["alternatives"]
    text = str(r)
    assert "rules:" in text and "why:" in text and "alternatives:" in text
    assert r.report.time_s == r.time_s


def test_user_presets_are_costed_alongside():
    params, x = big_mlp(64)
    megatron = ({r"w0": "x y -> x y@model", r"w1": "x y -> x@model y"}, "b s -> b@data s")
    r = einshard.plan(
        mlp_step(2), params, x, mesh={"data": 4, "model": 2}, profile="h100", presets={"megatron": megatron}
    )
    alt = next(a for a in r.alternatives if a.label == "preset megatron")
    assert r.time_s <= alt.time_s


def test_parse_bytes_and_errors():
    assert pl.parse_bytes("16GiB") == 16 * 2**30
    assert pl.parse_bytes("1.5 GB") == 1_500_000_000
    assert pl.parse_bytes(1024) == 1024
    with pytest.raises(EinshardError, match="not a size"):
        pl.parse_bytes("lots")
    with pytest.raises(EinshardError, match="objective"):
        einshard.plan(mlp_step(1), {"w0": sds(8, 8)}, sds(8, 8), mesh={"data": 2}, objective="speed")
    with pytest.raises(EinshardError, match="mesh"):
        einshard.plan(mlp_step(1), {"w0": sds(8, 8)}, sds(8, 8), mesh=None)


def test_cli_plan_prints_the_plan_and_writes_rules(tmp_path, capsys):
    from einshard_apps.cli import main

    out = tmp_path / "rules.json"
    rc = main(["plan", "--mesh", "data=4,model=2", "--budget", "1GiB", "--rules-out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and "rules:" in text and "why:" in text
    saved = json.loads(out.read_text())
    rules = saved["params"]
    assert set(rules) == {r"^\['w1'\]$", r"^\['w2'\]$"}
    assert saved["mesh"] == {"data": 4, "model": 2} and "->" in saved["batch"]
    w = {"w1": np.zeros((1024, 2048), np.float32), "w2": np.zeros((2048, 512), np.float32)}
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    placed = einshard.einshard(w, rules, mesh=mesh)
    assert placed["w1"].shape == (1024, 2048)
    assert main(["plan", "--mesh", "data=4,model=2", "--budget", "1KiB"]) == 1  # does not fit: exit 1


def _transformer_step(heads=4):
    def norm(x):
        return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)

    def block(h, p):
        b, s, d = h.shape
        x = norm(h)
        q = (x @ p["wq"]).reshape(b, s, heads, d // heads)
        k = (x @ p["wk"]).reshape(b, s, heads, d // heads)
        v = (x @ p["wv"]).reshape(b, s, heads, d // heads)
        att = jax.nn.softmax(jnp.einsum("bshk,bthk->bhst", q, k) / jnp.sqrt(d // heads), axis=-1)
        h = h + jnp.einsum("bhst,bthk->bshk", att, v).reshape(b, s, d) @ p["wo"]
        return h + jax.nn.gelu(norm(h) @ p["w1"]) @ p["w2"], None

    def loss(params, tokens):
        h, _ = jax.lax.scan(block, params["emb"][tokens], params["layers"])
        logits = norm(h) @ params["emb"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., None], axis=-1))

    return jax.value_and_grad(loss)


@pytest.mark.parametrize(  # one mesh in the default run, the other two with the slow tests
    "mesh",
    [
        pytest.param({"data": 8, "model": 1}, marks=pytest.mark.slow),
        {"data": 4, "model": 2},
        pytest.param({"data": 2, "model": 4}, marks=pytest.mark.slow),
    ],
)
def test_plan_is_no_worse_than_the_hand_written_presets_on_a_transformer(mesh):
    L, d, f, v = 2, 256, 1024, 512
    params = {
        "emb": sds(v, d),
        "layers": {
            "wq": sds(L, d, d), "wk": sds(L, d, d), "wv": sds(L, d, d), "wo": sds(L, d, d),
            "w1": sds(L, d, f), "w2": sds(L, f, d),
        },
    }  # fmt: skip
    tokens = sds(64, 128, dtype=jnp.int32)
    megatron = {r"w[qkv1]": "l x y -> l x y@model", r"w[o2]": "l x y -> l x@model y", r"emb": "v d -> v@model d"}
    presets = {
        "dp": ({r"emb": "v d -> v d", r".*": "l x y -> l x y"}, "b s -> b@(data,model) s"),
        "fsdp": ({r"emb": "v d -> v@(data,model) d", r".*": "l x y -> l x@(data,model) y"}, "b s -> b@(data,model) s"),
        "tp": ({k: e.replace("@model", "@(data,model)") for k, e in megatron.items()}, "b s -> b s"),
        "hybrid": (megatron, "b s -> b@data s"),
    }
    step = _transformer_step()
    for budget in (None, "24MiB"):
        r = einshard.plan(step, params, tokens, mesh=mesh, profile="h100", memory_budget=budget, presets=presets)
        for alt in r.alternatives:
            if alt.label.startswith("preset") and alt.fits:
                assert r.fits and r.time_s <= alt.time_s * (1 + 1e-9), (alt.label, r)


@pytest.mark.parametrize("batch", [64, 65536])
def test_planned_collectives_match_the_compiled_hlo(batch):
    """The plan's predicted collectives are the ones XLA compiles for its rules (gradients out as params)."""
    from collections import Counter

    from jax.sharding import NamedSharding

    from einshard.testing import hlo

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params, x = big_mlp(batch)
    step = mlp_step(2)
    r = einshard.plan(step, params, x, mesh=mesh, profile="h100")
    assert r.comm_bytes > 0  # TP at batch 64, Megatron x DP at 65536: both communicate
    sh_p = {k: einshard.sharding(r.rules[f"^\\['{k}'\\]$"], params[k].shape, mesh=mesh) for k in params}
    sh_x = einshard.sharding(r.data_rules[0]["^$"], x.shape, mesh=mesh)
    jitted = jax.jit(step, in_shardings=(sh_p, sh_x), out_shardings=(NamedSharding(mesh, P()), sh_p))
    compiled = jitted.lower(params, x).compile().as_text()
    xla: Counter = Counter()
    for c in hlo.normalized(compiled):  # a collective in the layer loop runs once per layer, as explain counts
        xla[(c.kind, c.array_bytes)] += c.runs
    predicted: Counter = Counter()
    for op in r.report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                predicted[(c.kind, c.array_bytes)] += op.repeat
    assert predicted == xla


@pytest.mark.slow  # demo training (the docs' inline-command test runs the README's plan-then-demo pair too)
def test_planned_rules_train_the_demo(tmp_path):
    """`einshard plan --model transformer --rules-out F` then `einshard demo --rules F`: same loss as one device."""
    import os
    import subprocess
    import sys

    from einshard_apps.cli import main

    out = tmp_path / "rules.json"
    assert main(["plan", "--model", "transformer", "--mesh", "data=4,model=2", "--profile", "cpu",
                 "--rules-out", str(out)]) == 0  # fmt: skip
    saved = json.loads(out.read_text())
    assert saved["mesh"] == {"data": 4, "model": 2} and saved["params"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    run = subprocess.run(
        [sys.executable, "-m", "einshard", "demo", "--rules", str(out), "--steps", "2"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "loss matches the single-device run: yes" in run.stdout
