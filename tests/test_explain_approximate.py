"""The report says, on its first line, when an op's collectives turn on an XLA heuristic explain does not reproduce.

Such ops are marked by their rule (``OpReport.note`` starts with ``approximate:``); the report counts them,
names their source lines and bounds how far XLA's collectives may be from its own: on the first line, in
``to_dict()`` and as ``report.approximate`` / ``approximate_at`` / ``approximate_bound``.  The bound is held
against the compiled HLO on one-op programs where the marks fire.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, reject
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, Case, _explain, _mesh, _xla

import einshard
from einshard._src.testing.bounds import Measured, gaps


def _concat(x: Any) -> Any:
    return jnp.concatenate([x, 2 * x], axis=0)


def test_first_line_counts_the_approximate_ops_names_their_lines_and_bounds_them() -> None:
    mesh = jax.make_mesh((8,), ("x",))
    x = einshard.einshard(np.ones((64, 16), np.float32), "a b -> a@x b", mesh=mesh)
    report = einshard.explain(_concat, x, mesh=mesh)
    first = str(report).splitlines()[0]
    assert report.approximate and report.complete
    assert first.startswith("APPROXIMATE: 3 ops ")
    assert "concatenate at " in first and "test_explain_approximate.py:" in first and "(_concat)" in first
    bound = report.approximate_bound
    # XLA's way (rules_structural.moved_off_axis): each operand's rows split moved onto the columns, the join, the
    # result's moved back: three all-to-alls over 8 devices (512, 512 and 1024 B), 7 peers each, each buffer whole.
    kinds = [c.kind for op in report.ops for c in op.collectives]
    assert kinds == ["all-to-all"] * 3
    assert bound.collectives == 21 and bound.bytes == 512 + 512 + 1024
    assert f"by up to 21 collectives and {bound.bytes / 1024:.1f} KiB/device" in first
    assert "profile: " in first  # the mesh and profile stay on the first line
    d = report.to_dict()
    assert d["approximate"] is True and d["approximate_at"] == list(report.approximate_at)
    assert d["approximate_bound"] == {"collectives": 21, "bytes": bound.bytes, "peak": bound.bytes}  # each held whole
    # Each approximate op says why, under its line.
    assert sum("approximate: concatenate along a split axis" in line for line in str(report).splitlines()) == 3


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
# by an all-to-all): dense routing weights [e, t] (a softmax over the router's logits, tokens split) meeting the
# expert-split activations [e@x, t, f].  The moved operand is computed by a chain that reaches a dot whose result
# cannot be brought to the expert split by a plain gather, so explain moves it where the splits meet; XLA may carry
# the split back further and settle it another way: the op is marked, and XLA stays within the bound.  (A top-k
# router's chain reaches plain gathers of the top-k outputs: explain carries the split back as XLA does, exact and
# unmarked: tests/test_moe_rules.py.)  Where the moved operand is an argument, XLA makes explain's all-to-all: no
# mark, and an exact match.
T, D, E, K = 64, 16, 8, 2


def _routed(x: Any, wr: Any, we: Any) -> Any:
    routing = jax.nn.softmax(x @ wr, axis=-1).T  # [e, t]
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
    # (the gradient's dots whose contraction only one operand splits are marked too: rules_indexing.dot_general)
    notes = ("operands split one mesh axis", "one operand splits a contracted axis")
    assert all(any(n in op.note for n in notes) for op in report.approximate_ops)
    assert any(notes[0] in op.note for op in report.approximate_ops)
    bound = report.approximate_bound
    assert bound.collectives is not None and bound.bytes is not None
    assert _edit_distance(got_kinds, want_kinds) <= bound.collectives, (got_kinds, want_kinds, bound)
    assert abs(got_bytes - want_bytes) <= bound.bytes, (got_bytes, want_bytes, bound)
    # Peak: within the corpus's 25%, and beyond it by at most the bound.
    got, want = Measured(got_kinds, got_bytes, report.peak_bytes), Measured(want_kinds, want_bytes, want_peak)
    gap = gaps(got, want)
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


# An approximate mark whose rule knows XLA's other choice: the report walks the program under that choice too
# (einshard._src.analysis.program.alternatives) and the op's bound covers what the choice changes downstream.
# A 3×3 stride-2 conv whose window is longer than its result, on rows split over a mesh axis (Auto mesh): XLA's
# choice turns on the conv's users (rules_windows.ROWS_SPLIT_FORK).  Followed by a batch norm alone, XLA gathers
# the input's rows and leaves the result whole, the batch norm's all-reduces over that axis gone (measured: 1
# all-gather and 2 all-reduces): explain's main walk, exact.  Followed by a residual add of a rows-split shortcut
# (a 1x1 stride-2 conv, as in a ResNet block), XLA keeps the rows split and exchanges halos, the batch norm's
# all-reduces kept (measured, 4 rows: 1 collective-permute and 4 all-reduces): the fork's walk — more than the
# conv's own collectives, which was the whole bound before.
def _conv_norm(x: Any, k: Any) -> Any:
    pad = k.shape[0] // 2
    x = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    y = lax.conv_general_dilated(x, k, (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    mean = y.mean((0, 1, 2))
    var = ((y - mean) ** 2).mean((0, 1, 2))
    return jax.nn.relu((y - mean) / jnp.sqrt(var + 1e-5))


def _conv_norm_residual(x: Any, k: Any) -> Any:
    shortcut = lax.conv_general_dilated(x, k[:1, :1], (2, 2), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return _conv_norm(x, k) + shortcut


# Each program with whether XLA takes the main walk's choice (gathered rows) or the fork's (rows kept split).
CHOICE_PROGRAMS: dict[str, tuple[Callable[..., Any], bool]] = {
    "conv-norm": (_conv_norm, True),
    "conv-norm-residual": (_conv_norm_residual, False),
}


def _sent(fn: Callable[..., Any], mesh: Any, args: Any, specs: Any) -> tuple[Any, float, float]:
    """XLA's collectives (kinds, counted per run), bytes sent per device and peak bytes, as the corpus counts them."""
    from collections import Counter

    from jax.sharding import NamedSharding

    from einshard.testing import hlo

    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    kinds = Counter({c.kind: 0 for c in found})
    for c in found:
        kinds[c.kind] += c.runs
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return kinds, float(sum(c.sent_bytes * c.runs for c in found)), float(peak)


