"""A dot whose one operand splits a contracted axis over the mesh axes its partner splits a batch axis over.

Found on keras-hub's OPT, ELECTRA, Phi-3 and ALBERT gradients under tensor parallelism
(benchmarks/keras_hub_probe.py): the attention output's cotangent do[b, q, h, k@model] (computed against the output
kernel wo[h, k@model, d], its head width split) meets v[b, t, h@model, k] (heads split) in ds = do . v^T, the heads
a batch axis.  XLA brings do to v's batch split.  With at least as many idle devices (mesh axes neither operand
uses) as the moved axis has, it slices do's heads over some of them, permutes the blocks and gathers the head width
over them (a collective-permute and an all-gather, rules_indexing.batch_split_via_idle); with fewer, it all-to-alls
do.  explain all-to-all'd it always (and marked the dot approximate where do is computed).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from collective_counts import explained_collectives, xla_collectives
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace


def _mesh(shape=(4, 2), explicit=False):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, ("data", "model"), axis_types=(kind,) * 2, devices=devices)


def _compare(fn, shapes, specs, mesh, out=None):
    """XLA's collectives (kind, array bytes) and explain's, and whether explain's report is approximate."""
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p)) for s, p in zip(shapes, specs)]
    with jax.set_mesh(mesh):
        jitted = jax.jit(fn, out_shardings=None if out is None else NamedSharding(mesh, out))
        compiled = jitted.lower(*args).compile()
        report = trace(fn, *args, mesh=mesh).report(tuple(specs), None if out is None else [out])
    xla_kinds, xla_bytes = xla_collectives(compiled)
    got, got_bytes = explained_collectives(report)
    return xla_kinds, got, xla_bytes, got_bytes, report.approximate


def _scores(do, v):
    return jnp.einsum("bqhk,bthk->bhqt", do, v)


def _scores_swapped(v, do):
    return jnp.einsum("bthk,bqhk->bhqt", v, do)


def _scores_of_computed(dy, wo, v):
    do = jnp.einsum("bsd,hkd->bshk", dy, wo)  # the output projection's input gradient
    return jnp.einsum("bqhk,bthk->bhqt", do, v)


def test_attention_backward_scores_move_the_cotangent_through_idle_axes():
    """The reduced OPT backward on (4, 2): XLA permutes and gathers do (no all-to-all); explain the same, exact."""
    b, s, h, k, d = 8, 8, 4, 8, 32
    shapes = [(b, s, d), (h, k, d), (b, s, h, k)]
    specs = [P(), P(None, "model"), P(None, None, "model")]
    xla, got, xla_bytes, got_bytes, approximate = _compare(
        _scores_of_computed, shapes, specs, _mesh(), out=P(None, "model")
    )
    assert xla["all-to-all"] == 0 and xla["collective-permute"] == 1 and xla["all-gather"] == 1  # as measured
    assert got == xla and not approximate
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10)


@given(
    mesh_shape=st.sampled_from([(4, 2), (2, 4), (2, 2), (1, 4), (4, 1)]),
    axis=st.sampled_from(["model", "data"]),
    batch_on_other=st.booleans(),
    swapped=st.booleans(),
    sizes=st.sampled_from([(8, 8, 4, 8), (2, 4, 4, 8), (4, 8, 8, 4), (8, 4, 4, 16)]),
    out_split=st.booleans(),
)
@settings(max_examples=24, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_a_contracted_split_against_a_batch_split(mesh_shape, axis, batch_on_other, swapped, sizes, out_split):
    """Drawn: the mesh, the mesh axis M (do's head width, v's heads), the batch over the other mesh axis or whole
    (which leaves no idle axis, or one), the operands' order, the sizes, the result laid out as v's heads or left
    to XLA: explain's collectives are XLA's, kinds, counts and bytes, and the dot is not approximate."""
    b, s, h, k = sizes
    other = "data" if axis == "model" else "model"
    sizes_of = dict(zip(("data", "model"), mesh_shape))
    assume(sizes_of[axis] > 1 and h % sizes_of[axis] == 0 and k % sizes_of[axis] == 0)
    batch = other if batch_on_other else None
    assume(not batch_on_other or (sizes_of[other] > 1 and b % sizes_of[other] == 0))
    do_spec, v_spec = P(batch, None, None, axis), P(batch, None, axis)
    shapes, specs, fn = [(b, s, h, k), (b, s, h, k)], [do_spec, v_spec], _scores
    if swapped:
        shapes, specs, fn = shapes[::-1], specs[::-1], _scores_swapped
    out = P(batch, axis) if out_split else None
    xla, got, xla_bytes, got_bytes, approximate = _compare(fn, shapes, specs, _mesh(mesh_shape), out=out)
    assert got == xla and not approximate
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10)
