"""Collective matmul rings vs jnp.einsum and the unsharded gradient, and their compiled collectives."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import einshard
from einshard.errors import EinshardError
from einshard.lowering import allgather_einsum, einsum_reduce_scatter

HI = jax.lax.Precision.HIGHEST


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


# Ring configurations: (mesh, the ring's mesh axes).
MESHES = {
    "1": (_mesh((1,), ("r",)), ("r",)),
    "2": (_mesh((2,), ("r",)), ("r",)),
    "4": (_mesh((4,), ("r",)), ("r",)),
    "8": (_mesh((8,), ("r",)), ("r",)),
    "2x4-ring-minor": (_mesh((2, 4), ("a", "r")), ("r",)),
    "2x4-ring-major": (_mesh((2, 4), ("r", "a")), ("r",)),
    "2x4-ring-both": (_mesh((2, 4), ("a", "r")), ("a", "r")),
}


def _spec(*entries, ring):
    name = ring[0] if len(ring) == 1 else ring
    return P(*(name if e == "R" else None for e in entries))


# name -> (subscripts, global shapes given ring size n and block b, in specs, out spec, kind, operand, dim)
def case(name, n, b):
    if name == "ag-free":  # Megatron-SP input projection: X[B_r, D] W[D, F_r] -> Y[B, F_r]
        return "bd,df->bf", [(n * b, 3), (3, 2 * n)], [("R", None), (None, "R")], (None, "R"), "ag", 0, 0
    if name == "ag-free-rhs":  # the gathered operand is the second one
        return "bd,fd->bf", [(2 * n, 3), (n * b, 3)], [("R", None), ("R", None)], ("R", None), "ag", 1, 0
    if name == "ag-contracted":  # JAX docs example 1: A[M_r, K] B[K_r, N] -> C[M_r, N]
        return "mk,kn->mn", [(2 * n, n * b), (n * b, 3)], [("R", None), ("R", None)], ("R", None), "ag", 1, 0
    if name == "ag-batch":  # gathered axis is a batch axis of both operands
        return (
            "gbd,gdf->gbf",
            [(n * b, 2, 3), (n * b, 3, 2 * n)],
            [("R", None, None), (None, None, "R")],
            (
                None,
                None,
                "R",
            ),
            "ag",
            0,
            0,
        )
    if name == "rs":  # Megatron-SP output projection: H[B, F_r] W2[F_r, D] -> Y[B_r, D]
        return "bf,fd->bd", [(n * b, 2 * n), (2 * n, 3)], [(None, "R"), ("R", None)], ("R", None), "rs", None, 0
    if name == "rs-batch":  # the scattered axis is in both operands
        return (
            "gbf,gfd->gbd",
            [(n * b, 2, 2 * n), (n * b, 2 * n, 3)],
            [(None, None, "R"), (None, "R", None)],
            (
                "R",
                None,
                None,
            ),
            "rs",
            None,
            0,
        )
    raise KeyError(name)


CASES = ["ag-free", "ag-free-rhs", "ag-contracted", "ag-batch", "rs", "rs-batch"]


def build(name, mesh_key, b, schedule, **kw):
    mesh, ring = MESHES[mesh_key]
    n = int(np.prod([mesh.shape[a] for a in ring]))
    subs, shapes, in_specs, out_spec, kind, operand, dim = case(name, n, b)

    def body(x, y):
        if kind == "ag":
            return allgather_einsum(subs, x, y, axis_name=ring, gathered=operand, dim=dim, schedule=schedule, **kw)
        return einsum_reduce_scatter(subs, x, y, axis_name=ring, dim=dim, schedule=schedule, **kw)

    f = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=tuple(_spec(*s, ring=ring) for s in in_specs),
        out_specs=_spec(*out_spec, ring=ring),
        check_vma=True,
    )
    return f, subs, shapes, n


def _operands(shapes, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _count(hlo: str, op: str) -> int:
    return len(re.findall(rf"= [^=\n]*? {op}(-start)?\(", hlo))


def _check_ring_equals_einsum_and_its_gradient(name, mesh_key, b, schedule, seed):
    f, subs, shapes, _ = build(name, mesh_key, b, schedule, precision=HI)
    x, y = _operands(shapes, seed)
    ref = jnp.einsum(subs, x, y, precision=HI)
    g = np.random.default_rng(seed + 1).standard_normal(ref.shape).astype(np.float32)

    def loss(x, y):
        return jnp.sum(f(x, y) * g)

    def ref_loss(x, y):
        return jnp.sum(jnp.einsum(subs, x, y, precision=HI) * g)

    out, grads = jax.jit(lambda x, y: (f(x, y), jax.grad(loss, (0, 1))(x, y)))(x, y)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, jax.grad(ref_loss, (0, 1))(x, y), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# 6 examples in the default run; 30 in the slow one (the same property), drawn from:
_RING_EQUALS_EINSUM_AND_ITS_GRADIENT_DRAWS = dict(
    name=st.sampled_from(CASES),
    mesh_key=st.sampled_from(list(MESHES)),
    b=st.integers(1, 5),
    schedule=st.sampled_from(["sync", "one-way", "two-way"]),
    seed=st.integers(0, 2**16),
)


@settings(max_examples=6, deadline=None)
@given(**_RING_EQUALS_EINSUM_AND_ITS_GRADIENT_DRAWS)
def test_ring_equals_einsum_and_its_gradient(name, mesh_key, b, schedule, seed):
    _check_ring_equals_einsum_and_its_gradient(name=name, mesh_key=mesh_key, b=b, schedule=schedule, seed=seed)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(**_RING_EQUALS_EINSUM_AND_ITS_GRADIENT_DRAWS)
def test_ring_equals_einsum_and_its_gradient_deep(name, mesh_key, b, schedule, seed):
    _check_ring_equals_einsum_and_its_gradient(name=name, mesh_key=mesh_key, b=b, schedule=schedule, seed=seed)


@pytest.mark.parametrize("name", ["ag-free", "ag-contracted", "ag-batch"])
@pytest.mark.parametrize("mesh_key", ["4", "8", "2x4-ring-minor"])
def test_ag_hlo_contract(name, mesh_key):
    for schedule, permutes, gathers in [("one-way", 1, 0), ("two-way", 2, 0), ("sync", 0, 1)]:
        f, _, shapes, n = build(name, mesh_key, 4, schedule, precision=HI)
        hlo = jax.jit(f).lower(*_operands(shapes, 0)).compile().as_text()
        assert _count(hlo, "collective-permute") == permutes * (n - 1), (schedule, hlo.count("collective-permute"))
        assert _count(hlo, "all-gather") == gathers
        assert _count(hlo, "all-reduce") == 0 and _count(hlo, "reduce-scatter") == 0


@pytest.mark.parametrize("name", ["rs", "rs-batch"])
@pytest.mark.parametrize("mesh_key", ["4", "8", "2x4-ring-major"])
def test_rs_hlo_contract(name, mesh_key):
    for schedule, permutes in [("one-way", 1), ("two-way", 2)]:
        f, _, shapes, n = build(name, mesh_key, 4, schedule, precision=HI)
        hlo = jax.jit(f).lower(*_operands(shapes, 0)).compile().as_text()
        assert _count(hlo, "collective-permute") == permutes * (n - 1)
        assert _count(hlo, "reduce-scatter") == 0 and _count(hlo, "all-reduce") == 0
    f, _, shapes, n = build(name, mesh_key, 4, "sync", precision=HI)
    hlo = jax.jit(f).lower(*_operands(shapes, 0)).compile().as_text()
    assert _count(hlo, "collective-permute") == 0
    # CPU lowers a reduce-scatter as all-reduce + dynamic-slice (docs/theory.md V2)
    assert _count(hlo, "reduce-scatter") == 1 or (_count(hlo, "all-reduce") == 1 and "dynamic-slice" in hlo)


def test_ring_gradient_is_the_reverse_ring():
    f, _, shapes, n = build("ag-free", "8", 2, "one-way", precision=HI)
    ops = _operands(shapes, 0)
    hlo = jax.jit(jax.grad(lambda x, y: f(x, y).sum(), (0, 1))).lower(*ops).compile().as_text()
    assert _count(hlo, "collective-permute") == 2 * (n - 1)
    assert _count(hlo, "all-gather") == 0


def test_axis_size_one_has_no_collective():
    f, subs, shapes, _ = build("ag-free", "1", 3, "two-way", precision=HI)
    ops = _operands(shapes, 0)
    hlo = jax.jit(f).lower(*ops).compile().as_text()
    assert not any(_count(hlo, op) for op in ("collective-permute", "all-gather", "all-reduce"))
    np.testing.assert_allclose(f(*ops), jnp.einsum(subs, *ops, precision=HI), rtol=1e-6)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("schedule", ["one-way", "two-way"])
def test_bf16_inputs_accumulate_in_f32(name, schedule):
    f, subs, shapes, _ = build(name, "8", 3, schedule)
    x, y = (jnp.asarray(a, jnp.bfloat16) for a in _operands(shapes, 1))
    out = jax.jit(f)(x, y)
    assert out.dtype == jnp.bfloat16
    ref = jnp.einsum(subs, x.astype(jnp.float32), y.astype(jnp.float32), precision=HI)
    # one bf16 rounding of an f32-accumulated sum
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=2e-2)
    hlo = jax.jit(f).lower(x, y).as_text()
    assert "f32" in hlo  # the partial products and the accumulator


def test_bad_arguments():
    with pytest.raises(EinshardError, match="two operands"):
        allgather_einsum("a,b,c->a", 1, 2, axis_name="r", dim=0)
    with pytest.raises(EinshardError, match="schedule"):
        allgather_einsum("ab,bc->ac", jnp.ones((2, 2)), jnp.ones((2, 2)), axis_name="r", dim=0, schedule="ring")


# -- a ring over mesh axes named out of the mesh's order ----------------------------------------------------------


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
@pytest.mark.parametrize(
    ("expression", "shapes"),
    [
        ("a b@(x,y), a@(y,x) -> a b@(x,y)", ((8, 16), (8,))),  # the operand gathered over (y, x)
        ("a b@(y,x), b c -> a c@(y,x)", ((8, 16), (16, 8))),  # the result reduce-scattered over (y, x)
        ("a b@(y,x), b c -> a c", ((8, 16), (16, 8))),
        ("a b, b@(y,x) c -> a c", ((8, 16), (16, 8))),
    ],
)
def test_async_rings_over_axes_named_out_of_mesh_order_are_right(expression, shapes, explicit):
    """ppermute numbers a multi-axis ring's devices in the mesh's axis order, axis_index in the named order: the
    collective matmul's ring over ('y', 'x') on an (x, y) mesh sent each block to the wrong neighbour (wrong values
    in async mode, sync right; found by tests/test_analysis_chosen_output.py's random draws)."""
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("x", "y"), axis_types=(kind, kind))
    rng = np.random.default_rng(0)
    operands = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes]
    subscripts = expression.replace("@(x,y)", "").replace("@(y,x)", "").replace(" ", "")
    want = np.einsum(subscripts, *[np.asarray(o, np.float64) for o in operands])
    for mode in ("sync", "async"):
        got = einshard.lower(expression, *operands, mesh=mesh, mode=mode)(*operands)
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4, err_msg=mode)
