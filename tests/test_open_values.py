"""Open values take the split their elementwise readers' partners hand them (einshard/_src/analysis/program/open_values.py).

XLA's sharding propagation runs to a fixed point, both ways: a value no layout fixes (not an argument, not a
placement) takes a split that a later elementwise reader's other operand has, and its other readers then read it
split.  Each program here is compiled by XLA on the (data=4, model=2) mesh, Auto and Explicit axes, its loss and
its gradient, and explain's collectives (kinds and counts), bytes (10%) and peak (25%) are compared with XLA's, as
the external corpus compares them (tests/external_corpus/compare.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, Case, _case, check

import einshard
from einshard._src.analysis.program import trace
from einshard._src.testing import bounds
from einshard.testing import hlo

BYTES_TOLERANCE, PEAK_TOLERANCE = 0.10, 0.25


def _norm(x: jax.Array) -> jax.Array:
    m = x.mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(((x - m) ** 2).mean(-1, keepdims=True) + 1e-6)


def _tanh_residual(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    x = t * 2.0  # open: made by the program
    return jnp.mean(jnp.square(x + jnp.tanh(x @ w)))


def _normed_residual(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    x = t * 2.0
    return jnp.mean(jnp.square(x + _norm(x) @ w))


def _two_blocks(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    x = t * 2.0
    h = x + x @ w
    return jnp.mean(jnp.square(h + h @ w2))


def _lookup_residual(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    """An embedding lookup read by a pre-norm block's residual add (keras-hub's decoders under a column split)."""
    x = t[0][ids]  # [8, 8, 32] from the [8, 32] table
    return jnp.mean(jnp.square(x + _norm(x) @ w))


def _normed_lookup_residual(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    """The lookup normed before the first block (BLOOM's and DeBERTa's embedding layer norm): the split the residual
    hands the norm's output reaches, back through the norm's elementwise ops, the lookup's output and its sums."""
    x = _norm(t[0][ids])
    return jnp.mean(jnp.square(x + _norm(x) @ w))


def _sum_then_partner(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    """The open value's first reader is a sum over d; its later reader's partner is split on d."""
    x = jnp.exp(t)
    return jnp.mean(jnp.square(x.sum(-1, keepdims=True) * (x + w2[:8, None, :])))


def _argument_residual(t: jax.Array, ids: jax.Array, w: jax.Array, w2: jax.Array) -> jax.Array:
    """The same residual on the argument itself: its layout is fixed, XLA keeps it whole."""
    return jnp.mean(jnp.square(t + jnp.tanh(t @ w)))


PROGRAMS: dict[str, Callable[..., jax.Array]] = {
    "tanh_residual": _tanh_residual,
    "normed_residual": _normed_residual,
    "two_blocks": _two_blocks,
    "lookup_residual": _lookup_residual,
    "normed_lookup_residual": _normed_lookup_residual,
    "sum_then_partner": _sum_then_partner,
    "argument_residual": _argument_residual,
}
SPECS = ("a b c -> a b c", "a b -> a b", "a b -> a b@model", "a b -> a b@model")


def _args() -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.normal(size=(8, 8, 32)), jnp.float32),
        jnp.asarray(rng.integers(0, 8, size=(8, 8)), jnp.int32),
        jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32),
        jnp.asarray(rng.normal(size=(32, 32)) / 6, jnp.float32),
    )


def report_and_compiled(
    fn: Callable[..., jax.Array], mesh: jax.sharding.Mesh, grad: bool, specs: tuple[str, ...] = SPECS
) -> tuple[Any, Any]:
    """explain's report of ``fn`` (or its gradient in w and w2) on ``_args()`` laid out by ``specs``, and XLA's
    compiled program of the same (the loss returned whole, the gradients as their parameters)."""
    fn = jax.grad(fn, argnums=(2, 3)) if grad else fn
    args = _args()
    shardings = tuple(einshard.sharding(e, a.shape, mesh=mesh) for e, a in zip(specs, args))
    out = (shardings[2], shardings[3]) if grad else NamedSharding(mesh, P())
    placed = jax.device_put(args, shardings)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=shardings, out_shardings=out).lower(*placed).compile()
        asked = [s.spec for s in out] if grad else [P()]  # type: ignore[union-attr]
        report = trace(fn, *placed, mesh=mesh).report(specs, asked)
    return report, compiled