def _explained(fn: Callable[..., Any], mesh: Any, args: Any, specs: Any) -> Any:
    from einshard._src.analysis.program import trace

    return trace(fn, *args, mesh=dict(zip(mesh.axis_names, mesh.axis_sizes))).report(specs)


def _kinds_of(report: Any) -> Any:
    from collections import Counter

    return Counter(c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1)


# The residual program's gradient is no decision point: its residual asks the conv's rows split (through the
# gradient's elementwise ops, rules_windows._rows_asked), so the main walk takes XLA's choice, halo permutes,
# unmarked and exact (test_a_residual_conv_gradient_takes_xlas_choice_unmarked).  The forward residual and both
# batch-norm-alone programs still fork.
FORKING_DRAWS = [
    (rows, window, grad, program)
    for program in sorted(CHOICE_PROGRAMS)
    for rows, window, grad in [(4, 3, False), (4, 3, True), (12, 7, False)]
    if not (grad and program == "conv-norm-residual")
]


@pytest.mark.parametrize(("rows", "window", "grad", "program"), FORKING_DRAWS)
def test_a_marked_choice_bounds_what_it_changes_downstream(
    rows: int, window: int, grad: bool, program: str, monkeypatch: Any
) -> None:
    from einshard._src.analysis.program import alternatives

    fn, xla_takes_main = CHOICE_PROGRAMS[program]
    mesh = _mesh(2, False)
    args = (jax.ShapeDtypeStruct((8, rows, rows, 16), F32), jax.ShapeDtypeStruct((window, window, 16, 16), F32))
    specs = (P("a", "b"), P())  # batch over 'a', rows over 'b'
    run = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1)) if grad else fn
    want_kinds, want_bytes, want_peak = _sent(run, mesh, args, specs)
    report = _explained(run, mesh, args, specs)
    assert report.approximate and report.complete and report.alternatives_unwalked == 0
    assert any(op.alternative for op in report.approximate_ops)
    bound = report.approximate_bound
    assert bound.collectives is not None and bound.bytes is not None
    assert _edit_distance(_kinds_of(report), want_kinds) <= bound.collectives, (_kinds_of(report), want_kinds, bound)
    assert abs(report.comm_bytes - want_bytes) <= max(bound.bytes, 0.1 * want_bytes), (report.comm_bytes, want_bytes)
    if not report.peak_note:  # a conv's window scratch has its own peak caveat (memory.peak_caveat)
        assert abs(report.peak_bytes - want_peak) <= max(bound.peak, 0.25 * want_peak), (report.peak_bytes, want_peak)
    # The walk the report gives is the main one: only the marked op's bound differs from a report walked without
    # forks, which keeps the local bound and says so on its first line.
    monkeypatch.setattr(alternatives, "MAX_FORKS", 0)
    local = _explained(run, mesh, args, specs)
    assert local.alternatives_unwalked == len({op.alternative for op in report.ops if op.alternative})
    assert "not walked to the program's end" in str(local).splitlines()[0]
    assert [dataclasses.replace(op, bound=None) for op in local.ops] == [
        dataclasses.replace(op, bound=None) for op in report.ops
    ]
    assert (local.comm_bytes, local.peak_bytes, local.comm_count) == (
        report.comm_bytes,
        report.peak_bytes,
        report.comm_count,
    )
    # The choice is real: its other branch changes the ops downstream, beyond the conv's own collectives.
    local_bound = local.approximate_bound
    assert local_bound.collectives is not None and local_bound.bytes is not None
    assert bound.collectives > local_bound.collectives, (bound, local_bound)
    if grad:
        return  # (the gradients: within the bound above; the forward programs say which branch XLA took)
    if xla_takes_main:  # the batch norm alone: XLA gathers the rows, the main walk's choice, exactly
        assert _kinds_of(report) == want_kinds and report.comm_bytes == want_bytes, (_kinds_of(report), want_kinds)
    else:  # the residual add: XLA keeps the rows split, the fork's choice, which the local bound alone did not cover
        assert want_kinds["collective-permute"] >= 1 and "all-gather" not in want_kinds, want_kinds
        assert _edit_distance(_kinds_of(report), want_kinds) > local_bound.collectives, (want_kinds, local_bound)


