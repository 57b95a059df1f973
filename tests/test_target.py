"""plan(target=) / explain(target=): hardware we do not have, through its own compiler (issue 21).

The TPU tests compile with libtpu (the ``[tpu]`` extra) on this CPU machine: no TPU is used.  Without
libtpu they skip, saying so; the parsing, GPU-target and missing-libtpu tests run everywhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.planner.verify import compiled_numbers, predicted_kinds
from einshard.errors import EinshardError
from einshard.planner import SearchOptions, plan
from einshard.targets import CHIPS, libtpu_available, parse_target, target_mesh

needs_libtpu = pytest.mark.skipif(
    not libtpu_available(), reason="libtpu is not installed (pip install 'einshard[tpu]'): no TPU compiler here"
)

GiB = 2**30


def _mlp_loss(p, x):
    return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)


def _mlp(d: int = 2048, f: int = 8192, b: int = 256):
    params = {"w1": jax.ShapeDtypeStruct((d, f), jnp.float32), "w2": jax.ShapeDtypeStruct((f, d), jnp.float32)}
    return params, jax.ShapeDtypeStruct((b, d), jnp.float32)


# ---- parsing and errors: everywhere ----


def test_parse_target_reads_tpu_slices_and_gpus():
    t = parse_target("tpu:v5p:4x4x4")
    assert (t.chips, t.topology, t.profile.name, t.hbm_bytes) == (64, (4, 4, 4), "tpu-v5p", 95 * GiB)
    assert t.compiles and t.topology_name == "v5p:4x4x4" and t.default_mesh() == {"data": 16, "model": 4}
    e = parse_target("tpu:v5e:2x2")
    assert (e.chips, e.hbm_bytes, e.profile.flops) == (4, 16 * GiB, CHIPS["v5e"].flops)
    g = parse_target("gpu:h100x8")
    assert (g.chips, g.compiles, g.profile.name, g.default_mesh()) == (8, False, "h100", {"data": 8})


@pytest.mark.parametrize(
    "spec, words",
    [
        ("tpu:v9:2x2", ["'v9'", "v5p"]),
        ("tpu:v5p:2x2", ["3-D", "'2x2'"]),
        ("tpu:v5e:2x2x2", ["2-D"]),
        ("gpu:a100x8", ["'a100'"]),
        ("v5p:4x4x4", ["tpu:GENERATION:TOPOLOGY", "gpu:CHIPxCOUNT"]),
    ],
)
def test_bad_targets_are_einshard_errors_that_name_what_is_wrong(spec, words):
    with pytest.raises(EinshardError) as err:
        parse_target(spec)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_without_libtpu_a_tpu_target_names_the_tpu_extra(monkeypatch):
    import einshard._src.targets as targets  # where plan(target=) reads it from

    monkeypatch.setattr(targets, "libtpu_available", lambda: False)
    params, x = _mlp(64, 128, 32)
    with pytest.raises(EinshardError, match=r"einshard\[tpu\]"):
        plan(jax.value_and_grad(_mlp_loss), params, x, target="tpu:v5e:2x2")


def test_a_mesh_of_another_size_than_the_target_is_refused():
    params, x = _mlp(64, 128, 32)
    with pytest.raises(EinshardError, match=r"8 chips.*has 4"):
        einshard.explain(_mlp_loss, params, x, target="gpu:h100x8", mesh={"data": 4})


def test_gpu_target_plans_on_its_profile_and_says_no_compiler_checked():
    params, x = _mlp(256, 1024, 64)
    result = plan(
        jax.value_and_grad(_mlp_loss),
        params,
        x,
        target="gpu:h100x8",
        verify=2,
        search=SearchOptions(max_evaluations=20),
    )
    assert result.verification == ()
    assert result.report.profile.name == "h100"
    assert {m.name: m.size for m in result.report.mesh} == {"data": 8}
    assert result.memory_budget == 80 * 10**9  # the chip's HBM by default
    assert "no compiler check is possible" in result.explanation and "verify=2 not run" in result.explanation


def test_explain_on_a_target_uses_its_chip_and_default_mesh():
    w, x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16), jax.ShapeDtypeStruct((64, 1024), jnp.bfloat16)
    r = einshard.explain(lambda w, x: x @ w, w, x, target="tpu:v5p:4x4x4", in_specs=("d f -> d@model f", None))
    assert r.profile.name == "tpu-v5p" and {m.name: m.size for m in r.mesh} == {"data": 16, "model": 4}
    # and profile= still wins over the target's chip
    assert einshard.explain(lambda w, x: x @ w, w, x, target="tpu:v5p:2x2x2", profile="cpu").profile.name == "cpu"


# ---- through the TPU compiler ----


@needs_libtpu
@pytest.mark.parametrize("spec", ["tpu:v5e:2x2", pytest.param("tpu:v5p:2x2x2", marks=pytest.mark.slow)])
def test_plan_on_a_tpu_target_fits_by_the_compilers_numbers_where_replicated_does_not(spec):
    target = parse_target(spec)
    params, x = _mlp()
    fn = jax.value_and_grad(_mlp_loss)
    budget = 400 * 2**20
    result = plan(fn, params, x, target=spec, memory_budget=budget, verify=1, search=SearchOptions(max_evaluations=12))
    assert result.fits and result.verification
    chosen = next(v for v in result.verification if v.chosen)
    assert chosen.compiler == f"TPU compiler ({target.topology_name})"
    assert chosen.fits and chosen.fits_hbm and chosen.compiled_memory <= budget
    assert chosen.predicted_kinds and sum(chosen.compiled_kinds.values()) == chosen.compiled_count
    assert str(result).count("fits HBM") == len(result.verification)
    # The text names whose compiler checked the plan (not "XLA": this machine's XLA never ran it).
    assert f"verified with TPU compiler ({target.topology_name})" in str(result).splitlines()[0]
    assert f"\nverified with TPU compiler ({target.topology_name}) (" in result.explanation
    # The replicated layout, compiled by the same compiler: over the budget (parameters, gradients and Adam's
    # two moments whole on every chip).
    mesh = target_mesh(target, target.default_mesh())
    leaves = jax.tree_util.tree_leaves((params, x))
    *_, peak, _ = compiled_numbers(fn, (params, x), [None] * len(leaves), None, mesh, target.profile)
    assert peak is not None
    replicated = peak + 8 * sum(a.size for a in jax.tree_util.tree_leaves(params))
    assert replicated > budget >= chosen.compiled_memory


# One matmul each, with one answer: the kinds (and counts) of collectives the TPU compiler emits.
ONE_OP_CASES = [
    # contraction split over model: partial sums all-reduced
    ("b d@model", "d@model f", {"all-reduce": 1}),
    # batch over data, columns over model: nothing to communicate
    ("b@data d", "d f@model", {}),
    # both sides' contraction over every axis: one all-reduce over all chips
    ("b d@(data,model)", "d@(data,model) f", {"all-reduce": 1}),
]


@needs_libtpu
@pytest.mark.parametrize("spec", ["tpu:v5e:2x2", "tpu:v5p:2x2x2"])
@pytest.mark.parametrize("x_layout, w_layout, expected", ONE_OP_CASES)
def test_explains_collectives_equal_the_tpu_compilers_on_one_op_cases(spec, x_layout, w_layout, expected):
    target = parse_target(spec)
    sizes = {"data": target.chips // 2, "model": 2}
    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16)

    def fn(x, w):
        return x @ w

    in_specs = (f"b d -> {x_layout}", f"d f -> {w_layout}")
    report = einshard.explain(fn, x, w, target=spec, mesh=sizes, in_specs=in_specs)
    assert predicted_kinds(report) == expected
    mesh = target_mesh(target, sizes)
    specs = [_spec(x_layout), _spec(w_layout)]
    *_, kinds = compiled_numbers(fn, (x, w), specs, None, mesh, target.profile)
    assert kinds == expected


def _spec(layout: str) -> P:
    dims = []
    for part in layout.split():
        _, _, axes = part.partition("@")
        names = tuple(axes.strip("()").split(",")) if axes else ()
        dims.append(None if not names else (names[0] if len(names) == 1 else names))
    return P(*dims)


def test_llama_shapes_are_7b_and_70b_class():
    from einshard_apps.models import llama

    assert 6.5e9 < llama.param_count(llama.CONFIGS["llama-7b"]) < 7e9
    assert 68e9 < llama.param_count(llama.CONFIGS["llama-70b"]) < 70e9
    wk = llama.shapes(llama.CONFIGS["llama-70b"])["layers"]["attn"]["wk"]
    assert wk.shape == (80, 8192, 8, 128) and wk.dtype == jnp.bfloat16  # grouped-query: 8 key/value heads


def test_llama_loss_traces_to_a_complete_report_scanned_and_unrolled():
    from einshard_apps.models import llama

    for unroll in (False, True):
        cfg = llama.LlamaConfig("tiny", layers=2, width=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq=16)
        cfg = llama.dataclasses.replace(cfg, unroll=unroll)
        tokens = jax.ShapeDtypeStruct((8, cfg.seq + 1), jnp.int32)
        fn = jax.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg))
        report = einshard.explain(fn, llama.shapes(cfg), tokens, target="gpu:h100x8")
        assert report.complete, report.headline()


@pytest.mark.slow  # 14 s: 160 costings of a width-4096 decoder
def test_cli_plans_a_llama_for_a_gpu_target(capsys):
    from einshard_apps.cli import main

    code = main(["plan", "--model", "llama-7b", "--layers", "2", "--seq", "64", "--target", "gpu:h100x8"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "llama-7b (2 layers" in out and "no compiler check is possible" in out and "profile h100" in out


@needs_libtpu
def test_a_candidate_the_target_compiler_fails_on_is_reported_and_ranked_last(monkeypatch):
    import einshard._src.planner.verify as verify

    real = verify.compile_and_read
    calls = []

    def first_fails(*args, **kwargs):
        calls.append(1)  # the compiles run on a thread pool: whichever starts first fails
        if len(calls) == 1:
            raise RuntimeError("INTERNAL: RET_CHECK failure (a compiler bug)")
        return real(*args, **kwargs)

    monkeypatch.setattr(verify, "compile_and_read", first_fails)
    params, x = _mlp(256, 1024, 64)
    result = plan(
        jax.value_and_grad(_mlp_loss),
        params,
        x,
        target="tpu:v5e:2x2",
        verify=2,
        search=SearchOptions(max_evaluations=12),
    )
    failed = [v for v in result.verification if v.error]
    assert len(failed) == 1 and "RET_CHECK" in failed[0].error and not failed[0].chosen
    assert result.verification[-1] is failed[0] and result.verification[0].chosen and not result.verification[0].error
    assert "did not compile (TPU compiler (v5e:2x2))" in str(result)

    monkeypatch.setattr(verify, "compile_and_read", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(EinshardError, match=r"compiled none of the .* candidates.*boom"):
        plan(
            jax.value_and_grad(_mlp_loss),
            params,
            x,
            target="tpu:v5e:2x2",
            verify=2,
            search=SearchOptions(max_evaluations=12),
        )


@needs_libtpu
def test_tpu_scan_loops_count_each_iteration_in_the_hlo_reader():
    """TPU's while loops carry no known_trip_count: the reader takes the bound from the loop's condition, so a
    data-parallel step of a scanned decoder all-reduces exactly its gradients' bytes (every layer's)."""
    from jax.sharding import NamedSharding

    from einshard.testing import hlo
    from einshard_apps.models import llama

    cfg = llama.LlamaConfig("t", layers=4, width=512, heads=4, kv_heads=4, ffn=1024, vocab=1024, seq=128)
    mesh = target_mesh(parse_target("tpu:v5e:2x2"), {"data": 4})
    params = llama.shapes(cfg)
    placed = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, P())), params)
    tokens = jax.ShapeDtypeStruct((8, cfg.seq + 1), jnp.int32, sharding=NamedSharding(mesh, P("data")))
    whole = jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
    step = jax.jit(
        jax.value_and_grad(functools.partial(llama.loss_fn, cfg=cfg)), out_shardings=(NamedSharding(mesh, P()), whole)
    )
    text = step.lower(placed, tokens).compile().as_text()
    assert "known_trip_count" not in text  # what this test is about
    found = hlo.normalized(text)
    assert {c.kind for c in found} == {"all-reduce"} and max(c.runs for c in found) == cfg.layers
    grads = sum(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves(params))
    assert sum(c.runs * c.array_bytes for c in found) - 4 == grads  # the gradients, and the f32 loss