def _compare(
    name: str, axis: AxisType | tuple[AxisType, AxisType], grad: bool, specs: tuple[str, ...] = SPECS
) -> tuple[dict, dict, float, float, int, int]:
    types = axis if isinstance(axis, tuple) else (axis, axis)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    report, compiled = report_and_compiled(PROGRAMS[name], mesh, grad, specs)
    xla = hlo.normalized(compiled.as_text() or "")
    explained = Counter(
        c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1
    )
    mem = compiled.memory_analysis()
    assert mem is not None
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    return (
        dict(explained),
        dict(Counter(c.kind for c in xla for _ in range(c.runs))),
        float(sum(c.bytes * op.repeat for op in report.ops for c in op.collectives)),
        float(sum(c.sent_bytes * c.runs for c in xla)),
        int(report.peak_bytes),
        int(peak),
    )


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("axis", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_an_open_value_takes_its_readers_split_as_xla(name: str, axis: AxisType, grad: bool) -> None:
    """Collectives (kinds and counts) and bytes sent: XLA's.  On Explicit axes every value's type is its layout and
    XLA keeps it: nothing is open (a residual on x typed whole is sliced at the add, x's other readers whole)."""
    kinds, xla_kinds, sent, xla_sent, _, _ = _compare(name, axis, grad)
    assert kinds == xla_kinds
    assert abs(sent - xla_sent) <= BYTES_TOLERANCE * max(xla_sent, 1.0), (sent, xla_sent)


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("name", ["tanh_residual", "lookup_residual", "normed_lookup_residual"])
@pytest.mark.parametrize("kernels", ["a b -> a b@model", "a b -> a b@data"], ids=["on_model", "on_data"])
@pytest.mark.parametrize(
    "types",
    [(AxisType.Explicit, AxisType.Auto), (AxisType.Auto, AxisType.Explicit)],
    ids=["data_explicit", "model_explicit"],
)
def test_on_a_mixed_mesh_only_an_auto_axis_is_open(
    types: tuple[AxisType, AxisType], kernels: str, name: str, grad: bool
) -> None:
    """A mesh with one Explicit and one Auto axis: a value's type fixes its split over the Explicit axis, so a
    reader hands it a split over the Auto one only (12 of these 24 were not XLA's collectives when the Explicit
    axis was taken too)."""
    kinds, xla_kinds, sent, xla_sent, _, _ = _compare(name, types, grad, (*SPECS[:2], kernels, kernels))
    assert kinds == xla_kinds
    assert abs(sent - xla_sent) <= BYTES_TOLERANCE * max(xla_sent, 1.0), (sent, xla_sent)


# Peaks outside the corpus' 25% on these small programs, explain / XLA (the same before open values were followed,
# where the collectives were not XLA's: tanh_residual loss 1.35x, its gradient 0.83x; not modelled yet).  The
# gradients' misses (0.66x-0.74x: the activation gathered for the weight-gradient dot, held by XLA:CPU from the
# forward) are within it since memory._dot_gather_holds: lookup_residual and normed_lookup_residual 1.05x,
# normed_residual and tanh_residual 1.07x, two_blocks 0.95x (Auto) and 0.87x (Explicit).
_PEAK_MISSES = {
    ("lookup_residual", "auto", "loss"): "1.27x: the lookup's whole [8, 8, 32] result held beside its slice",
    ("normed_residual", "auto", "loss"): "1.35x",
    ("tanh_residual", "auto", "loss"): "1.35x",
}


def _peak_cases() -> list:
    cases = []
    for name in sorted(PROGRAMS):
        for axis, a in ((AxisType.Auto, "auto"), (AxisType.Explicit, "explicit")):
            for grad, g in ((False, "loss"), (True, "grad")):
                why = _PEAK_MISSES.get((name, a, g))
                marks = [pytest.mark.xfail(strict=True, reason=f"peak {why}")] if why else []
                cases.append(pytest.param(name, axis, grad, id=f"{name}-{a}-{g}", marks=marks))
    return cases


@pytest.mark.parametrize("name, axis, grad", _peak_cases())
def test_an_open_values_peak_is_xlas(name: str, axis: AxisType, grad: bool) -> None:
    *_, peak, xla_peak = _compare(name, axis, grad)
    assert abs(peak - xla_peak) <= PEAK_TOLERANCE * xla_peak, (peak, xla_peak)


# -- the property: drawn programs, drawn layouts over 1-, 2- and 3-axis meshes, Auto and Explicit -----------------

_MAKERS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "scale": lambda t: t * 2.0,
    "exp": jnp.exp,
    "tanh": jnp.tanh,
}


