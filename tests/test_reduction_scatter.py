"""A reduction's pending sum reduce-scattered to the split its program output is asked for, as XLA does.

The gradient of a bias added to a batch-split activation (``x[b, s, h, k] + bias[h, k]``) is a ``reduce_sum``
over the batch, then JAX's transpose of the rank promotion: a reshape to ``[1, 1, h, k]`` and a sum of those
unit axes.  Where the gradient is asked split over the batch's mesh axes (``jit(out_shardings=)`` laying
gradients out as their parameters: every FSDP step), XLA reduce-scatters the sum; summed mesh axes the asked
split does not use are all-reduced first.  Each case compiles the gradient with XLA and holds explain's report
(``report(in_specs, out_specs)``, as the external corpus asks it) to XLA's collective kinds and counts, bytes
within 10% and peak within 25%, on Auto and Explicit meshes of 1, 2 and 3 axes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pytest
from explain_counts import explained
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard._src.testing.bounds import Measured, gaps, within_bound
from einshard.testing import hlo

MESHES: dict[int, tuple[tuple[int, ...], tuple[str, ...]]] = {
    1: ((8,), ("a",)),
    2: ((4, 2), ("a", "b")),
    3: ((2, 2, 2), ("a", "b", "c")),
}
BATCH, SEQ = 8, 4
PEAK_RANGE = (0.75, 1.25)  # the external corpus' 25%
SLACK_BYTES = 1024  # tiny programs: XLA's alignment and scalars dominate (as test_primitive_rules)
FAST = settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)


@dataclass(frozen=True)
class BiasCase:
    """``grad(sum((x + bias) ** 2))`` w.r.t. the bias, x[BATCH, SEQ, *bias_shape]: laid out how, on which mesh."""

    bias_shape: tuple[int, ...]
    x_spec: P
    bias_spec: P
    mesh_rank: int
    explicit: bool
    asked: bool = True  # whether the gradient is asked laid out as the bias (else XLA chooses: replicated)
    # "broadcast": x[BATCH, SEQ, *bias] + bias; "table": x[BATCH, *bias] + a dynamic_slice reading the whole bias
    # (a position table at full length, as keras-hub's PositionEmbedding reads it: its transpose writes the batch
    # sum into zeros with a dynamic_update_slice)
    read: Literal["broadcast", "table"] = "broadcast"


def _loss(b: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum((x + b) ** 2)


def _table_loss(b: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.sum((x + lax.dynamic_slice(b, (0,) * b.ndim, b.shape)) ** 2)


def _measured_xla(compiled: Any) -> Measured:
    text = compiled.as_text()
    kinds, sent = hlo.collective_counts(text), hlo.collective_bytes(text)  # normalized drops one-device groups
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return Measured(kinds, sent, float(peak))


def measure(case: BiasCase) -> tuple[Measured, Measured, Any]:
    """(XLA's numbers, explain's, explain's report) for the case's bias gradient."""
    shape, names = MESHES[case.mesh_rank]
    kind = AxisType.Explicit if case.explicit else AxisType.Auto
    mesh = jax.make_mesh(shape, names, axis_types=(kind,) * case.mesh_rank)
    bias_sh, x_sh = NamedSharding(mesh, case.bias_spec), NamedSharding(mesh, case.x_spec)
    out_sh = bias_sh if case.asked else None
    b = jax.ShapeDtypeStruct(case.bias_shape, jnp.float32)
    lead = (BATCH,) if case.read == "table" else (BATCH, SEQ)
    x = jax.ShapeDtypeStruct((*lead, *case.bias_shape), jnp.float32)
    fn: Any = jax.grad(_table_loss if case.read == "table" else _loss)
    with jax.set_mesh(mesh):
        if case.explicit:
            # Placed, as users pass them: their types carry the layout.  Where JAX refuses the add (both split
            # over one mesh axis), auto_axes is JAX's documented way, as the external corpus runs it.
            b = jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=bias_sh)
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x_sh)
            try:
                compiled = jax.jit(fn, out_shardings=out_sh).lower(b, x).compile()
            except Exception:  # noqa: BLE001 -- JAX's sharding-in-types refusal comes as several error types
                fn = jax.sharding.auto_axes(fn, out_sharding=bias_sh)
                compiled = jax.jit(fn, out_shardings=out_sh).lower(b, x).compile()
            in_specs = None
        else:
            compiled = jax.jit(fn, in_shardings=(bias_sh, x_sh), out_shardings=out_sh).lower(b, x).compile()
            in_specs = (case.bias_spec, case.x_spec)
        report = trace(fn, b, x, mesh=dict(zip(names, shape))).report(
            in_specs, [case.bias_spec] if case.asked else None
        )
    return _measured_xla(compiled), explained(report), report


def check(case: BiasCase) -> None:
    xla, got, report = measure(case)
    assert report.complete and not report.unfollowed, case
    gap = gaps(got, xla, peak_range=PEAK_RANGE, peak_slack=SLACK_BYTES)
    assert dict(got.kinds) == dict(xla.kinds), (case, got, xla)
    assert within_bound(gap, report.approximate_bound), (case, gap, got, xla)


CASES = [
    # one mesh axis: the bias split on either dim, rank 1 and 2
    BiasCase((4, 8), P("a"), P(None, "a"), 1, False),
    BiasCase((16,), P("a"), P("a"), 1, False),
    BiasCase((16,), P("a"), P("a"), 1, True),
    # two axes: the batch over one or both, the bias over them all, or over some (the rest all-reduced)
    BiasCase((4, 8), P("a"), P("a"), 2, False),
    BiasCase((4, 8), P("a"), P("a"), 2, True),
    BiasCase((4, 8), P(("a", "b")), P(None, ("a", "b")), 2, False),
    BiasCase((4, 8), P(("a", "b")), P(None, ("a", "b")), 2, True),
    BiasCase((4, 8), P(("a", "b")), P(None, "a"), 2, False),
    BiasCase((4, 8), P(("a", "b")), P("b"), 2, True),
    BiasCase((16,), P("a"), P("a"), 2, True),
    # three axes
    BiasCase((4, 8), P("a"), P(None, "a"), 3, False),
    BiasCase((4, 8), P("a"), P("a"), 3, True),
    BiasCase((2, 4, 8), P(("a", "b", "c")), P(None, None, ("a", "b")), 3, False),
    # a position table read whole by a dynamic_slice (its gradient written into zeros whole)
    BiasCase((8, 32), P("a"), P("a"), 2, False, read="table"),
    BiasCase((8, 32), P("a"), P(None, "a"), 2, True, read="table"),
    BiasCase((8, 32), P(("a", "b")), P(("a", "b")), 2, False, read="table"),
    BiasCase((8, 32), P("a"), P("a"), 3, False, read="table"),
    BiasCase((8, 32), P("a"), P("a"), 1, True, read="table"),
    # nothing asked: XLA returns the gradient whole, an all-reduce (the deferral must not invent a scatter)
    BiasCase((4, 8), P("a"), P("a"), 2, False, asked=False),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_bias_gradient_collectives_are_xlas(case: BiasCase) -> None:
    check(case)


# A sum over a batch split over (a, b) asked split a on one bias dim and b on another: XLA does one reduce-scatter
# over the 4 devices onto the 2-d tiling, and so does explain (rules_structural._scattered_at_once); on Explicit
# axes and onto three dimensions too.
@pytest.mark.parametrize(
    "case",
    [
        BiasCase((4, 8), P(("a", "b")), P("a", "b"), 3, False),
        BiasCase((4, 8), P(("a", "b")), P("a", "b"), 3, True),
        BiasCase((4, 8), P(("a", "b")), P("b", "a"), 2, False),
        BiasCase((2, 4, 8), P(("a", "b", "c")), P("a", "b", "c"), 3, False),
    ],
    ids=str,
)
def test_bias_gradient_scattered_onto_two_dims_is_one_reduce_scatter(case: BiasCase) -> None:
    check(case)


@st.composite
def bias_case(draw: Any) -> BiasCase:
    """A bias of rank 1-2, the batch split over a non-empty set of mesh axes, the bias split on one dim over a
    non-empty subset of them (the FSDP layout), Auto or Explicit, read broadcast or as a whole table."""
    rank = draw(st.sampled_from(sorted(MESHES)))
    sizes, names = MESHES[rank]
    size_of = dict(zip(names, sizes))
    batch = tuple(m for m in names if draw(st.booleans())) or (names[0],)
    bias_shape = draw(st.sampled_from([(16,), (8,), (4, 8), (8, 4), (2, 16)]))
    dim = draw(st.integers(0, len(bias_shape) - 1))
    onto = tuple(m for m in batch if draw(st.booleans())) or (batch[0],)
    if bias_shape[dim] % math.prod(size_of[m] for m in onto):
        onto = (onto[0],) if bias_shape[dim] % size_of[onto[0]] == 0 else ()
    entries: list[Any] = [None] * len(bias_shape)
    if onto:
        entries[dim] = onto[0] if len(onto) == 1 else onto
    read = draw(st.sampled_from(["broadcast", "table"]))
    x_spec = P(batch if len(batch) > 1 else batch[0])
    return BiasCase(bias_shape, x_spec, P(*entries), rank, draw(st.booleans()), read=read)


@FAST
@given(bias_case())
def test_bias_gradient_matches_xla_property(case: BiasCase) -> None:
    check(case)


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
@given(bias_case())
def test_bias_gradient_matches_xla_property_deep(case: BiasCase) -> None:
    check(case)