@pytest.mark.parametrize(("rows", "window"), [(4, 3), (12, 7)])
def test_a_residual_conv_gradient_takes_xlas_choice_unmarked(rows: int, window: int) -> None:
    """The gradient of a conv whose window covers its result, added to a rows-split shortcut: the residual asks
    the rows split, and explain's main walk is XLA's (halo permutes, the batch norm's all-reduces kept), with no
    mark: collectives and bytes equal the compiled program's (4 rows: 3 permutes, 14 all-reduces, 28192 B)."""
    mesh = _mesh(2, False)
    args = (jax.ShapeDtypeStruct((8, rows, rows, 16), F32), jax.ShapeDtypeStruct((window, window, 16, 16), F32))
    specs = (P("a", "b"), P())  # batch over 'a', rows over 'b'
    run = jax.grad(lambda *a: jnp.sum(_conv_norm_residual(*a) ** 2), argnums=(0, 1))
    want_kinds, want_bytes, want_peak = _sent(run, mesh, args, specs)
    report = _explained(run, mesh, args, specs)
    assert not report.approximate and report.complete, [op.note for op in report.approximate_ops]
    assert want_kinds["collective-permute"] >= 1 and "all-gather" not in want_kinds, want_kinds
    assert _kinds_of(report) == want_kinds and report.comm_bytes == want_bytes, (_kinds_of(report), want_kinds)
    if not report.peak_note:  # a conv's window scratch has its own peak caveat (memory.peak_caveat)
        assert abs(report.peak_bytes - want_peak) <= 0.25 * want_peak, (report.peak_bytes, want_peak)