def _reader(kind: str, x: jax.Array, w: jax.Array) -> jax.Array:
    if kind == "residual":
        return x + jnp.tanh(x @ w)
    if kind == "normed":
        return x + _norm(x) @ w
    return jnp.sum(x, -1, keepdims=True) * (x + x @ w)  # a reduction of x read before its partner


@st.composite
def open_value_case(draw: st.DrawFn) -> Case:
    """An open value made from the argument t by an elementwise op and read with a projection of itself: its
    result, or the gradient; t and the square kernel w laid out at random (the primitive tests' draw)."""
    rows, width = draw(st.sampled_from([8, 16])), draw(st.sampled_from([16, 32]))
    make, read = draw(st.sampled_from(sorted(_MAKERS))), draw(st.sampled_from(["residual", "normed", "sum_then"]))

    def fn(t: jax.Array, w: jax.Array) -> jax.Array:
        return _reader(read, _MAKERS[make](t), w)

    rng = np.random.default_rng(draw(st.integers(0, 3)))
    args = (
        jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
        jnp.asarray(rng.normal(size=(width, width)) / width, jnp.float32),
    )
    return _case(draw, f"open value ({make}, {read})", fn, args)


def test_drawn_open_values_match_xla() -> None:
    FAST(given(open_value_case())(check))()


@pytest.mark.slow
@pytest.mark.xfail(
    strict=False,
    reason="the deep run's first failing draws (the one it ran into before is XLA's now: a dot reader hands its open "
    "operand the split its partner has): exp(t) + tanh(exp(t) @ w) on (a, b, c), t rows@c cols@b, w rows@c cols@a, "
    "the result left open: XLA returns it [8@c, 16@b], explain [8@c, 16] (x's columns lose b to the dot's "
    "conflict); and its gradient with t and w rows over 'a' on (8,): collectives XLA's, peak 1.37x",
)
def test_drawn_open_values_match_xla_deep() -> None:
    DEEP(given(open_value_case())(check))()


def test_a_fixed_point_not_reached_in_the_walks_allowed_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """With one walk allowed, the residual's x still takes its reader's split after it: the report's first line
    says the costs are not XLA's program there, and a report given its walks says nothing."""
    import sys

    program = sys.modules["einshard._src.analysis.program.trace"]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    args = _args()
    settled = trace(_tanh_residual, *args, mesh=mesh).report(SPECS)
    assert settled.unsettled == 0 and "UNSETTLED" not in settled.headline()
    monkeypatch.setattr(program, "MAX_WALKS", 1)
    cut = trace(_tanh_residual, *args, mesh=mesh).report(SPECS)
    assert cut.unsettled == 1 and cut.headline().startswith("UNSETTLED: 1 value no layout fixes")
    assert cut.to_dict()["unsettled"] == 1
    assert cut.comm_count < settled.comm_count  # the one walk's: x whole, its dot's permute and sum not made


# -- a dot reader hands its open operand its partner's split ----------------------------------------------------------

