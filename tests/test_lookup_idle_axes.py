"""A lookup whose indices split over the mesh axis that splits the table's kept (feature) axis, other mesh axes idle.

keras-hub BERT's FSDP segment embedding: a (2, 32) table split along its features over 'data', looked up by ids
split along the batch over 'data', on (data=4, model=2).  XLA's SPMD partitioner moves one side's 'data' split onto
the idle axes (a collective-permute, an all-gather where they are fewer devices), looks up there and all-gathers the
result over them; which side turns on the split its propagation gave the result
(``rules_indexing._lookup_over_idle_axes``).  Each case compiles the program and holds explain's report against
XLA's HLO (collective kinds and counts exact, bytes within 10%, peak within the lookup's memory range) and its
result's layout; hypothesis draws the table's size, the mesh and how the result is read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, MEMORY_BOUNDS, SLACK_BYTES

from einshard._src.analysis.program.trace import trace
from einshard._src.testing.bounds import Measured, gaps, within_bound
from einshard.testing import hlo

# (mesh shape, names): the shared axis 'a' first; the idle devices fewer than, as many as, or more than its own.
MESHES = {"4x2": ((4, 2), ("a", "b")), "2x4": ((2, 4), ("a", "b")), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}
IDS = (8, 8)
TABLE = P(None, "a")  # the features over the ids' batch axis
BY_IDS = P("a")

# How the looked-up rows are read, and what the caller asks of the result:
# * "free": returned, nothing asked (XLA keeps the table's split: the ids move);
# * "as ids" / "as table": returned in the ids' split / the table's split;
# * "plus arg": added to an argument split like the ids (its split reaches the lookup first: the table moves
#   where that is cheaper), summed;
# * "plus lookup": added to another lookup's rows (an FSDP token table: rows over 'a'), summed: nothing settles
#   the result before the lookups, the ids move and the sum all-to-alls the rows (keras-hub BERT's embeddings).
# * "grad": the gradient of sum(rows ** 2) returned in the table's layout (its scatter-add reuses the moved ids and
#   sums the pieces over the idle axes);
# * "plus arg grad": the gradient of "plus arg" in the table's layout (the sum over the ids' axis asked split along
#   the features: the pieces summed over it and permuted, or the updates all-to-all'd and summed over the idle axes).
READS = ("free", "as ids", "as table", "plus arg", "plus lookup", "grad", "plus arg grad")


def _program(read: str, rows: int, cols: int) -> tuple[Any, tuple[Any, ...], tuple[P, ...], list[P] | None]:
    """(the function, its abstract arguments, their specs, the specs asked of its results or None)."""
    table = jax.ShapeDtypeStruct((rows, cols), jnp.float32)
    ids = jax.ShapeDtypeStruct(IDS, jnp.int32)
    if read in ("free", "as ids", "as table"):
        out = {"free": None, "as ids": [BY_IDS], "as table": [P(None, None, "a")]}[read]
        return (lambda t, i: t[i]), (table, ids), (TABLE, BY_IDS), out
    if read == "grad":
        return jax.grad(lambda t, i: jnp.sum(t[i] ** 2)), (table, ids), (TABLE, BY_IDS), [TABLE]
    if read == "plus arg grad":
        x = jax.ShapeDtypeStruct((*IDS, cols), jnp.float32)
        fn = jax.grad(lambda t, i, x: jnp.sum((t[i] + x) ** 2))
        return fn, (table, ids, x), (TABLE, BY_IDS, BY_IDS), [TABLE]
    if read == "plus arg":
        x = jax.ShapeDtypeStruct((*IDS, cols), jnp.float32)
        return (lambda t, i, x: jnp.sum((t[i] + x) ** 2)), (table, ids, x), (TABLE, BY_IDS, BY_IDS), [P()]
    tokens = jax.ShapeDtypeStruct((64, cols), jnp.float32)

    def two_lookups(tok: Any, t: Any, i: Any) -> Any:
        return jnp.sum((jnp.take(tok, i, axis=0) + jnp.take(t, i, axis=0)) ** 2)

    return two_lookups, (tokens, table, ids), (P("a"), TABLE, BY_IDS), [P()]


def _check(read: str, rows: int, cols: int, mesh_name: str) -> Any:
    shape, names = MESHES[mesh_name]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
    fn, args, specs, out = _program(read, rows, cols)
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    outs = None if out is None else NamedSharding(mesh, out[0])
    compiled = jax.jit(fn, in_shardings=shardings, out_shardings=outs).lower(*args).compile()
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    report = trace(fn, *args, mesh=dict(zip(names, shape))).report(specs, out)
    explained = [(c, op.repeat) for op in report.ops for c in op.collectives if c.group_size > 1]
    got = Measured(
        Counter(c.kind for c, r in explained for _ in range(r)),
        sum(c.bytes * r for c, r in explained),
        report.peak_bytes,
    )
    want = Measured(Counter(c.kind for c in found), sum(c.sent_bytes * c.runs for c in found), float(peak))
    gap = gaps(got, want, peak_range=MEMORY_BOUNDS["unfused"], peak_slack=SLACK_BYTES)
    where = (read, rows, cols, mesh_name, report.approximate_at)
    assert not report.unfollowed, where
    assert within_bound(gap, report.approximate_bound), (where, gap, report.approximate_bound, got, want)
    if out is None and read == "free":
        # The result's layout: the table's features split kept, the ids' batch split dropped.
        spec = tuple(compiled.output_shardings.spec) + (None,) * 3
        assert spec[:3] == (None, None, "a"), (where, spec)
    return report


@pytest.mark.parametrize("read", READS)
def test_keras_hub_bert_segment_lookup_matches_xla(read: str) -> None:
    """The corpus's shape: a (2, 32) segment table on (data=4, model=2), every way its rows are read; explain
    matches XLA with no approximate mark (its readers are in the walked jaxpr, or the caller asks the result)."""
    report = _check(read, 2, 32, "4x2")
    # ("plus lookup": its mark is the sum's conflict, movement.mark_conflict, where XLA takes explain's side.)
    if read != "plus lookup":
        assert not report.approximate_at, report.approximate_at


def _property(read: str, rows: int, cols: int, mesh_name: str) -> None:
    _check(read, rows, cols, mesh_name)


_draws = given(
    read=st.sampled_from(READS),
    rows=st.sampled_from([2, 8, 64]),
    cols=st.sampled_from([32, 64]),
    mesh_name=st.sampled_from(sorted(MESHES)),
)


@FAST
@_draws
@example(read="plus arg", rows=64, cols=32, mesh_name="4x2")  # the indices move, then the rows all-to-all
@example(read="as ids", rows=2, cols=32, mesh_name="2x4")  # the idle devices cover the split: no gather of it
def test_lookup_over_idle_axes_matches_xla(read: str, rows: int, cols: int, mesh_name: str) -> None:
    _property(read, rows, cols, mesh_name)


@pytest.mark.slow
@DEEP
@_draws
def test_lookup_over_idle_axes_matches_xla_deep(read: str, rows: int, cols: int, mesh_name: str) -> None:
    _property(read, rows, cols, mesh_name)


def test_lookup_read_outside_its_call_is_xlas() -> None:
    """``jnp.take`` is a ``jit`` call of its own, which XLA inlines before its propagation: a reader outside that
    meets an argument split like the ids reaches the lookup (XLA moves the table).  explain inlines the call too
    (:mod:`einshard._src.analysis.program.inline`), so it sees that reader: XLA's collectives and bytes, unmarked.
    (Walking the body as a call, it had moved the ids, and said so with a bound.)"""
    shape, names = MESHES["4x2"]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * 2)
    args = (
        jax.ShapeDtypeStruct((2, 32), jnp.float32),
        jax.ShapeDtypeStruct(IDS, jnp.int32),
        jax.ShapeDtypeStruct((*IDS, 32), jnp.float32),
    )
    specs = (TABLE, BY_IDS, BY_IDS)

    def fn(t: Any, i: Any, x: Any) -> Any:
        return jnp.sum((jnp.take(t, i, axis=0) + x) ** 2)

    compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, s) for s in specs)).lower(*args).compile()
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    report = trace(fn, *args, mesh=dict(zip(names, shape))).report(specs, [P()])
    explained = [c for op in report.ops for c in op.collectives if c.group_size > 1]
    gap = gaps(
        Measured(Counter(c.kind for c in explained), sum(c.bytes for c in explained), 0),
        Measured(Counter(c.kind for c in found), sum(c.sent_bytes for c in found), 0),
    )
    assert (gap.collectives, gap.bytes) == (0, 0), gap
    assert not report.approximate_at
