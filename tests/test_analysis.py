"""The analyzer on its own: primitives, transition, the textbook cases of docs/theory.md (V1-V13), names, errors.

XLA agreement is tested in test_analysis_vs_xla.py; these run in milliseconds.
"""

from __future__ import annotations

import json

import pytest
from jax.sharding import PartitionSpec as P

import einshard
from einshard import EinshardError
from einshard._src.core.layout import Layout, MeshAxis
from einshard.analysis import (
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    dynamic_slice,
    reduce_scatter,
    transition,
)

X4 = (MeshAxis("x", 4),)
XY = (MeshAxis("x", 2), MeshAxis("y", 4))
F32 = 4


def lay(axes, shape, mesh, dims, unreduced=()):
    return Layout(tuple(axes), tuple(shape), mesh, tuple(tuple(d) for d in dims), frozenset(unreduced))


def kinds(plan):
    return [(c.kind, c.axes, c.array_bytes, c.group_size) for c in plan.collectives]


# ---------------------------------------------------------------------------
# Primitives


def test_all_gather_bytes_and_layout():
    a = lay("ab", (16, 32), X4, [("x",), ()])
    b, c = all_gather(a, ("x",), itemsize=F32)
    assert b.dims == ((), ())
    assert (c.kind, c.group_size, c.array_bytes, c.bytes) == ("all-gather", 4, 16 * 32 * 4, 3 * 16 * 32)


def test_dynamic_slice_is_free_and_checks_replication():
    a = lay("ab", (16, 32), X4, [(), ()])
    b, c = dynamic_slice(a, ("x",), "b")
    assert c is None and b.dims == ((), ("x",))
    with pytest.raises(EinshardError):
        dynamic_slice(b, ("x",), "a")
    with pytest.raises(EinshardError, match="does not split"):
        dynamic_slice(lay("ab", (16, 6), X4, [(), ()]), ("x",), "b")


def test_all_reduce_and_reduce_scatter():
    a = lay("ab", (16, 32), X4, [(), ()], {"x"})
    b, c = all_reduce(a, ("x",), itemsize=F32)
    assert not b.unreduced and (c.kind, c.bytes, c.array_bytes) == ("all-reduce", 2 * 3 * 16 * 32, 16 * 32 * 4)
    b, c = reduce_scatter(a, ("x",), "a", itemsize=F32)
    assert b.dims == (("x",), ()) and not b.unreduced
    assert (c.kind, c.bytes, c.array_bytes) == ("reduce-scatter", 3 * 16 * 32, 16 * 32 * 4)
    with pytest.raises(EinshardError):
        all_reduce(b, ("x",))


def test_all_to_all_and_permute():
    a = lay("ab", (16, 32), X4, [("x",), ()])
    b, c = all_to_all(a, ("x",), "a", "b", itemsize=F32)
    assert b.dims == ((), ("x",)) and (c.kind, c.array_bytes, c.bytes) == ("all-to-all", 4 * 32 * 4, 3 * 32 * 4)
    two = lay("ab", (16, 32), XY, [("x", "y"), ()])
    b, c = collective_permute(two, (("y", "x"), ()), itemsize=F32)
    assert b.dims == (("y", "x"), ()) and c.kind == "collective-permute" and c.bytes == 2 * 32 * 4
    with pytest.raises(EinshardError):
        collective_permute(two, (("y",), ("x",)))


def test_transition_v11_and_composites():
    a = lay("ab", (16, 32), X4, [("x",), ()])
    _, steps = transition(a, a.with_dims(((), ("x",))), itemsize=F32)
    assert [(s.kind, s.array_bytes) for s in steps] == [("all-to-all", 4 * 32 * 4)]  # V11
    two = lay("ab", (64, 128), XY, [("x", "y"), ()])
    _, steps = transition(two, two.with_dims((("x",), ())), itemsize=F32)
    assert [(s.kind, s.axes, s.array_bytes) for s in steps] == [("all-gather", ("y",), 32 * 128 * 4)]  # V11
    _, steps = transition(two, two.with_dims((("y",), ())), itemsize=F32)  # XLA: permute, then gather x
    assert [(s.kind, s.axes) for s in steps] == [("collective-permute", ("x", "y")), ("all-gather", ("x",))]
    # Reductions first (XLA reduces the whole local result), then slices, then gathers.
    u = lay("ab", (64, 128), XY, [(), ("x",)], {"y"})
    end, steps = transition(u, u.with_dims((("y",), ()), frozenset()), itemsize=F32)
    assert end == u.with_dims((("y",), ()), frozenset())
    assert [s.kind for s in steps] == ["reduce-scatter", "all-gather"]
    assert transition(u, u)[1] == ()
    with pytest.raises(EinshardError, match="pending sum"):
        transition(a, a.with_dims(a.dims, frozenset({"x"})))