@pytest.mark.parametrize(
    "fn, shape, spec",
    [
        # A stride-1 conv whose window is shorter than its result: halos, exact, no mark.
        (
            lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")),
            (8, 8, 8, 16),
            P("a", "b"),
        ),
        # Marked without a known alternative (a concatenate along a split axis): the local bound, no fork.
        (lambda x, k: jnp.concatenate([x, 2 * x], axis=1), (8, 8, 8, 16), P(None, "a")),
    ],
)
def test_no_fork_where_no_rule_offers_an_alternative(
    fn: Any, shape: tuple[int, ...], spec: Any, monkeypatch: Any
) -> None:
    from einshard._src.analysis.program.trace import TracedProgram

    def no_fork(*_: Any) -> Any:
        raise AssertionError("a fork was walked for a program without an offered alternative")

    monkeypatch.setattr(TracedProgram, "_fork", no_fork)
    mesh = _mesh(2, False)
    args = (jax.ShapeDtypeStruct(shape, F32), jax.ShapeDtypeStruct((3, 3, 16, 16), F32))
    report = _explained(fn, mesh, args, (spec, P()))
    assert report.alternatives_unwalked == 0 and not any(op.alternative for op in report.ops)
    assert "not walked" not in str(report).splitlines()[0]


@pytest.mark.parametrize("grad", [False, True])
def test_a_conflict_mark_offers_its_alternative_and_its_bound_covers_the_fork(grad: bool) -> None:
    from einshard._src.analysis.program import alternatives, trace

    mesh = _mesh(1, False)
    args = (
        jax.ShapeDtypeStruct((T, D), F32),
        jax.ShapeDtypeStruct((D, E), F32),
        jax.ShapeDtypeStruct((E, D, D), F32),
    )
    specs = (P("a"), P(), P("a"))
    run = jax.grad(lambda *a: jnp.sum(_routed(*a) ** 2), argnums=(0, 1, 2)) if grad else _routed
    program = trace(run, *args, mesh=dict(zip(mesh.axis_names, mesh.axis_sizes)))
    report = program.report(specs)
    offered = list(dict.fromkeys(op.alternative for op in report.ops if op.alternative))
    assert offered and all(op.approximate for op in report.ops if op.alternative)
    for eqn_id in offered:
        fork = program._fork(frozenset({eqn_id}), specs, None)
        assert fork.ops != report.ops  # the other choice moves other values
        measured = alternatives.difference(report, fork)
        first = next(op for op in report.ops if op.alternative == eqn_id)
        assert first.bound is not None
        assert first.bound.collectives * first.repeat >= measured.collectives
        assert first.bound.bytes * first.repeat >= measured.bytes and first.bound.peak >= measured.peak
    # The fork leaves the program's costs as the main walk made them.
    again = program.report(specs)
    assert (again.comm_bytes, again.comm_count, again.peak_bytes) == (
        report.comm_bytes,
        report.comm_count,
        report.peak_bytes,
    )


