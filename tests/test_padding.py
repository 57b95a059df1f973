"""Uneven splits: zero padding where it is exact (result and gradients unchanged), a clear error where not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import einshard
from einshard.errors import EinshardError
from einshard.lowering import (
    Step,
    einsum_layouts,
    einsum_shard_map,
    pad_operands,
    plan_padding,
    unpad_result,
)

HI = jax.lax.Precision.HIGHEST
MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def run_padded(expr, shapes, before, after, subs, seed=0):
    pad = plan_padding(expr, shapes, MESH)
    ins, out = einsum_layouts(expr, pad.padded_shapes, MESH)
    f = einsum_shard_map(ins, out, before, after, mesh=MESH, precision=HI)

    def padded_einsum(*xs):
        y = unpad_result(pad, f(*pad_operands(pad, xs)))
        return y.sum(0) if out.unreduced else y

    rng = np.random.default_rng(seed)
    ops = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ref = jnp.einsum(subs, *ops, precision=HI)
    g = rng.standard_normal(ref.shape).astype(np.float32)
    argnums = tuple(range(len(ops)))
    y, grads = jax.jit(
        lambda *xs: (padded_einsum(*xs), jax.grad(lambda *xs: jnp.sum(padded_einsum(*xs) * g), argnums)(*xs))
    )(*ops)
    want = jax.grad(lambda *xs: jnp.sum(jnp.einsum(subs, *xs, precision=HI) * g), argnums)(*ops)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    return pad


def test_contracted_axis_padded_with_zeros():
    pad = run_padded(
        "b x@model, x@model y -> b y", [(3, 10), (10, 5)], [], [Step("all-reduce", "out", "model")], "bx,xy->by"
    )
    assert pad.sizes == (("x", 10, 12),)


def test_result_axis_kept_whole_is_padded_and_cut_back():
    pad = run_padded("b@data x, x y -> b y", [(5, 4), (4, 6)], [Step("all-gather", 0, "data", dim=0)], [], "bx,xy->by")
    assert pad.padded_output_shape == (6, 6) and pad.output_shape == (5, 6)


def test_pending_sums_keep_their_leading_axis():
    run_padded("b x@model, x@model y -> b y {U:model}", [(3, 6), (6, 5)], [], [], "bx,xy->by")


def test_no_padding_needed():
    pad = plan_padding("b x@model, x@model y -> b y", [(3, 8), (8, 5)], MESH)
    assert not pad.needed and pad.padded_shapes == pad.shapes


def test_uneven_output_split_is_an_error():
    with pytest.raises(EinshardError, match="not even; padding cannot help") as err:
        plan_padding("b@data x, x y -> b@data y", [(5, 4), (4, 6)], MESH)
    assert "^" in str(err.value)  # the caret points at the output axis


# (expression, jnp subscripts with 'L' standing for the '...' axes, operand 1's axes with 'L')
ELLIPSIS_CASES = [
    ("... k@y, k@y n -> ... n", "Lk,kn->Ln", "Lk"),
    ("b@x ... k@y, k@y n -> b ... n", "bLk,kn->bLn", "bLk"),
    ("... b k@(x,y), k@(x,y) n -> ... b n", "Lbk,kn->Lbn", "Lbk"),
    ("b@x ... k@y, k@y n -> n", "bLk,kn->n", "bLk"),
]


def _check_ellipsis_with_uneven_sizes_equals_jnp_einsum(case, lead, b, k, n, kind):
    """'...' and uneven splits together: padded exactly, values and gradients as jnp.einsum's."""
    expr, subs, a_axes = case
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(kind,) * 2)
    letters = "LM"[: len(lead)]
    subs = subs.replace("L", letters)
    size = {"b": b, "k": k, **dict(zip(letters, lead))}
    a_shape = tuple(size[c] for c in a_axes.replace("L", letters))
    rng = np.random.default_rng(b * 100 + k)
    a, w = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    want = jnp.einsum(subs, a, w, precision=HI)
    cot = rng.standard_normal(want.shape).astype(np.float32)

    def loss(fn):
        return lambda a, w: jnp.sum(fn(a, w) * cot)

    sharded = lambda a, w: einshard.einsum(expr, a, w, mesh=mesh, precision=HI)  # noqa: E731
    with jax.set_mesh(mesh):
        got = sharded(a, w)
        grads = jax.grad(loss(sharded), (0, 1))(a, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    plain = jax.grad(loss(lambda a, w: jnp.einsum(subs, a, w, precision=HI)), (0, 1))(a, w)
    for g, p in zip(grads, plain, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(p), rtol=1e-4, atol=1e-4)


# 3 examples in the default run; 12 in the slow one (the same property), drawn from:
_ELLIPSIS_WITH_UNEVEN_SIZES_EQUALS_JNP_EINSUM_DRAWS = dict(
    case=st.sampled_from(ELLIPSIS_CASES),
    lead=st.lists(st.integers(1, 5), min_size=0, max_size=2),
    b=st.integers(1, 7),
    k=st.integers(1, 11),
    n=st.integers(1, 6),
    kind=st.sampled_from([AxisType.Explicit, AxisType.Auto]),
)


@settings(max_examples=3, deadline=None)
@given(**_ELLIPSIS_WITH_UNEVEN_SIZES_EQUALS_JNP_EINSUM_DRAWS)
def test_ellipsis_with_uneven_sizes_equals_jnp_einsum(case, lead, b, k, n, kind):
    _check_ellipsis_with_uneven_sizes_equals_jnp_einsum(case=case, lead=lead, b=b, k=k, n=n, kind=kind)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(**_ELLIPSIS_WITH_UNEVEN_SIZES_EQUALS_JNP_EINSUM_DRAWS)
def test_ellipsis_with_uneven_sizes_equals_jnp_einsum_deep(case, lead, b, k, n, kind):
    _check_ellipsis_with_uneven_sizes_equals_jnp_einsum(case=case, lead=lead, b=b, k=k, n=n, kind=kind)


def test_ellipsis_pads_only_named_axes():
    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    pad = plan_padding("b@x ... k@y, k@y n -> b ... n", [(3, 5, 7), (7, 6)], mesh)
    assert pad.sizes == (("b", 3, 4), ("k", 7, 8))
    assert pad.padded_shapes == ((4, 5, 8), (8, 6)) and pad.output_shape == (3, 5, 6)
    with pytest.raises(EinshardError, match="rank"):
        plan_padding("b@x c ... k@y, k@y n -> b ... n", [(3, 7), (7, 6)], mesh)
