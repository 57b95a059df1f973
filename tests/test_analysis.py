"""The analyzer on its own: primitives, transition, the textbook cases of theory.md (V1-V13), names, errors.

XLA agreement is tested in test_analysis_vs_xla.py; these run in milliseconds.
"""

from __future__ import annotations

import json

import pytest
from jax.sharding import PartitionSpec as P

import einshard
from einshard import EinshardError
from einshard.analysis import (
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    dynamic_slice,
    reduce_scatter,
    transition,
)
from einshard.layout import Layout, MeshAxis

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
# The textbook cases of theory.md (mesh x=4 or (x=2, y=4), f32)

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
    plan = einshard.analyze("b@x i j, b@x j k -> b i k", mesh={"x": 4}, sizes={"b": 8, "i": 4, "j": 4, "k": 4})
    assert plan.collectives == () and plan.out_layout.dims == (("x",), (), ())


def test_v7_v8_combined_and_dp_tp_reductions():
    big = {"b": 64, "x": 4096, "y": 256}  # gathering the operands costs more than summing the result
    plan = einshard.analyze("b x@(x,y), x@(x,y) y -> b y", mesh={"x": 2, "y": 4}, sizes=big, out_spec=P())
    assert kinds(plan) == [("all-reduce", ("x", "y"), 64 * 256 * 4, 8)]
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
    plan = einshard.analyze("m k@x, k@x n -> m n", mesh={"x": 4}, sizes={"m": 8, "k": 4, "n": 16})
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
    plan = einshard.analyze("b x, x y@m -> b y", a, b, mesh={"m": 2})
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