def test_a_caller_that_ranks_layouts_walks_no_fork_and_the_report_says_its_bounds_are_local(monkeypatch: Any) -> None:
    from einshard._src.analysis.program import trace
    from einshard._src.analysis.program.trace import TracedProgram
    from einshard._src.planner.combining import combined_report

    def no_fork(*_: Any) -> Any:
        raise AssertionError("forks=0 walked a fork")

    mesh = _mesh(2, False)
    args = (jax.ShapeDtypeStruct((8, 4, 4, 16), F32), jax.ShapeDtypeStruct((3, 3, 16, 16), F32))
    program = trace(_conv_norm, *args, mesh=dict(zip(mesh.axis_names, mesh.axis_sizes)))
    walked = program.report((P("a", "b"), P()))
    monkeypatch.setattr(TracedProgram, "_fork", no_fork)
    for local in (program.report((P("a", "b"), P()), forks=0), combined_report(program, (P("a", "b"), P()))[0]):
        assert local.alternatives_unwalked == 1 and "not walked to the program's end" in str(local).splitlines()[0]
        assert (local.comm_bytes, local.comm_count, local.peak_bytes) == (
            walked.comm_bytes,
            walked.comm_count,
            walked.peak_bytes,
        )


# The property: for any strided conv whose window covers its result on split rows (hypothesis draws the mesh, the
# window, the stride, the rows, a batch split and the gradient), followed by a batch norm, XLA's collectives, bytes
# and peak lie within the bound the report states once its fork is walked (a swept grid of 104 such programs held).
def _strided_conv_norm(window: int, stride: int) -> Callable[..., Any]:
    def f(x: Any, k: Any) -> Any:
        pad = window // 2
        x = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        y = lax.conv_general_dilated(x, k, (stride, stride), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        mean = y.mean((0, 1, 2))
        return jax.nn.relu((y - mean) / jnp.sqrt(((y - mean) ** 2).mean((0, 1, 2)) + 1e-5))

    return f


@st.composite
def _covering_convs(draw: Any) -> tuple[int, int, int, int, bool, bool]:
    rank = draw(st.sampled_from([1, 2, 3]))
    window, stride = draw(st.sampled_from([3, 5, 7])), draw(st.sampled_from([2, 3]))
    rows = draw(st.sampled_from([2, 4, 6, 8, 12]))
    return rank, window, stride, rows, draw(st.booleans()), rank > 1 and draw(st.booleans())


def _check_covering_conv(draw: tuple[int, int, int, int, bool, bool]) -> None:
    rank, window, stride, rows, grad, batch_split = draw
    mesh = _mesh(rank, False)
    names = mesh.axis_names
    if rows % dict(zip(names, mesh.axis_sizes))[names[-1]]:
        reject()  # the rows do not split over the mesh axis
    specs = (P(names[0] if batch_split else None, names[-1]), P())
    f = _strided_conv_norm(window, stride)
    args = (jax.ShapeDtypeStruct((8, rows, rows, 8), F32), jax.ShapeDtypeStruct((window, window, 8, 8), F32))
    run = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1)) if grad else f
    report = _explained(run, mesh, args, specs)
    if not any(op.alternative for op in report.ops):
        reject()  # the window does not cover the result, or the blocks are uneven: no alternative offered
    want_kinds, want_bytes, want_peak = _sent(run, mesh, args, specs)
    bound = report.approximate_bound
    assert bound.collectives is not None and bound.bytes is not None
    assert _edit_distance(_kinds_of(report), want_kinds) <= bound.collectives, (draw, _kinds_of(report), want_kinds)
    assert abs(report.comm_bytes - want_bytes) <= max(bound.bytes, 0.1 * want_bytes), (draw, report.comm_bytes)
    if not report.peak_note:
        assert abs(report.peak_bytes - want_peak) <= max(bound.peak, 0.25 * want_peak), (draw, report.peak_bytes)


@FAST
@given(_covering_convs())
def test_a_covering_conv_and_its_batch_norm_stay_within_the_forked_bound(draw: Any) -> None:
    _check_covering_conv(draw)


@pytest.mark.slow
@DEEP
@given(_covering_convs())
def test_a_covering_conv_and_its_batch_norm_stay_within_the_forked_bound_deep(draw: Any) -> None:
    _check_covering_conv(draw)
