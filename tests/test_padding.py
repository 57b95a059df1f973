"""Uneven splits: zero padding where it is exact (result and gradients unchanged), a clear error where not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

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
