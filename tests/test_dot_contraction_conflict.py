"""A dot whose operands split one mesh axis on different contracted axes: XLA all-to-alls the smaller operand.

Found on keras-hub's OPT, ELECTRA, Phi-3 and ALBERT under tensor parallelism (benchmarks/keras_hub_probe.py, every
kernel's second axis over 'model'): the attention output o[b, s, h@model, k] (heads split, as the q/k/v kernels
(hidden, heads, head_dim) split them) meets the output projection's kernel wo[h, k@model, d] (its head_dim split).
Both operands split 'model', on different contracted axes.  XLA's partitioner reshards the operand with the
smaller shard to the other's contracted split (one all-to-all) and all-reduces the partial products over 'model'
(rules_indexing.contraction_conflict); explain gathered both and marked the dot approximate.
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


def _compare(fn, shapes, specs, mesh):
    """XLA's collectives (kind, array bytes) and explain's, and whether explain's report is approximate."""
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p)) for s, p in zip(shapes, specs)]
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
        report = trace(fn, *args, mesh=mesh).report(tuple(specs))
    xla_kinds, xla_bytes = xla_collectives(compiled)
    got, got_bytes = explained_collectives(report)
    return xla_kinds, got, xla_bytes, got_bytes, report.approximate


def _projection(o, wo):
    return jnp.einsum("bshk,hkd->bsd", o, wo)


def _attention(x, wq, wk, wv, wo):
    # keras-hub's MultiHeadAttention under tensor parallelism, reduced: q/k/v kernels split on the heads, the output
    # kernel on the head width.
    q, k, v = (jnp.einsum("bse,ehk->bshk", x, w) for w in (wq, wk, wv))
    scores = jax.nn.softmax(jnp.einsum("bqhk,bthk->bhqt", q, k), axis=-1)
    o = jnp.einsum("bhqt,bthk->bqhk", scores, v)
    return jnp.mean(jnp.square(jnp.einsum("bshk,hkd->bsd", o, wo)))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_attention_output_projection_all_to_alls_the_kernel(explicit):
    """The reduced OPT forward: XLA all-to-alls wo (the smaller shard) and all-reduces the projection, once."""
    b, s, e, h, k = 8, 8, 32, 4, 8
    shapes = [(b, s, e), (e, h, k), (e, h, k), (e, h, k), (h, k, e)]
    specs = [P(), P(None, "model"), P(None, "model"), P(None, "model"), P(None, "model")]
    xla, got, xla_bytes, got_bytes, approximate = _compare(_attention, shapes, specs, _mesh(explicit=explicit))
    assert xla["all-to-all"] == 1 and xla["all-gather"] == 0  # the measurement this test was written from
    assert got == xla and not approximate
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10)


@given(
    mesh_shape=st.sampled_from([(4, 2), (2, 4), (2, 2)]),
    axis=st.sampled_from(["model", "data"]),
    batch_on_other=st.booleans(),
    lhs_splits_heads=st.booleans(),
    sizes=st.sampled_from([(8, 8, 4, 8, 32), (2, 2, 4, 8, 32), (4, 4, 4, 8, 16), (4, 8, 8, 4, 64), (2, 4, 8, 8, 8)]),
    explicit=st.booleans(),
)
@settings(max_examples=24, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_a_contracted_split_clash_moves_the_smaller_shard(
    mesh_shape, axis, batch_on_other, lhs_splits_heads, sizes, explicit
):
    """Drawn: the mesh, the mesh axis both operands split (on different contracted axes, which one each), the
    batch over the other mesh axis or whole, the sizes (either operand's shard the smaller, or a tie), Auto or
    Explicit: explain's collectives are XLA's, kinds, counts and bytes, and the dot is not approximate."""
    b, s, h, k, d = sizes
    other = "data" if axis == "model" else "model"
    batch = other if batch_on_other else None
    o_spec = P(batch, None, axis) if lhs_splits_heads else P(batch, None, None, axis)
    w_spec = P(None, axis) if lhs_splits_heads else P(axis)
    sizes_of = dict(zip(("data", "model"), mesh_shape))
    assume(not batch_on_other or b % sizes_of[other] == 0)
    mesh = _mesh(mesh_shape, explicit)
    xla, got, xla_bytes, got_bytes, approximate = _compare(
        _projection, [(b, s, h, k), (h, k, d)], [o_spec, w_spec], mesh
    )
    assert xla["all-to-all"] == 1  # XLA's way, drawn after drawn
    assert got == xla and not approximate
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10)
