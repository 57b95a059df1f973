"""A weight split over two mesh axes, gathered by two dots: shared only where XLA gathers it alike.

A dot whose operands both split free (non-contracting) factors that the result splits alike, x[b@data, s, d] .
w[d@data, f@model] -> [b@data, s, f@model], is partitioned by XLA in groups over one operand's free splits
(LhsIsBestMatchForNonContractingPartitioning: the lhs where ``p_lhs * shard(rhs) < p_rhs * shard(lhs)``).  The
grouped operand's gather is made within the group, and XLA shares it with no gather of the same value made
outside a group (the input gradient's g[b@data, s, f@model] . w gathers w over 'data' before any grouping):
found on our decoder under FSDP + tensor parallelism (every weight [rows@data, cols@model]), where the MLP's gate
and up projections and the unembedding were gathered once more than explain said for the input gradient (2L+1
all-gathers too few).  rules_indexing.grouped_operand.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from collective_counts import explained_collectives, xla_collectives
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace

MESHES = {"4x2": ((4, 2), ("a", "b")), "2x4": ((2, 4), ("a", "b")), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}


Case = tuple[str, object, str, int, int, int, int, int, str]


@st.composite
def two_dots_case(draw: st.DrawFn) -> Case:
    mesh = draw(st.sampled_from(sorted(MESHES)))
    names = MESHES[mesh][1]
    # The batch's and the weight's rows' (FSDP) mesh axes and the weight's columns' (tensor parallel), every
    # mesh axis used (an idle one takes XLA's route over idle axes, idle_axes.py, not drawn here).
    cols = draw(st.sampled_from(names))
    rest = tuple(m for m in names if m != cols)
    rows: object = rest[0] if len(rest) == 1 else rest
    b = draw(st.sampled_from([8, 16]))
    s = draw(st.sampled_from([1, 16, 64, 256]))
    d = draw(st.sampled_from([32, 64, 128]))
    f = draw(st.sampled_from([8, 64, 128, 512]))
    heads = draw(st.sampled_from([0, 4]))  # a 2-D weight [d, f], or [d, heads, f // heads] split on the heads
    order = draw(st.sampled_from(["forward first", "gradient first", "forward twice"]))
    return mesh, rows, cols, b, s, d, f, heads, order


def _check(case: Case) -> None:
    mesh_name, rows, cols, b, s, d, f, heads, order = case
    shape, names = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    if heads:
        w_shape, w_spec, out_letters = (d, heads, f // heads), P(rows, cols, None), "hk"
        g_spec = P(rows, None, cols, None)
    else:
        w_shape, w_spec, out_letters = (d, f), P(rows, cols), "f"
        g_spec = P(rows, None, cols)
    x_spec = P(rows, None, None)
    fwd = f"bsd,d{out_letters}->bs{out_letters}"
    grad = f"bs{out_letters},d{out_letters}->bsd"
    if order == "forward first":
        fn = lambda x, g, w: (jnp.einsum(fwd, x, w), jnp.einsum(grad, g, w))  # noqa: E731
        outs = (g_spec, x_spec)
    elif order == "gradient first":
        fn = lambda x, g, w: (jnp.einsum(grad, g, w), jnp.einsum(fwd, x, w))  # noqa: E731
        outs = (x_spec, g_spec)
    else:
        fn = lambda x, g, w: (jnp.einsum(fwd, x, w), jnp.einsum(fwd, jnp.sin(x), w))  # noqa: E731
        outs = (g_spec, g_spec)
    g_shape = (b, s, *w_shape[1:])
    args = tuple(
        jax.ShapeDtypeStruct(sh, jnp.float32, sharding=NamedSharding(mesh, sp))
        for sh, sp in (((b, s, d), x_spec), (g_shape, g_spec), (w_shape, w_spec))
    )
    out = tuple(NamedSharding(mesh, sp) for sp in outs)
    compiled = jax.jit(fn, out_shardings=out).lower(*args).compile()
    xla, xla_bytes = xla_collectives(compiled)
    with jax.set_mesh(mesh):
        report = trace(fn, *args, mesh=mesh).report(None, list(outs))
    got, got_bytes = explained_collectives(report)
    assert got == xla, (case, got, xla)
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10), case


@example(case=("4x2", "a", "b", 8, 16, 64, 128, 0, "forward first"))  # the decoder's MLP gate: w gathered twice
@example(case=("4x2", "a", "b", 8, 16, 64, 64, 4, "forward first"))  # its q projection: w's shard 1/4 x's: once
@example(case=("4x2", "a", "b", 8, 16, 64, 128, 0, "gradient first"))
@example(case=("4x2", "a", "b", 8, 16, 64, 128, 0, "forward twice"))  # both grouped alike: once
@example(case=("4x2", "a", "b", 8, 256, 64, 128, 0, "forward first"))  # x's shard 32x w's: grouped on x, once
@given(case=two_dots_case())
@settings(max_examples=14, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_a_weight_split_over_two_axes_is_gathered_as_xla_groups_its_dots(case):
    """Drawn: the mesh (4x2, 2x4, 2x2x2), which mesh axis splits the weight's columns (the others its contracted
    rows and the batch), the sizes, a 2-D or a head-split 3-D weight, and the order of the two dots
    (the forward and the input gradient, either first, or the forward twice): explain's collectives are XLA's,
    kinds, counts and bytes."""
    _check(case)