# ---------------------------------------------------------------------------
# The textbook cases of docs/theory.md (mesh x=4 or (x=2, y=4), f32)

SZ = {"b": 64, "x": 128, "y": 256}


def test_v1_v2_contraction_split_on_both():
    plan = einshard.analyze("b x@x, x@x y -> b y", mesh={"x": 4}, sizes=SZ, out_spec=P())
    assert kinds(plan) == [("all-reduce", ("x",), 64 * 256 * 4, 4)]
    plan = einshard.analyze("b x@x, x@x y -> b@x y", mesh={"x": 4}, sizes=SZ)
    assert kinds(plan) == [("reduce-scatter", ("x",), 64 * 256 * 4, 4)]


def test_v4_rule7_both_strategies_listed():
    plan = einshard.analyze("b x, x@x y -> b y", mesh={"x": 4}, sizes=SZ, out_spec=P())
    options = [kinds(p) for p in plan.options]
    assert [("all-reduce", ("x",), 64 * 256 * 4, 4)] in options  # slice A, partial sums (XLA's pick here)
    assert [("all-gather", ("x",), 128 * 256 * 4, 4)] in options  # gather B


def test_v5_case4_gathers_the_conflicting_operand():
    plan = einshard.analyze("b@x x, x y@x -> b@x y", mesh={"x": 4}, sizes=SZ)
    assert kinds(plan) == [("all-gather", ("x",), 128 * 256 * 4, 4)]
    plan = einshard.analyze("b@x x, x y@x -> b y@x", mesh={"x": 4}, sizes=SZ)
    assert kinds(plan) == [("all-gather", ("x",), 64 * 128 * 4, 4)]


def test_v6_free_and_batch_axes_need_nothing():
    assert einshard.analyze("b@x x, x y@y -> b@x y@y", mesh={"x": 2, "y": 4}, sizes=SZ).collectives == ()
    plan = einshard.analyze("b@x i j, b@x j k -> b? i? k?", mesh={"x": 4}, sizes={"b": 8, "i": 4, "j": 4, "k": 4})
    assert plan.collectives == () and plan.out_layout.dims == (("x",), (), ())


def test_v7_v8_combined_and_dp_tp_reductions():
    # Large enough to be bandwidth-bound: one all-reduce over all 8 devices beats gathering the operands
    # and beats summing over x, then over y (fewer hops, more bytes: listed as an alternative).
    big = {"b": 1024, "x": 4096, "y": 1024}
    plan = einshard.analyze("b x@(x,y), x@(x,y) y -> b y", mesh={"x": 2, "y": 4}, sizes=big, out_spec=P())
    assert kinds(plan) == [("all-reduce", ("x", "y"), 1024 * 1024 * 4, 8)]
    per_axis = [("all-reduce", ("x",), 1024 * 1024 * 4, 2), ("all-reduce", ("y",), 1024 * 1024 * 4, 4)]
    assert per_axis in [kinds(p) for p in plan.alternatives]
    plan = einshard.analyze("b@x x@y, x@y y -> b@x y", mesh={"x": 2, "y": 4}, sizes=SZ)
    assert kinds(plan) == [("all-reduce", ("y",), 32 * 256 * 4, 4)]


def test_v9_misaligned_contraction_lists_gather_both():
    plan = einshard.analyze("b x@x, x@y y -> b y", mesh={"x": 2, "y": 4}, sizes=SZ, out_spec=P())
    gather_both = sorted([("all-gather", ("y",), 128 * 256 * 4, 4), ("all-gather", ("x",), 64 * 128 * 4, 2)])
    assert gather_both in [sorted(kinds(p)) for p in plan.options]


def test_v10_megatron_mlp():
    sizes = {"b": 64, "d": 128, "f": 256}
    up = einshard.analyze("b d, d f@x -> b f@x", mesh={"x": 4}, sizes=sizes)
    down = einshard.analyze("b f@x, f@x d -> b d", mesh={"x": 4}, sizes=sizes)
    assert up.collectives == () and up.strategy == "column-parallel TP"
    assert kinds(down) == [("all-reduce", ("x",), 64 * 128 * 4, 4)] and down.strategy == "row-parallel TP"


