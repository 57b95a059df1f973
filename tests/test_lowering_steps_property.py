"""Property test of the step vocabulary: random layouts on meshes of 1, 2, 4, 8 and 2x4 devices.

The plans are simple correct ones (gather every operand whole, optionally contract one axis in
slices and reduce the partial sums by all-reduce or reduce-scatter, slice the result to the requested
layout), built from Steps with one- and multi-axis collectives; result and gradients must equal the
unsharded einsum, and the result must have the requested layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import einshard.testing as et
from einshard._src.core.layout import Layout, MeshAxis, resolve_named
from einshard._src.parsing import parse_placement
from einshard.lowering import Step, einsum_shard_map

HI = jax.lax.Precision.HIGHEST

MESH_SHAPES = {(1,): ("x",), (2,): ("x",), (4,): ("x",), (8,): ("x",), (2, 4): ("x", "y")}
EINSUMS = ["ab,bc->ac", "abc,cd->abd", "ab,bc,cd->ad", "ab,ab->ab", "ab,b->a", "ab->ba", "abc,ac->cb"]
MESHES = {
    (shape, kind): jax.make_mesh(
        shape, names, axis_types=(kind,) * len(shape), devices=jax.devices()[: int(np.prod(shape))]
    )
    for shape, names in MESH_SHAPES.items()
    for kind in (AxisType.Auto, AxisType.Explicit)
}


@st.composite
def layouts_for(draw, axes: str, sizes: dict, mesh_axes: tuple, usable: tuple | None = None):
    """A random layout (einshard.testing.expressions): each (usable) mesh axis splits at most one tensor axis."""
    shape = tuple(sizes[a] for a in axes)
    usable_names = None if usable is None else [m.name for m in usable]
    expr = draw(et.expressions(shape, {m.name: m.size for m in mesh_axes}, axes=usable_names))
    return Layout(tuple(axes), shape, mesh_axes, resolve_named(parse_placement(expr), shape, mesh_axes).dims)


@st.composite
def problems(draw):
    shape = draw(st.sampled_from(list(MESH_SHAPES)))
    kind = draw(st.sampled_from([AxisType.Auto, AxisType.Explicit]))
    mesh = MESHES[(shape, kind)]
    mesh_axes = tuple(MeshAxis(n, s) for n, s in zip(MESH_SHAPES[shape], shape, strict=True))
    size_of = {m.name: m.size for m in mesh_axes}
    subs = draw(st.sampled_from(EINSUMS))
    ins, out = subs.split("->")
    sizes = {a: draw(st.sampled_from([8, 16])) for a in set(subs) - set(",->")}
    lays_in = [draw(layouts_for(s, sizes, mesh_axes)) for s in ins.split(",")]
    contracted = sorted({c for c in ins if c not in ",-" and c not in out})
    # Half the time keep some mesh axes off the output, to contract over them in pieces below.
    reserved = draw(st.permutations(mesh_axes))[: draw(st.integers(1, len(mesh_axes)))]
    if not (contracted and draw(st.booleans())):
        reserved = []
    usable = tuple(m for m in mesh_axes if m not in reserved)
    lay_out = draw(layouts_for(out, sizes, mesh_axes, usable))
    one_step = draw(st.booleans())  # a multi-axis collective, or one collective per mesh axis
    before, after = [], []
    for i, lay in enumerate(lays_in):
        for d, axes in enumerate(lay.dims):
            if not axes:
                continue
            if one_step:
                before.append(Step("all-gather", i, axes, dim=d))
            else:  # minor first: each gather removes the minor-most split
                before.extend(Step("all-gather", i, (m,), dim=d) for m in reversed(axes))
    # Optionally contract one axis in pieces: slice it over mesh axes `group` in every operand that
    # has it, then reduce the partial sums: all-reduce, or reduce-scatter onto a result axis (whose
    # split then starts with `group`).
    slice_dims = [() for _ in out]
    if reserved:
        c = draw(st.sampled_from(contracted))
        group = tuple(m.name for m in reserved)
        n = int(np.prod([size_of[g] for g in group]))
        for i, operand_axes in enumerate(ins.split(",")):
            if c in operand_axes:
                before.append(Step("dynamic-slice", i, group, dim=operand_axes.index(c)))
        targets = [d for d in range(len(out)) if sizes[out[d]] % (lay_out.shards(d) * n) == 0]
        d = draw(st.sampled_from([None, *targets]))
        if d is None:
            after.append(Step("all-reduce", "out", group))
        else:
            after.append(Step("reduce-scatter", "out", group, dim=d))
            dims = list(lay_out.dims)
            slice_dims[d] = group  # already split by the reduce-scatter
            dims[d] = group + dims[d]
            lay_out = lay_out.with_dims(tuple(dims))
    for d, axes in enumerate(lay_out.dims):
        axes = axes[len(slice_dims[d]) :]
        if not axes:
            continue
        if one_step:
            after.append(Step("dynamic-slice", "out", axes, dim=d))
        else:  # major first: each slice appends a minor split
            after.extend(Step("dynamic-slice", "out", (m,), dim=d) for m in axes)
    return mesh, subs, lays_in, lay_out, before, after, draw(st.integers(0, 2**16))


def _check_gather_compute_slice_plans(problem):
    mesh, subs, lays_in, lay_out, before, after, seed = problem
    rng = np.random.default_rng(seed)
    ops = [rng.standard_normal(lay.shape).astype(np.float32) for lay in lays_in]
    f = einsum_shard_map(lays_in, lay_out, before, after, mesh=mesh, precision=HI)
    ref = jnp.einsum(subs, *ops, precision=HI)
    g = rng.standard_normal(ref.shape).astype(np.float32)
    argnums = tuple(range(len(ops)))
    with jax.set_mesh(mesh):
        y, grads = jax.jit(lambda *xs: (f(*xs), jax.grad(lambda *xs: jnp.sum(f(*xs) * g), argnums)(*xs)))(*ops)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    want_sharding = NamedSharding(mesh, PartitionSpec(*lay_out.spec_entries()))
    assert y.sharding.is_equivalent_to(want_sharding, y.ndim)  # (a size-1 mesh axis may be dropped from the spec)
    want = jax.grad(lambda *xs: jnp.sum(jnp.einsum(subs, *xs, precision=HI) * g), argnums)(*ops)
    for got, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


# 8 examples in the default run; 30 in the slow one (the same property)
@settings(max_examples=8, deadline=None)
@given(problems())
def test_gather_compute_slice_plans(problem):
    _check_gather_compute_slice_plans(problem=problem)


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(problems())
def test_gather_compute_slice_plans_deep(problem):
    _check_gather_compute_slice_plans(problem=problem)


def test_vmap_over_a_sharded_einsum():
    mesh = MESHES[((2, 4), AxisType.Auto)]
    axes = (MeshAxis("x", 2), MeshAxis("y", 4))
    x_lay = Layout(("b", "d"), (8, 8), axes, (("x",), ("y",)))
    w_lay = Layout(("d", "f"), (8, 4), axes, (("y",), ()))
    out = Layout(("b", "f"), (8, 4), axes, (("x",), ()))
    f = einsum_shard_map([x_lay, w_lay], out, [], [Step("all-reduce", "out", ("y",))], mesh=mesh, precision=HI)
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((3, 8, 8)).astype(np.float32)
    w = rng.standard_normal((8, 4)).astype(np.float32)
    got = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
    np.testing.assert_allclose(got, np.einsum("nbd,df->nbf", xs, w), rtol=1e-5, atol=1e-5)