_DOT_READERS: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    # the open value x read by a dot against w and by the residual add
    "exp_tanh": lambda t, w: (lambda x: x + jnp.tanh(x @ w))(jnp.exp(t)),
    "scale_tanh": lambda t, w: (lambda x: x + jnp.tanh(x @ w))(t * 2.0),
    "exp_dot": lambda t, w: (lambda x: x + x @ w)(jnp.exp(t)),
    # controls: the argument itself (fixed), and exp written twice (no value read by both)
    "argument": lambda t, w: t + jnp.tanh(t @ w),
    "exp_twice": lambda t, w: jnp.exp(t) + jnp.tanh(jnp.exp(t) @ w),
}


_ROWS_OVER_A = ((8,), ("a",), (P(), P("a", None)))
_GROWS_B_TO_BC = ((2, 2, 2), ("a", "b", "c"), (P(None, "b"), P(("b", "c"), None)))


@pytest.mark.parametrize(
    ("name", "mesh_shape", "names", "specs"),
    [pytest.param(name, *_ROWS_OVER_A, id=f"{name}-rows-over-a") for name in sorted(_DOT_READERS)]
    + [
        pytest.param(name, *_GROWS_B_TO_BC, id=f"{name}-grows-b-to-bc")
        for name in ("exp_tanh", "scale_tanh", "exp_dot")
    ],
)
def test_a_dot_reader_hands_its_open_operand_its_partners_split(
    name: str, mesh_shape: tuple, names: tuple, specs
) -> None:
    """Shardy shares a dot's contracted (and batch) factors between its operands: an open ``x`` read against
    ``w[d@a, f]`` takes its d split over 'a' (a free slice), its residual add then reads it so, and the dot's
    partial sum is reduce-scattered onto the add's split (the result left open).  A split x has there already grows
    to the partner's where it is its prefix.  Collectives, bytes and the result's split: XLA's."""
    fn = _DOT_READERS[name]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(AxisType.Auto,) * len(names))
    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(rng.normal(size=(8, 16)), jnp.float32),
        jnp.asarray(rng.normal(size=(16, 16)) / 16, jnp.float32),
    )
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
    report = trace(fn, *args, mesh=dict(zip(names, mesh_shape))).report(specs)
    xla = [c for c in hlo.normalized(compiled.as_text() or "") if c.group_size > 1]
    got = [(op, c) for op in report.ops for c in op.collectives if c.group_size > 1]
    assert Counter(c.kind for op, c in got for _ in range(op.repeat)) == Counter(
        c.kind for c in xla for _ in range(c.runs)
    )
    assert sum(c.bytes * op.repeat for op, c in got) == pytest.approx(sum(c.sent_bytes * c.runs for c in xla), rel=0.1)
    spec = compiled.output_shardings.spec
    want = tuple(
        () if e is None else (e,) if isinstance(e, str) else tuple(e) for e in list(spec) + [None] * (2 - len(spec))
    )
    assert report.output_dims == (want,)


# -- a partner other dots read too --------------------------------------------------------------------------------


def _scattered(t: jax.Array) -> jax.Array:
    """A cotangent-like value made by a scatter (top_k's backward routes its values' cotangents so)."""
    rows = jnp.arange(t.shape[0])
    return jnp.zeros(t.shape, t.dtype).at[rows, jnp.argmax(t, axis=1)].add(t[:, 0])


_SHARED_PARTNERS: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
    # a router: w[d, e] read by the logits' dot (contracting d) and against an open (tokens, e) value (contracting
    # e), as the logits' cotangent reads it in the backward
    "router_tanh": lambda x, w, t: jnp.sum((x @ w) ** 2) + jnp.sum(jnp.einsum("re,de->rd", jnp.tanh(t), w) ** 2),
    "router_scatter": lambda x, w, t: jnp.sum((x @ w) ** 2) + jnp.sum(jnp.einsum("re,de->rd", _scattered(t), w) ** 2),
}