def test_v12_dp_gradient_and_fsdp_forward():
    dw = einshard.analyze("b@x d, b@x f -> d f", mesh={"x": 4}, sizes={"b": 64, "d": 256, "f": 128})
    assert kinds(dw) == [("all-reduce", ("x",), 256 * 128 * 4, 4)]
    fwd = einshard.analyze("b@x d, d@x f -> b@x f", mesh={"x": 4}, sizes={"b": 64, "d": 128, "f": 256})
    assert kinds(fwd) == [("all-gather", ("x",), 128 * 256 * 4, 4)] and fwd.strategy == "FSDP"


def test_v13_ambiguous_contraction_lists_four_results():
    plan = einshard.analyze("m k@x, k@x n -> m? n?", mesh={"x": 4}, sizes={"m": 8, "k": 4, "n": 16})
    specs = [str(s) for s, _, _ in plan.legal_outputs()]
    for want in (P(None, None), P("x", None), P(None, "x"), P(None, None, unreduced={"x"})):
        assert str(want) in specs


# ---------------------------------------------------------------------------
# Strategy names, FLOPs, N operands

M2 = {"data": 4, "model": 2}
S2 = {"b": 64, "x": 128, "y": 256}


@pytest.mark.parametrize(
    "expr, name, view",
    [
        ("b@data x, x y -> b@data y", "data parallel", "DP"),
        ("b x, x y@model -> b y@model", "column-parallel TP", "DP"),
        ("b x@model, x@model y -> b y", "row-parallel TP", "1-D TP"),
        ("b@data x, x@data y -> b@data y", "FSDP", "DP"),
        ("b@data x, x y@model -> b@data y@model", "hybrid DP×TP", "DP"),
        ("b@data x@model, x@model y -> b@data y", "hybrid DP×TP", "hybrid"),
        ("b@data x, x@data y@model -> b@data y@model", "FSDP×TP", "DP"),
        ("b x, x y -> b y", "replicated", "replicated"),
    ],
)
def test_strategy_names(expr, name, view):
    plan = einshard.analyze(expr, mesh=M2, sizes=S2)
    assert (plan.strategy, plan.tutorial_view) == (name, view)


def test_attention_heads_are_tensor_parallel():
    sizes = {"b": 8, "h": 16, "q": 64, "k": 64, "d": 32}
    plan = einshard.analyze("b@data h@model q d, b@data h@model k d -> b? h? q? k?", mesh=M2, sizes=sizes)
    assert plan.strategy == "hybrid DP×TP" and plan.roles == {
        "data": "data parallel on b",
        "model": "head-parallel TP on h",
    }
    assert plan.weight is None and plan.out_layout.dims == (("data",), ("model",), (), ())


def test_sequence_parallel_name():
    plan = einshard.analyze("b s@sp d, d f -> b s@sp f", mesh={"sp": 4}, sizes={"b": 2, "s": 64, "d": 32, "f": 64})
    assert plan.strategy == "sequence parallel" and plan.collectives == ()


def test_flops_count_duplicated_compute():
    full = 2 * 64 * 128 * 256
    assert einshard.analyze("b@data x, x y -> b@data y", mesh=M2, sizes=S2).flops == full // 4  # model replicates
    assert einshard.analyze("b@data x, x y@model -> b@data y@model", mesh=M2, sizes=S2).flops == full // 8


def test_three_operands_and_lone_reduced():
    plan = einshard.analyze(
        "b x@data, x y, y z@model -> b z", mesh=M2, sizes={"b": 8, "x": 16, "y": 32, "z": 64}, out_spec=P()
    )
    assert plan.needs_communication and plan.alternatives
    lone = einshard.analyze("b x z@x, x y -> b y", mesh={"x": 4}, sizes={"b": 8, "x": 8, "z": 4096, "y": 8})
    assert lone.classes["z"] == "lone-reduced" and [c.kind for c in lone.collectives] == ["all-reduce"]


def test_unreduced_operand_stays_pending_through_a_linear_einsum():
    plan = einshard.analyze("b x {U:x}, x y -> b y {U:x}", mesh={"x": 4}, sizes=S2)
    assert plan.collectives == ()
    plan = einshard.analyze("b x {U:x}, x y -> b y", mesh={"x": 4}, sizes=S2)
    assert [c.kind for c in plan.collectives] == ["all-reduce"]


def test_alternatives_sorted_and_plan_outputs():
    plan = einshard.analyze("b x@model, x@model y -> b y", mesh=M2, sizes=S2, dtype="bf16", profile="h100")
    times = [a.time for a in plan.alternatives]
    assert times == sorted(times)
    text = str(plan)
    assert "bf16[64,128@model]" in text and "all-reduce" in text and "alternatives" in text
    d = plan.to_dict()
    json.dumps(d)
    assert d["collectives"][0]["kind"] == "all-reduce" and d["alternatives"]


