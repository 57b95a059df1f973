"""A dot whose one operand splits a contracted axis against a whole (replicated) partner: XLA's base case.

XLA's partitioner slices the whole partner to the split and all-reduces the partial products only where the
split operand's splits cover every mesh axis and it has more elements than the result; else it gathers the
split operand (rules_indexing.slice_whole_partner, xla_gathered_operand).  The analyzer ranks by α–β time, which
counts the compute a gathered operand duplicates, and XLA's base case does not: found on the tensor-parallel
decoder's LM head (the final norm's output split over 'model' along the hidden axis, the unembedding whole),
where explain all-reduced the (batch, seq, vocab) logits and XLA gathers the (batch, seq, hidden) activation,
a quarter of the bytes at vocab = 4 x hidden.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from collective_counts import explained_collectives, xla_collectives
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.program import trace

MESHES = {1: ((8,), ("a",)), 2: ((4, 2), ("a", "b")), 3: ((2, 2, 2), ("a", "b", "c"))}


@st.composite
def whole_partner_case(draw: st.DrawFn) -> tuple[int, tuple[int, ...], int, int, object, object, bool, str]:
    axes = draw(st.sampled_from(sorted(MESHES)))
    names = MESHES[axes][1]
    # The contracted axis over one mesh axis or two, the rows (batch) over another one or whole.
    k_axes = draw(st.sampled_from([(m,) for m in names] + [(a, b) for a in names for b in names if a < b]))
    rows = draw(st.sampled_from([None, *[m for m in names if m not in k_axes]]))
    lead = tuple(draw(st.lists(st.sampled_from([8, 16, 32]), min_size=1, max_size=2)))
    k = draw(st.sampled_from([32, 64, 128]))
    n = draw(st.sampled_from([8, 24, 64, 96, 256]))
    k_spec = k_axes[0] if len(k_axes) == 1 else k_axes
    split_right = draw(st.booleans())  # the whole operand on the right (x @ w) or on the left (w.T @ x.T)
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    return axes, lead, k, n, k_spec, rows, split_right, dtype


def _check(case: tuple[int, tuple[int, ...], int, int, object, object, bool, str]) -> None:
    axes, lead, k, n, k_spec, rows, split_right, dtype = case
    shape, names = MESHES[axes]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))
    x_spec = P(rows, *([None] * (len(lead) - 1)), k_spec)
    x = jax.ShapeDtypeStruct((*lead, k), jnp.dtype(dtype), sharding=NamedSharding(mesh, x_spec))
    w = jax.ShapeDtypeStruct((k, n), jnp.dtype(dtype), sharding=NamedSharding(mesh, P()))
    if split_right:
        fn = lambda x, w: jnp.einsum("...k,kn->...n", x, w)  # noqa: E731
    else:
        fn = lambda x, w: jnp.einsum("kn,...k->n...", w, x)  # noqa: E731
    out = NamedSharding(mesh, P(rows) if split_right else P(None, rows))
    compiled = jax.jit(fn, out_shardings=out).lower(x, w).compile()
    xla, xla_bytes = xla_collectives(compiled)
    with jax.set_mesh(mesh):
        report = trace(fn, x, w, mesh=mesh).report(None, [out.spec])
    got, got_bytes = explained_collectives(report)
    assert got == xla, (case, got, xla)
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10), case


@example(case=(2, (8, 16), 64, 256, "b", "a", True, "float32"))  # the LM head's: explain all-reduced the logits
@example(case=(2, (8, 16), 128, 24, "b", None, True, "float32"))  # 'a' idle: XLA gathers whatever the sizes
@example(case=(2, (16, 16), 128, 128, ("a", "b"), None, True, "float32"))  # as many elements as the result
@given(case=whole_partner_case())
@settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_a_split_contraction_against_a_whole_partner_is_xlas(case):
    """Drawn: the mesh (1, 2 or 3 axes), the contracted axis's split (one mesh axis or two), the rows' split or
    none, the sizes, which side the whole operand is on, the dtype: explain's collectives are XLA's, kinds, counts
    and bytes."""
    _check(case)


def _decoder_tail(x, w, u):
    h = x @ w  # the hidden axis over 'b' (w's columns)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6)
    return jnp.mean(jax.nn.log_softmax(h @ u))  # the LM head: u whole


@pytest.mark.parametrize("vocab", [64, 256])
def test_a_tensor_parallel_lm_head_gathers_the_hidden_state(vocab):
    """The decoder's tail under tensor parallelism and its gradient: XLA gathers the normed hidden state for the
    whole unembedding at every vocabulary size (explain all-reduced the logits once they outweighed it)."""
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    args = tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((8, 16, 64), (64, 64), (64, vocab)))
    specs = ("b s d -> b@a s d", "d e -> d e@b", "d v -> d v")
    shardings = tuple(einshard.sharding(e, a.shape, mesh=mesh) for e, a in zip(specs, args))
    placed = jax.device_put(args, shardings)
    for fn, out in (
        (_decoder_tail, NamedSharding(mesh, P())),
        (jax.grad(_decoder_tail, argnums=(1, 2)), shardings[1:]),
    ):
        with jax.set_mesh(mesh):
            compiled = jax.jit(fn, in_shardings=shardings, out_shardings=out).lower(*placed).compile()
            specs_out = [s.spec for s in jax.tree.leaves(out)]
            report = trace(fn, *placed, mesh=mesh).report(specs, specs_out)
        xla, xla_bytes = xla_collectives(compiled)
        got, got_bytes = explained_collectives(report)
        assert xla["all-gather"] >= 1  # the measurement: the hidden state gathered for the head
        assert got == xla
        assert got_bytes == pytest.approx(xla_bytes, rel=0.10)