def _shared_partner_gaps(name: str, w_spec: P, x_spec: P, axis: AxisType, grad: bool) -> tuple[Any, Any]:
    """(explain's collectives and bytes against XLA's, as gaps in the bound's terms, the report) for one of
    :data:`_SHARED_PARTNERS` on the (data=4, model=2) mesh: x[64, 128] and w[128, 16] laid out as given, t[64, 16]
    whole.  Peak memory is not compared here: these programs' peaks miss XLA's by more than 25% in places on the
    code before this rule as after (an activation gradient's temporaries, docs/analysis.md), a gap of the memory walk
    that is not this rule's."""
    fn = _SHARED_PARTNERS[name]
    if grad:
        fn = jax.grad(fn, argnums=(0, 1))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis,) * 2)
    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(rng.normal(size=(64, 128)), jnp.float32),
        jnp.asarray(rng.normal(size=(128, 16)) / 16, jnp.float32),
        jnp.asarray(rng.normal(size=(64, 16)), jnp.float32),
    )
    shardings = (NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec), NamedSharding(mesh, P()))
    placed = jax.device_put(args, shardings)
    with jax.set_mesh(mesh):
        out = (shardings[0], shardings[1]) if grad else NamedSharding(mesh, P())
        compiled = jax.jit(fn, out_shardings=out).lower(*placed).compile()
        asked = [s.spec for s in out] if grad else [P()]  # type: ignore[union-attr]
        report = trace(fn, *placed, mesh=mesh).report(tuple(s.spec for s in shardings), asked)
    xla = [c for c in hlo.normalized(compiled.as_text() or "") if c.group_size > 1]
    got = [(op, c) for op in report.ops for c in op.collectives if c.group_size > 1]
    measured = bounds.gaps(
        bounds.Measured(
            Counter(c.kind for op, c in got for _ in range(op.repeat)), sum(c.bytes * op.repeat for op, c in got), 0.0
        ),
        bounds.Measured(
            Counter(c.kind for c in xla for _ in range(c.runs)), sum(c.sent_bytes * c.runs for c in xla), 0.0
        ),
    )
    return measured, report


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("axis", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("x_spec", [P(), P("data", None)], ids=["x_whole", "x_rows"])
@pytest.mark.parametrize("name", sorted(_SHARED_PARTNERS))
def test_a_router_kernel_hands_the_logits_cotangent_its_experts_split(
    name: str, x_spec: P, axis: AxisType, grad: bool
) -> None:
    """A dot reading an open value hands it its partner's split on their shared axes even where another dot reads
    the partner too, when that dot does not gather it: keras-hub GPT-OSS's router kernel w[d, e@model], read by the
    logits' dot x . w (e free there: nothing gathered) and against the logits' cotangent (e contracted).  XLA splits
    the cotangent on e and all-reduces the (tokens, d) product, where explain had gathered w (the one-dot rule of
    open_values took every partner another dot reads as gathered).  Collectives and bytes: XLA's exactly, with no
    approximate mark to lean on; but for the gradient on Auto axes, where the input gradient g . w^T pairs w's split
    with g too and the rule keeps w whole (the DeBERTa exception, open_values.py): there XLA's all-reduce of the
    (tokens, d) product lies within the bound the report's first line states for its gather of w (said so, not
    silent; asking g's layout instead settles this and leaves DeBERTa's gradients unsettled in three walks)."""
    gaps, report = _shared_partner_gaps(name, P(None, "model"), x_spec, axis, grad)
    if grad and axis == AxisType.Auto:
        assert gaps.none or (report.approximate and bounds.within_bound(gaps, report.approximate_bound)), (
            gaps,
            report.approximate_bound,
            str(report),
        )
        return
    assert gaps.none, (gaps, report.approximate_bound, str(report))


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("axis", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("x_spec", [P(), P("data", None)], ids=["x_whole", "x_rows"])
@pytest.mark.parametrize("w_spec", [P("model", None), P("data", None)], ids=str)
@pytest.mark.parametrize("name", sorted(_SHARED_PARTNERS))
def test_the_router_kernels_other_layouts_are_xlas_or_said_so(
    name: str, w_spec: P, x_spec: P, axis: AxisType, grad: bool
) -> None:
    """The router kernel's rows split instead (over 'model', or 'data' as FSDP lays it out: the logits' dot
    contracts the split, and gathers w where x's rows are split over 'data'), x's rows split or not, Auto and
    Explicit, loss and gradient: explain's collectives and bytes are XLA's, or its report's first line says by how
    much they may differ and XLA's lie within that (the corpus's rule, einshard._src.testing.bounds)."""
    gaps, report = _shared_partner_gaps(name, w_spec, x_spec, axis, grad)
    assert gaps.none or (report.approximate and bounds.within_bound(gaps, report.approximate_bound)), (
        gaps,
        str(report),
    )


@st.composite
def shared_partner_case(draw: st.DrawFn) -> Case:
    """The router of :data:`_SHARED_PARTNERS` (the open value made by tanh), at drawn sizes, with
    every argument laid out at random over 1-, 2- and 3-axis meshes, Auto and Explicit, loss or gradient (the
    primitive tests' draw).  Peak is held to the range of the known activation-gradient gap (the 'unfused' bound,
    0.5-1.75x: the router's gradient with x whole reads 0.61x, 0.66x on the code before this rule)."""
    rows, width, experts = (
        draw(st.sampled_from([16, 32])),
        draw(st.sampled_from([32, 64])),
        draw(st.sampled_from([8, 16])),
    )
    # (the scatter-made value is not drawn here: with t's rows split, a scatter of its arg-max rows misses XLA's
    # collectives on the code before this rule as after, a gap of the scatter's rule, not this one's)
    name = "router_tanh"
    rng = np.random.default_rng(draw(st.integers(0, 3)))
    args = (
        jnp.asarray(rng.normal(size=(rows, width)), jnp.float32),
        jnp.asarray(rng.normal(size=(width, experts)) / experts, jnp.float32),
        jnp.asarray(rng.normal(size=(rows, experts)), jnp.float32),
    )
    return _case(draw, f"shared partner ({name})", _SHARED_PARTNERS[name], args, "unfused")


def test_drawn_shared_partners_match_xla() -> None:
    FAST(given(shared_partner_case())(check))()


# -- found_splits asks every reader as reader_split does --------------------------------------------------------------


def test_found_splits_answers_as_each_reader_asked_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """found_splits answers an elementwise reader that hands nothing without calling reader_split (the most of a deep
    model's thousands of readers after every walk): after each walk of the programs above, under two layouts each
    and as gradients, the splits it finds are those every reader asked in turn finds."""
    import sys

    from einshard._src.analysis.program.open_values import found_splits, open_values, reader_split, spread_back

    program = sys.modules["einshard._src.analysis.program.trace"]
    walk = program.TracedProgram._walk
    asked: list[int] = []

    def every_reader(opened: Any, env: Any, natural: Any) -> Any:
        out: dict[int, Any] = {}
        for eqn, k, x in opened.readers:
            own = natural.get(id(x)) or env.get(x)
            dims = reader_split(
                eqn, k, x, env, own, opened.fixed.get(id(x), frozenset()), opened.shared.get(id(eqn), ())
            )
            if dims is not None:
                out[id(x)] = dims if out.get(id(x), dims) == dims else None
        return spread_back(opened, {i: d for i, d in out.items() if d is not None}, env, natural)

    def checked(self: Any, walker: Any, *rest: Any) -> Any:
        layouts, outs = walk(self, walker, *rest)  # (a walk stopped at a reader raises: nothing to ask)
        opened = open_values(self.costs, self.jaxpr)
        want = every_reader(opened, layouts, walker.open_natural)
        assert found_splits(opened, layouts, walker.open_natural) == want
        asked.append(len(want))
        return layouts, outs

    monkeypatch.setattr(program.TracedProgram, "_walk", checked)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    args = _args()
    for fn in PROGRAMS.values():
        for specs in (SPECS, ("a b c -> a@data b c", "a b -> a b", "a b -> a@model b", "a b -> a b")):
            for program_fn in (fn, jax.grad(fn, argnums=2)):
                trace(program_fn, *args, mesh=mesh).report(specs)
    assert len(asked) >= 28 and any(asked)  # every report's last walk at least; some readers hand a split