def test_plain_einsum_strings_with_specs_and_arrays():
    import jax
    import jax.numpy as jnp

    plan = einshard.analyze("bx,xy->by", mesh={"x": 4}, sizes=S2, in_specs=(P(None, "x"), P("x", None)), out_spec=P())
    assert [c.kind for c in plan.collectives] == ["all-reduce"]
    a = jax.ShapeDtypeStruct((64, 128), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((128, 256), jnp.bfloat16)
    plan = einshard.analyze("b x, x y@m -> b? y?", a, b, mesh={"m": 2})
    assert plan.dtype == "bf16" and plan.operand_bytes == (64 * 128 * 2, 128 * 128 * 2)


# ---------------------------------------------------------------------------
# Errors


def test_errors_name_the_problem():
    with pytest.raises(EinshardError, match="'modle' .* not an axis of the mesh") as e:
        einshard.analyze("b x, x y@modle -> b y", mesh=M2, sizes=S2)
    assert "Did you mean 'model'" in str(e.value) and "^" in str(e.value)
    with pytest.raises(EinshardError, match="no size for axis 'y'"):
        einshard.analyze("b x, x y -> b y", mesh=M2, sizes={"b": 1, "x": 2})
    import numpy as np

    with pytest.raises(EinshardError, match="axis 'x' has size 7 in operand 2 but 128 in operand 1"):
        einshard.analyze("b x, x y -> b y", np.zeros((64, 128)), np.zeros((7, 256)), mesh=M2)
    with pytest.raises(EinshardError, match="operand 1 has rank 3"):
        einshard.analyze("b x, x y -> b y", np.zeros((2, 3, 4)), np.zeros((4, 5)), mesh=M2)
    with pytest.raises(EinshardError, match="sizes=\\{'x': 3\\}"):
        einshard.analyze("b x, x y -> b y", np.zeros((2, 4)), np.zeros((4, 5)), mesh=M2, sizes={"x": 3})
    with pytest.raises(EinshardError, match="does not split into 4 shards"):
        einshard.analyze("b@data x, x y -> b y", mesh=M2, sizes={"b": 6, "x": 4, "y": 4})
    with pytest.raises(EinshardError, match="no mesh"):
        einshard.analyze("b@data x, x y -> b y", sizes=S2)
    with pytest.raises(EinshardError, match="unknown hardware profile"):
        einshard.analyze("b x, x y -> b y", mesh=M2, sizes=S2, profile="h200x")
    with pytest.raises(EinshardError, match="unknown dtype"):
        einshard.analyze("b x, x y -> b y", mesh=M2, sizes=S2, dtype="f33")


def test_plan_einsum_on_layouts_is_cached_and_checked():
    from einshard.analysis import plan_einsum

    mesh = (MeshAxis("data", 4), MeshAxis("model", 2))
    x = lay("bd", (64, 128), mesh, [("data",), ()])
    w = lay("df", (128, 256), mesh, [(), ("model",)])
    first = plan_einsum((x, w), ("b", "f"), dtype="bf16", profile="h100")
    assert plan_einsum((x, w), ("b", "f"), dtype="bf16", profile="h100") is first
    assert first.strategy == "hybrid DP×TP" and first.collectives == ()
    want = lay("bf", (64, 256), mesh, [(), ("model",)])
    assert [c.kind for c in plan_einsum((x, w), ("b", "f"), out=want).collectives] == ["all-gather"]
    with pytest.raises(EinshardError, match="size 7"):
        plan_einsum((x, lay("df", (7, 256), mesh, [(), ()])), ("b", "f"))


def test_ellipsis_expands_from_the_operands_ranks():
    import jax
    import jax.numpy as jnp

    x = jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    plan = einshard.analyze("... d, d f -> ... f?", x, w, mesh={"x": 4}, in_specs=(P("x", None, None), P()))
    assert plan.collectives == () and plan.out_layout.axes == ("...0", "...1", "f")
    assert plan.out_layout.dims == (("x",), (), ()) and "…0@x" in str(plan)
    summed = einshard.analyze("... d, d f -> f?", x, w, mesh={"x": 4}, in_specs=(P("x", None, None), P()))
    assert summed.classes["...0"] == "lone-reduced"  # the '...' axes are summed: partial sums, or gather first
    options = [[c.kind for c in p.collectives] for p in summed.options]
    assert ["all-reduce"] in options and ["all-gather"] in options
    with pytest.raises(EinshardError, match="needs the operand's rank"):
        einshard.analyze("... d, d f -> ... f", mesh={"x": 4}, sizes={"d": 16, "f": 32})


def test_current_mesh_is_the_default():
    import jax

    mesh = jax.make_mesh((4, 2), ("data", "model"), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        plan = einshard.analyze("b@data x, x y@model -> b? y?", sizes=S2)
    assert plan.mesh == (MeshAxis("data", 4), MeshAxis("model", 2)) and plan.strategy == "hybrid DP×TP"


def test_profile_times_follow_alpha_beta():
    from einshard.analysis import PROFILES, Profile

    p = Profile("toy", flops=1e12, bandwidth=1e9, latency=1e-6)
    assert p.collective_time("all-gather", 4, 3e9, 4e9) == pytest.approx(3 * 1e-6 + 3.0)
    assert p.collective_time("all-reduce", 4, 6e9, 4e9) == pytest.approx(6 * 1e-6 + 6.0)
    assert p.collective_time("collective-permute", 4, 1e9, 1e9) == pytest.approx(1e-6 + 1.0)
    assert p.collective_time("all-gather", 1, 0, 4e9) == 0.0
    ring = Profile("ring", flops=1e12, bandwidth=1e9, latency=0.0, topology="ring")
    assert ring.collective_time("all-to-all", 4, 0.75e9, 1e9) == pytest.approx(4 * 1e9 / 4e9)  # V/(4W), V = n·s
    assert set(PROFILES) >= {"cpu", "h100", "tpu-v5p"} and p.compute_time(2e12) == 2.0


def test_mesh_axes_of_size_one_split_nothing():
    mesh = (MeshAxis("x", 1), MeshAxis("y", 4))
    a = lay("ab", (8, 8), mesh, [("x", "y"), ()])
    assert transition(a, a.with_dims((("y",), ()))) == (a.with_dims((("y",), ())), ())
    plan = einshard.analyze("b@(x,y), b@y -> b@(x,y)", mesh={"x": 1, "y": 4}, sizes={"b": 8})
    assert plan.collectives == ()


# -- one string, one layout: '-> b y' is whole (as in a placement), '-> b? y?' is the analyzer's choice ----


def test_bare_output_is_whole_and_question_marks_choose():
    import warnings

    mesh, sizes = {"data": 4, "model": 2}, {"b": 64, "x": 128, "y": 256}
    chosen = einshard.analyze("b@data x, x y@model -> b? y?", mesh=mesh, sizes=sizes)
    assert chosen.out_layout.dims == (("data",), ("model",)) and not chosen.collectives
    with pytest.warns(FutureWarning, match=r"now means a whole \(replicated\) result.*-> b\? y\?"):
        whole = einshard.analyze("b@data x, x y@model -> b y", mesh=mesh, sizes=sizes)
    assert whole.out_layout.dims == ((), ())  # what einshard(x, 'b y -> b y') means
    with pytest.warns(FutureWarning, match="bare output"):  # the cached plan warns again
        assert whole.out_layout == einshard.analyze("b@data x, x y@model -> b y", mesh=mesh, sizes=sizes).out_layout
    assert sorted(c.kind for c in whole.collectives) == ["all-gather", "all-gather"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where both readings give the same layout
        einshard.analyze("b x@model, x@model y -> b y", mesh=mesh, sizes=sizes)
        einshard.analyze("b x, x y -> b y", mesh=mesh, sizes=sizes)
        einshard.analyze("bx,xy->by", mesh=mesh, sizes=sizes, in_specs=(P("data", None), P()))  # jnp: chosen


def test_question_marks_with_out_spec_is_an_error():
    with pytest.raises(EinshardError, match="not both"):
        einshard.analyze("b x, x y -> b? y?", mesh={"m": 2}, sizes={"b": 4, "x": 4, "y": 4}, out_spec=P())


def test_einsum_reads_the_output_side_the_same_way():
    import jax
    import numpy as np

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    x, w = np.ones((8, 16), np.float32), np.ones((16, 32), np.float32)
    chosen = einshard.einsum("b@data x, x y@model -> b? y?", x, w, mesh=mesh)
    assert tuple(chosen.sharding.spec) == ("data", "model")
    with pytest.warns(FutureWarning):
        whole = einshard.einsum("b@data x, x y@model -> b y", x, w, mesh=mesh)
    assert whole.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(whole), np.asarray(chosen))
