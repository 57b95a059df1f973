"""The report says, on its first line, when an op's collectives turn on an XLA heuristic explain does not reproduce.

Such ops are marked by their rule (``OpReport.note`` starts with ``approximate:``); the report counts them,
names their source lines and bounds how far XLA's collectives may be from its own: on the first line, in
``to_dict()`` and as ``report.approximate`` / ``approximate_at`` / ``approximate_bound``.  The bound is held
against the compiled HLO on one-op programs where the marks fire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from test_primitive_rules import Case, _explain, _mesh, _xla

import einshard
from einshard._src.analysis.program.memory import SCRATCH
from einshard._src.testing.bounds import Measured, gaps


def _concat(x: Any) -> Any:
    return jnp.concatenate([x, 2 * x], axis=0)


def test_first_line_counts_the_approximate_ops_names_their_lines_and_bounds_them() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = einshard.einshard(np.ones((64, 16), np.float32), "a b -> a@x b", mesh=mesh)
    report = einshard.explain(_concat, x, mesh=mesh)
    first = str(report).splitlines()[0]
    assert report.approximate and report.complete
    assert first.startswith("APPROXIMATE: 2 ops ")
    assert "concatenate at " in first and "test_explain_approximate.py:" in first and "(_concat)" in first
    bound = report.approximate_bound
    # Two all-gathers over 8 devices: 7 peers each, the whole buffer each.
    assert bound.collectives == 14 and bound.bytes == 2 * 64 * 16 * 4
    assert f"by up to 14 collectives and {bound.bytes / 1024:.1f} KiB/device" in first
    assert "profile: " in first  # the mesh and profile stay on the first line
    d = report.to_dict()
    assert d["approximate"] is True and d["approximate_at"] == list(report.approximate_at)
    assert d["approximate_bound"] == {"collectives": 14, "bytes": bound.bytes, "peak": 0.0}
    # Each approximate op says why, under its line.
    assert sum("approximate: concatenate along a split axis" in line for line in str(report).splitlines()) == 2


def test_an_exact_report_says_nothing_of_the_kind() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = einshard.einshard(np.ones((64, 16), np.float32), "a b -> a@x b", mesh=mesh)
    report = einshard.explain(lambda x: jnp.tanh(x).sum(0), x, mesh=mesh)
    assert not report.approximate and report.approximate_at == ()
    assert not str(report).startswith("APPROXIMATE")
    d = report.to_dict()
    assert d["approximate"] is False and d["approximate_bound"] == {"collectives": 0, "bytes": 0, "peak": 0}


def test_a_run_time_trip_count_has_no_static_bound() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = einshard.einshard(np.ones((64, 16), np.float32), "a b -> a@x b", mesh=mesh)

    def loop(x: Any) -> Any:  # the trip count is a value: XLA runs the body's all-reduce that many times
        return lax.while_loop(lambda c: c[1].sum() < 1e6, lambda c: (c[0] + 1, c[1] + c[1].sum(0)), (0, x))[1]

    report = einshard.explain(loop, x, mesh=mesh)
    assert report.approximate
    assert report.approximate_bound.collectives is None and report.approximate_bound.bytes is None
    assert "known only at run time" in str(report).splitlines()[0]
    assert report.to_dict()["approximate_bound"] == {"collectives": None, "bytes": None, "peak": 0.0}


F32 = jnp.float32
# One-op programs whose rule marks the op approximate (XLA's choice there is a heuristic), each with the layout
# that triggers the mark: the bound must hold against what XLA compiles.
MARKED: dict[str, tuple[Callable[..., Any], tuple[int, ...], P, int]] = {
    "concatenate": (_concat, (64, 16), P("a"), 1),
    "concatenate-2axis": (_concat, (64, 16), P(("a", "b")), 2),
    "pad-crop": (lambda x: lax.pad(x, F32(0), ((-3, 5, 0), (0, 0, 0))), (64, 16), P("a"), 1),
    "pad-interior": (lambda x: lax.pad(x, F32(0), ((0, 0, 1), (0, 0, 0))), (32, 16), P("a"), 1),
    "slice-strided": (lambda x: lax.slice(x, (0, 0), (64, 16), (2, 1)), (64, 16), P("a"), 1),
    "slice-small": (lambda x: x[5:9], (64, 16), P("a"), 1),
}


@pytest.mark.parametrize("name", sorted(MARKED))
@pytest.mark.parametrize("grad", [False, True])
def test_xla_stays_within_the_stated_bound(name: str, grad: bool) -> None:
    fn, shape, spec, rank = MARKED[name]
    case = Case(name, fn, (jax.ShapeDtypeStruct(shape, F32),), (spec,), rank, False, grad)
    mesh = _mesh(rank, False)
    run = jax.grad(lambda x: jnp.sum(fn(x) ** 2)) if grad else fn
    want_kinds, want_bytes, _, _ = _xla(case, mesh, run)
    report, got_kinds, got_bytes, _ = _explain(case, mesh, run)
    if not report.approximate:
        # The rule was exact for this layout: then it must match XLA outright.
        assert got_kinds == want_kinds and abs(got_bytes - want_bytes) <= 0.1 * max(want_bytes, 1)
        return
    bound = report.approximate_bound
    assert bound.collectives is not None and bound.bytes is not None
    count_gap = abs(sum(got_kinds.values()) - sum(want_kinds.values()))
    assert count_gap <= bound.collectives, (name, got_kinds, want_kinds, bound)
    # explain's bytes are what each device sends; the compiled side's are buffer sizes: compare sent vs sent.
    assert abs(got_bytes - want_bytes) <= max(bound.bytes, 0.1 * max(want_bytes, 1)) + 1024, (
        name,
        got_bytes,
        want_bytes,
        bound,
    )


# A layout conflict at an elementwise op or a dot (operands split one mesh axis along different dimensions, settled
# by an all-to-all): a MoE router's weights [e, t] (tokens split, from top_k + one_hot on token-split logits)
# meeting the expert-split activations [e@x, t, f].  XLA's propagation carries the expert split back through the
# routing chain and gathers the top-k outputs instead of the all-to-all, and may reduce-scatter the expert sum; the
# op is marked, and XLA stays within the bound.  Where the moved operand is an argument, XLA makes explain's
# all-to-all: no mark, and an exact match.
T, D, E, K = 64, 16, 8, 2


def _routed(x: Any, wr: Any, we: Any) -> Any:
    probs = jax.nn.softmax(x @ wr, axis=-1)
    top_p, top_i = lax.top_k(probs, K)
    routing = jnp.sum(jax.nn.one_hot(top_i, E) * top_p[..., None], axis=1).T  # [e, t]
    out = jnp.einsum("td,edf->etf", x, we)  # [e, t, f]: the experts split, every token
    return jnp.sum(out * routing[:, :, None], axis=0)


def _weighted(out: Any, routing: Any) -> Any:
    return jnp.sum(out * routing, axis=0)


def _edit_distance(a: Any, b: Any) -> int:
    return max(sum((a - b).values()), sum((b - a).values()))


@pytest.mark.parametrize("rank", [1, 2, 3])
@pytest.mark.parametrize("grad", [False, True])
def test_a_conflict_on_a_computed_value_is_marked_and_xla_stays_within_its_bound(rank: int, grad: bool) -> None:
    mesh = _mesh(rank, False)
    first = mesh.axis_names[0]
    args = (
        jax.ShapeDtypeStruct((T, D), F32),
        jax.ShapeDtypeStruct((D, E), F32),
        jax.ShapeDtypeStruct((E, D, D), F32),
    )
    case = Case("mul", _routed, args, (P(first), P(), P(first)), rank, False, grad)
    run = jax.grad(lambda *a: jnp.sum(_routed(*a) ** 2), argnums=(0, 1, 2)) if grad else _routed
    want_kinds, want_bytes, _, want_peak = _xla(case, mesh, run)
    report, got_kinds, got_bytes, _ = _explain(case, mesh, run)
    assert report.approximate and report.complete
    first_line = str(report).splitlines()[0]
    assert first_line.startswith("APPROXIMATE: ") and "mul at " in first_line and "(_routed)" in first_line
    assert all("operands split one mesh axis" in op.note for op in report.approximate_ops)
    bound = report.approximate_bound
    assert bound.collectives is not None and bound.bytes is not None
    assert _edit_distance(got_kinds, want_kinds) <= bound.collectives, (got_kinds, want_kinds, bound)
    assert abs(got_bytes - want_bytes) <= bound.bytes, (got_bytes, want_bytes, bound)
    # Peak: within the range the report's caveat states (top_k's scratch: memory.SCRATCH), and beyond it by at
    # most the bound (the rank-1 gradient reads 3.1x XLA's: within 1.55x plus the bound).
    assert "top_k" in report.peak_note
    got, want = Measured(got_kinds, got_bytes, report.peak_bytes), Measured(want_kinds, want_bytes, want_peak)
    gap = gaps(got, want, peak_range=SCRATCH["top_k"][1:])
    assert gap.peak <= bound.peak, (report.peak_bytes, want_peak, gap, bound)


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_a_conflict_on_an_argument_is_explains_all_to_all_unmarked(rank: int) -> None:
    mesh = _mesh(rank, False)
    first = mesh.axis_names[0]
    args = (jax.ShapeDtypeStruct((E, T, D), F32), jax.ShapeDtypeStruct((E, T, 1), F32))
    case = Case("mul", _weighted, args, (P(first), P(None, first)), rank, False, False)
    want_kinds, want_bytes, _, _ = _xla(case, mesh, _weighted)
    report, got_kinds, got_bytes, _ = _explain(case, mesh, _weighted)
    assert not report.approximate
    assert want_kinds["all-to-all"] == 1 and got_kinds == want_kinds and got_bytes == want_bytes
