"""Recurrent loops whose carry meets split weights (issue 20: the Equinox GRU of the external corpus).

A hidden state ``h[batch, hidden]`` carried by ``lax.scan`` (or a counted ``lax.while_loop``) through a GRU
cell: a fused ``[3·hidden]`` projection of the input and of the state, ``jnp.split`` into the three gates,
sigmoid / tanh, both weights split on their stacked gates over one mesh axis (tensor parallel) or whole, the
inputs whole or split on the batch over any mesh axis (the weights' own: FSDP-style); 1-, 2- and 3-axis meshes,
Auto and Explicit, the loss and its ``jax.grad``.  Each program is compiled and explain's report held to XLA's
HLO and ``memory_analysis()`` by tests/test_primitive_rules.py's :func:`check`: collectives (kinds, counts per
trip), bytes and peak within the report's stated bound (zero where nothing is approximate).

The causes these found, each with its direct test below:

* the state's contracted split meets the recurrent weight's row split on one mesh axis: XLA moves the state
  onto the mesh axes neither operand uses before gathering it (a collective-permute, then an all-gather or an
  all-reduce over the idle axes) where those have at least as many devices
  (einshard/_src/analysis/program/idle_axes.py);
* the fused gates split into pieces smaller than their block: XLA exchanges halos, up to a whole block per
  permute, where explain sends the pieces (rules_ordering.split's bound);
* the carry has two fixed points where the inputs split the batch (the gates' split, the batch's): XLA picks by
  the loop result's users; the report marks it and walks the other (rules_control.batch_split_carry).

Not drawn, because explain does not hold them yet (found by these draws, left to the rules they belong to): the
weights split on their inputs (a contraction only the weight splits: XLA reduce-scatters the gates and permutes
their pieces, beyond the dot's lone-contraction bound), and the input weight whole with the recurrent one split
on its gates and the batch over another mesh axis (XLA slices the whole weight to the other's split and carries
the state split on both axes; explain's carry differs, beyond the split's bound).

A small derandomized budget runs by default; the deep run is ``@pytest.mark.slow``.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, MEMORY_BOUNDS, MESHES, Case, _explain, _loss, _mesh, _xla, check

from einshard._src.analysis.program.rules_control import CARRY_NOTE
from einshard._src.testing.bounds import Measured, gaps, within_bound

# Peak memory of a recurrent gradient: XLA holds more than the memory walk (einshard/_src/analysis/program/memory.py,
# not these rules) counts where the batch is split and the weights are whole -- the external corpus's eqx_gru dp-grad
# peak miss (known_misses.json), another engineer's: measured down to 0.61x XLA's peak on the deep draws (5504 B
# against 9044 B), 0.66x on a GRU of 16 over 2 steps (18304 B against 27568 B); the other draws lie within
# 0.76-1.13x.  A known gap of the memory walk, bounded here so that it cannot grow; collectives and bytes are held
# to XLA exactly (or within the report's stated bound).
MEMORY_BOUNDS.setdefault("recurrent", (0.6, 1.25))

# -- the recurrent programs --------------------------------------------------------------------------------------


def _projected(x: Any, w: Any) -> Any:
    """``x @ w.T`` as Equinox's vmapped ``Linear`` traces it: one dot contracting both operands' last axes."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def gru_cell(wi: Any, wh: Any, b: Any, x: Any, h: Any, project: Any = _projected) -> Any:
    """Equinox's GRUCell, batched: the gates stacked on the weights' first axis (r, z, n)."""
    gi = project(x, wi) + b
    gh = project(h, wh)
    ir, iz, i_n = jnp.split(gi, 3, axis=-1)
    hr, hz, h_n = jnp.split(gh, 3, axis=-1)
    r = jax.nn.sigmoid(ir + hr)
    z = jax.nn.sigmoid(iz + hz)
    n = jnp.tanh(i_n + r * h_n)
    return (1 - z) * n + z * h


def scanned(wi: Any, wh: Any, b: Any, xs: Any) -> Any:
    """The cell over time by ``lax.scan``, from a zero state; the loss of the last state."""
    h0 = jnp.zeros((xs.shape[1], wh.shape[1]), xs.dtype)
    h = lax.scan(lambda h, x: (gru_cell(wi, wh, b, x, h), None), h0, xs)[0]
    return jnp.sum(h**2)


def looped(wi: Any, wh: Any, b: Any, xs: Any) -> Any:
    """The cell over time by a counted ``lax.while_loop`` (its trip count XLA's loop analysis finds)."""
    h0 = jnp.zeros((xs.shape[1], wh.shape[1]), xs.dtype)

    def body(carry: Any) -> Any:
        i, h = carry
        return i + 1, gru_cell(wi, wh, b, lax.dynamic_index_in_dim(xs, i, keepdims=False), h)

    h = lax.while_loop(lambda c: c[0] < xs.shape[0], body, (0, h0))[1]
    return jnp.sum(h**2)


def in_auto_axes(fn: Any) -> Any:
    """``fn`` run in ``jax.sharding.auto_axes`` (its scalar loss whole), as JAX documents for Explicit meshes: its
    carry's type is the body's output's, which JAX refuses for a zero state typed whole (the corpus does the same)."""

    def wrapped(*args: Any) -> Any:
        return jax.sharding.auto_axes(fn, out_sharding=P())(*args)

    wrapped.__name__ = f"{fn.__name__}_in_auto_axes"
    return wrapped


def _struct(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


@st.composite
def recurrent_case(draw: Any) -> Case:
    """A GRU over time: sizes, the loop, which weights split how, the inputs' split, mesh, Auto/Explicit, grad."""
    hidden = draw(st.sampled_from([16, 32, 64]))
    features = draw(st.sampled_from([16, 32]))
    batch = draw(st.sampled_from([8, 16]))
    steps = draw(st.integers(2, 4))
    rank = draw(st.sampled_from([1, 2, 3]))
    names = MESHES[rank][1]
    # Both weights split on their stacked gates over one mesh axis, as a user splits a cell (tensor parallel; or
    # neither: the state's layout is then the inputs'); the inputs whole or split on the batch, over another mesh
    # axis or the weights' own (FSDP: the carry's two fixed points, rules_control.batch_split_carry).
    weights = draw(st.sampled_from([None, *names]))
    w_spec = P(weights, None) if weights else P()
    batch_axis = draw(st.sampled_from([None, *names]))
    xs_spec = P(None, batch_axis, None) if batch_axis else P()
    specs = (w_spec, w_spec, P(), xs_spec)
    grad = draw(st.booleans())
    args = (
        _struct(3 * hidden, features),
        _struct(3 * hidden, hidden),
        _struct(3 * hidden),
        _struct(steps, batch, features),
    )
    explicit = draw(st.booleans())
    return Case("scan", in_auto_axes(scanned) if explicit else scanned, args, specs, rank, explicit, grad, "recurrent")


def test_recurrent_loops_match_xla() -> None:
    FAST(given(recurrent_case())(check))()


@pytest.mark.slow
def test_recurrent_loops_match_xla_deep() -> None:
    DEEP(given(recurrent_case())(check))()


# -- the corpus's shapes (tests/external_corpus/equinox_models.py: B, S, D, F = 8, 8, 32, 64) ---------------------

CORPUS_ARGS = (_struct(192, 32), _struct(192, 64), _struct(192), _struct(8, 8, 32))
# test_primitive_rules' (4, 2) mesh is ('a', 'b'): the corpus's ('data', 'model').
TP = (P("b", None), P("b", None), P(), P())  # the cell's gates split over 'model'
FSDP = (P("a", None), P("a", None), P(), P(None, "a", None))


def _corpus_case(specs: tuple[P, ...], explicit: bool, grad: bool) -> Case:
    return Case(
        "scan", in_auto_axes(scanned) if explicit else scanned, CORPUS_ARGS, specs, 2, explicit, grad, "recurrent"
    )


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_gru_tensor_parallel_forward_names_xlas_collectives(explicit: bool) -> None:
    """The corpus's tp case, forward: per step a permute and an all-gather (the state onto the idle 'data'
    axis, then whole) and the gates' four permutes; once after the loop, the loss's partial sums all-reduced."""
    case = _corpus_case(TP, explicit, False)
    check(case)
    mesh = _mesh(2, explicit)
    report, got, _, _ = _explain(case, mesh, case.fn)
    want, _, _, _ = _xla(case, mesh, case.fn)
    # The inputs whole: the carry has one fixed point, nothing to say about it.
    assert not any(CARRY_NOTE in op.note for op in report.ops)
    assert got == want == Counter({"collective-permute": 5 * 8, "all-gather": 8, "all-reduce": 1}), (got, want)


@pytest.mark.parametrize("grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_gru_fsdp_says_which_fixed_point_is_xlas_choice(explicit: bool, grad: bool) -> None:
    """The corpus's fsdp case: the weights' gates and the batch over one mesh axis.  The carry has two fixed
    points (the gates' split, the batch's); the report says so on the loop's first op and its bound, measured by
    walking the other one to the program's end, covers what XLA compiles."""
    case = _corpus_case(FSDP, explicit, grad)
    check(case)
    report, _, _, _ = _explain(case, _mesh(2, explicit), case.fn)
    assert any(CARRY_NOTE in op.note for op in report.ops), report.approximate_at


# -- the idle-axes dot, direct -----------------------------------------------------------------------------------


def _dot(a: Any, b: Any) -> Any:
    return a @ b


# (mesh rank, lhs spec, rhs spec, XLA's collectives): (16, 32) @ (32, 64), measured from the compiled HLO.
IDLE_AXES = [
    # the contracted split's mesh axis ('b', 2 devices) is the partner's free split; 'a' (4) idle: permute + gather
    (2, P(None, "b"), P(None, "b"), {"collective-permute": 1, "all-gather": 1}),
    # the partner's contracted split over 'b', the lhs's rows over 'b': permute + the product all-reduced over 'a'
    (2, P("b", None), P("b", None), {"collective-permute": 1, "all-reduce": 1}),
    # FSDP's gather: the split axis 'a' (4) has more devices than the idle 'b' (2): XLA gathers it, nothing else
    (2, P("a", None), P("a", None), {"all-gather": 1}),
    # three axes: 'c' idle, as many devices as 'a': permute + all-reduce over 'c'
    (3, P("a", None), P("a", "b"), {"collective-permute": 1, "all-reduce": 1}),
    (3, P(None, "a"), P(None, "a"), {"collective-permute": 1, "all-gather": 1}),
    # the operand split elsewhere too (its rows over 'a' or 'c'): the permute and gather over what stays idle
    (3, P("a", "b"), P(None, "b"), {"collective-permute": 1, "all-gather": 1}),
    (3, P("c", "b"), P(None, "b"), {"collective-permute": 1, "all-gather": 1}),
    # its rows over 'a' on (4, 2): nothing idle, the plain gather over 'b'
    (2, P("a", "b"), P(None, "b"), {"all-gather": 1}),
    # split over two mesh axes at once, 'c' idle but fewer devices: the plain gather
    (3, P(None, ("a", "b")), P(None, ("a", "b")), {"all-gather": 1}),
    # one axis: nothing idle, the plain gather
    (1, P(None, "a"), P(None, "a"), {"all-gather": 1}),
]


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("rank, lhs, rhs, kinds", IDLE_AXES, ids=[f"{r}-{a}-{b}" for r, a, b, _ in IDLE_AXES])
def test_dot_moves_a_gathered_operand_onto_idle_axes(rank: int, lhs: P, rhs: P, kinds: dict, explicit: bool) -> None:
    case = Case("dot_general", _dot, (_struct(16, 32), _struct(32, 64)), (lhs, rhs), rank, explicit, False)
    check(case)  # kinds, counts, bytes and peak against the HLO, nothing approximate
    mesh = _mesh(rank, explicit)
    report, got, _, _ = _explain(case, mesh, _dot)
    assert got == Counter(kinds), (got, kinds)
    assert not report.approximate_at


# -- the same cell in a counted while_loop --------------------------------------------------------------------------

# (mesh rank, weights' spec, inputs' spec): tensor parallel on 1, 2 and 3 axes, with and without a batch split.
WHILE_LAYOUTS = [
    (1, P("a", None), P()),
    (2, P("b", None), P()),
    (2, P("b", None), P(None, "a", None)),
    (3, P("c", None), P(None, "a", None)),
    (2, P(), P(None, "a", None)),
]


@pytest.mark.parametrize("rank, weights, inputs", WHILE_LAYOUTS, ids=[f"{r}-{w}-{i}" for r, w, i in WHILE_LAYOUTS])
def test_counted_while_loop_names_xlas_collectives(rank: int, weights: P, inputs: P) -> None:
    """Kinds, counts per trip and bytes as XLA compiles the loop (its trip count found as XLA's loop analysis
    finds it: rules_loops.trip_count); peak memory is the next test's known gap."""
    case = Case("while", looped, CORPUS_ARGS, (weights, weights, P(), inputs), rank, False, False)
    mesh = _mesh(rank, False)
    report, got, got_sent, _ = _explain(case, mesh, looped)
    want, want_sent, _, _ = _xla(case, mesh, looped)
    gap = gaps(Measured(got, got_sent, 0), Measured(want, want_sent, 0), peak_range=(0.0, float("inf")))
    assert within_bound(gap, report.approximate_bound), (got, got_sent, want, want_sent, report.approximate_at)


def scanned_transposing(wi: Any, wh: Any, b: Any, xs: Any) -> Any:
    """The same loop with the cell written ``x @ w.T``: a transpose of each weight inside the body."""
    h0 = jnp.zeros((xs.shape[1], wh.shape[1]), xs.dtype)
    cell = partial(gru_cell, project=lambda x, w: x @ w.T)
    return jnp.sum(lax.scan(lambda h, x: (cell(wi, wh, b, x, h), None), h0, xs)[0] ** 2)


def test_weights_transposed_in_a_loop_body_peak_memory() -> None:
    """A weight transposed inside a loop body is folded into the dot reading it (memory.py's transpose folding):
    no buffer of its own, as XLA does (it was 1.63x XLA's peak on this unsplit GRU before the folding)."""
    args = (_struct(192, 16), _struct(192, 64), _struct(192), _struct(2, 8, 16))
    check(Case("scan", scanned_transposing, args, (P(), P(), P(), P()), 1, False, False, "recurrent"))


# -- peak memory where XLA takes the carry's other fixed point ------------------------------------------------------


def gru_against_labels(wi: Any, wh: Any, b: Any, wo: Any, xs: Any, ys: Any) -> Any:
    """The corpus's GRU: the state read out by a head and held against labels split on the batch (which pulls
    XLA's carry onto the batch split)."""
    h0 = jnp.zeros((xs.shape[1], wh.shape[1]), xs.dtype)
    h = lax.scan(lambda h, x: (gru_cell(wi, wh, b, x, h), None), h0, xs)[0]
    return jnp.mean((_projected(h, wo) - ys) ** 2)


# jax 0.12's XLA:CPU takes the body's fixed point for the GRU carry even against batch-split labels (measured in
# .ci/run's Python 3.12 stage: 33 all-gathers where jax 0.10's XLA, and explain, all-to-all the carry 16 times):
# the fixed point XLA's propagation picks differs between releases; explain models jax 0.10's.
# Seen on jax 0.12.0.1 (CI's py3.12) and on jax 0.11.2 (a lent GPU machine's image, CPU devices, 2026-11-27).
_OTHER_FIXED_POINT_ON_JAX_011 = pytest.mark.xfail(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 11),
    strict=True,
    reason="jax 0.11+'s XLA keeps the body's fixed point for the carry against batch-split labels",
)


@_OTHER_FIXED_POINT_ON_JAX_011
@pytest.mark.parametrize("grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_gru_against_batch_split_labels_takes_xlas_fixed_point(explicit: bool, grad: bool) -> None:
    """The corpus's fsdp case: the state read out by a head and held against labels split on the batch pulls XLA's
    carry onto the batch split (rules_control.carry_pulled), in the forward loop and in its transpose.  XLA carries
    that split back into the body (the fused projections all-to-all'd to it, nothing permuted), gathers the
    recurrent weight once for the backward loop (loop-invariant), and sums each weight's gradient per trip into
    its split accumulator: kinds, counts and bytes are the compiled program's, and peak memory lies within 25% or
    within the bound the report states (the combined sums, rules_control.COMBINED_SUMS_NOTE)."""
    args = (*CORPUS_ARGS[:3], _struct(4, 64), CORPUS_ARGS[3], _struct(8, 4))
    specs = (*FSDP[:3], P("a", None), FSDP[3], P("a", None))
    fn = in_auto_axes(gru_against_labels) if explicit else gru_against_labels
    fn = jax.grad(fn, argnums=(0, 1, 2, 3)) if grad else fn
    case = Case("scan", fn, args, specs, 2, explicit, False, "recurrent")
    mesh = _mesh(2, explicit)
    report, got, got_sent, _ = _explain(case, mesh, fn)
    want, want_sent, _, want_peak = _xla(case, mesh, fn)
    assert got == want, (got, want)
    assert got_sent == want_sent, (got_sent, want_sent)
    assert not any(CARRY_NOTE in op.note for op in report.ops)  # pulled: the fixed point is known
    gap = gaps(Measured({}, 0, report.peak_bytes), Measured({}, 0, want_peak), peak_range=(0.75, 1.25))
    assert gap.peak <= report.approximate_bound.peak, (report.peak_bytes, want_peak, report.approximate_at)


def gru_against_whole_labels(wi: Any, wh: Any, b: Any, wo: Any, xs: Any, ys: Any) -> Any:
    """The same read-out, for the layouts where nothing outside the loop splits the batch (whole labels)."""
    return gru_against_labels(wi, wh, b, wo, xs, ys)


@pytest.mark.parametrize(
    "labels", [P(), pytest.param(P("a", None), marks=_OTHER_FIXED_POINT_ON_JAX_011)], ids=["whole", "batch-split"]
)
def test_carry_fixed_point_follows_the_loop_results_readers(labels: P) -> None:
    """Measured: labels whole keep the body's split (the gates permuted per trip); labels split on the batch pull
    the batch split (the projections all-to-all'd per trip).  Explain takes the same one in each."""
    args = (*CORPUS_ARGS[:3], _struct(4, 64), CORPUS_ARGS[3], _struct(8, 4))
    specs = (*FSDP[:3], P(), FSDP[3], labels)
    case = Case("scan", gru_against_whole_labels, args, specs, 2, False, False, "recurrent")
    mesh = _mesh(2, False)
    _, got, got_sent, _ = _explain(case, mesh, case.fn)
    want, want_sent, _, _ = _xla(case, mesh, case.fn)
    assert (got, got_sent) == (want, want_sent)
    assert ("all-to-all" in want) == (labels != P()), want


def two_gradients_per_trip(w1: Any, w2: Any, xs: Any) -> Any:
    """A data-parallel loop summing two weights' gradients per trip: both partial sums whole on every device."""

    def body(c: Any, x: Any) -> Any:
        g1, g2 = c
        h = jnp.tanh(x @ w1)
        return (g1 + x.T @ h, g2 + h.T @ (h @ w2)), None

    (g1, g2), _ = lax.scan(body, (jnp.zeros_like(w1), jnp.zeros_like(w2)), xs)
    return jnp.sum(g1**2) + jnp.sum(g2**2)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_loop_body_all_reduces_combined_hold_every_partial_sum(explicit: bool) -> None:
    """XLA's all-reduce combiner issues a trip's independent all-reduces as one (a tuple all-reduce in the HLO),
    so the iteration holds both partial sums and both sums at once: explain's peak within 10% of XLA's (0.86x
    when each pair was held alone)."""
    fn = in_auto_axes(two_gradients_per_trip) if explicit else two_gradients_per_trip
    args = (_struct(128, 128), _struct(128, 64), _struct(4, 64, 128))
    case = Case("scan", fn, args, (P(), P(), P(None, "a", None)), 1, explicit, False)
    mesh = _mesh(1, explicit)
    report, got, _, _ = _explain(case, mesh, fn)
    want, _, _, want_peak = _xla(case, mesh, fn)
    assert got == want, (got, want)
    assert 0.9 <= report.peak_bytes / want_peak <= 1.1, (report.peak_bytes, want_peak)


# -- a slice of a split axis: XLA's halo exchange, permute by permute (the GRU's fused gates, jnp.split) ------------


@st.composite
def split_slice(draw: Any) -> tuple[int, int, int, int]:
    """(devices, axis length, slice size, slice start): both the axis and the slice divide evenly."""
    n = draw(st.sampled_from([2, 4, 8]))
    block = draw(st.sampled_from([2, 4, 6, 8, 12, 24]))
    length = n * block
    size = n * draw(st.integers(1, block - 1))
    return n, length, size, draw(st.integers(0, length - size))


def _xla_slice_permutes(n: int, length: int, size: int, offset: int) -> tuple[list[str], list[int]]:
    """The compiled program's collectives for ``x[:, offset:offset + size]`` read elementwise with an input split
    as the result: kinds, and each collective-permute's size along the axis."""
    from jax.sharding import NamedSharding

    from einshard.testing import hlo

    mesh = jax.make_mesh((n,), ("a",), devices=jax.devices()[:n])
    sh = NamedSharding(mesh, P(None, "a"))
    rows = 8

    def f(x: Any, y: Any) -> Any:
        return jnp.tanh(x[:, offset : offset + size]) * y

    args = (jax.ShapeDtypeStruct((rows, length), jnp.float32), jax.ShapeDtypeStruct((rows, size), jnp.float32))
    text = jax.jit(f, in_shardings=(sh, sh), out_shardings=sh).lower(*args).compile().as_text()
    found = hlo.collectives(text)  # a permute between one pair of devices counts too (normalized drops it)
    per_position = rows * 4
    return sorted(c.kind for c in found), sorted(c.array_bytes // per_position for c in found if "permute" in c.kind)


def _model_slice_permutes(n: int, length: int, size: int, offset: int) -> tuple[list[str], list[int]]:
    from einshard._src.analysis.program.slice_halo import slice_move

    move = slice_move(length, n, size, offset)
    kinds = ["collective-permute"] * len(move.permutes) + (["all-gather"] if move.how == "gather" else [])
    return sorted(kinds), sorted(move.permutes)


@given(split_slice())
@settings(max_examples=12, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_slice_of_a_split_axis_sends_xlas_halos(drawn: tuple[int, int, int, int]) -> None:
    """Each collective-permute XLA compiles for a slice of a split axis, by size: the plain halo exchange (the
    stretch from the needed start to the block's end, each side), the compact one where a halo is wider than twice
    the result block, or a gather where the halos reach past the neighbours (einshard/_src/.../slice_halo.py)."""
    assert _xla_slice_permutes(*drawn) == _model_slice_permutes(*drawn), drawn


# (devices, length, size, start): each of XLA's three paths, measured.
SLICE_PATHS = [
    (2, 192, 64, 0),  # the GRU's first gate over 2: the halo of 64 (its whole piece), not the 32 device 1 reads
    (2, 192, 64, 128),  # its last gate: the right halo
    (2, 64, 16, 0),  # a halo of 24 > 2 x 8: the compact exchange sends the 8 read
    (8, 64, 40, 0),  # 40 + 24 over 8: halos of several distances
    (4, 96, 24, 72),
    (8, 192, 64, 64),
]


@pytest.mark.parametrize("drawn", SLICE_PATHS, ids=[str(d) for d in SLICE_PATHS])
def test_slice_paths_match_xla(drawn: tuple[int, int, int, int]) -> None:
    assert _xla_slice_permutes(*drawn) == _model_slice_permutes(*drawn), drawn


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_gru_tensor_parallel_forward_sends_xlas_bytes(explicit: bool) -> None:
    """The corpus's tp forward: the fused gates' pieces move as XLA's halo exchange moves them (64 columns each
    way per step, where the pieces devices read are 32): explain's bytes are the compiled program's."""
    case = _corpus_case(TP, explicit, False)
    mesh = _mesh(2, explicit)
    _, got, got_sent, _ = _explain(case, mesh, case.fn)
    want, want_sent, _, _ = _xla(case, mesh, case.fn)
    assert got == want, (got, want)
    assert got_sent == want_sent, (got_sent, want_sent)


# -- a gather of a loop constant is made once, outside the loop ------------------------------------------------------


def _row_split_scanned(w: Any, xs: Any) -> Any:
    h = lax.scan(lambda h, x: (jnp.tanh(x @ w + h), None), jnp.zeros((xs.shape[1], w.shape[1])), xs)[0]
    return jnp.sum(h**2)


def _row_split_looped(w: Any, xs: Any) -> Any:
    def body(c: Any) -> Any:
        i, h = c
        return i + 1, jnp.tanh(lax.dynamic_index_in_dim(xs, i, keepdims=False) @ w + h)

    return jnp.sum(
        lax.while_loop(lambda c: c[0] < xs.shape[0], body, (0, jnp.zeros((xs.shape[1], w.shape[1]))))[1] ** 2
    )


@pytest.mark.parametrize("fn", [_row_split_scanned, _row_split_looped], ids=["scan", "while"])
def test_gather_of_a_loop_constant_is_hoisted(fn: Any) -> None:
    """``x[b@a] @ w[d@a, f]`` in a loop body: XLA gathers the constant weight once, outside the loop (one
    all-gather of the whole weight for four trips), where explain gathered it every trip (4x the bytes)."""
    case = Case(
        "scan", fn, (_struct(256, 256), _struct(4, 8, 256)), (P("a", None), P(None, "a", None)), 1, False, False
    )
    check(case)
    mesh = _mesh(1, False)
    _, got, got_sent, _ = _explain(case, mesh, fn)
    want, want_sent, _, _ = _xla(case, mesh, fn)
    assert (got, got_sent) == (want, want_sent)
    assert got["all-gather"] == 1, got


# -- a pending-sum carry lands at its readers' split ----------------------------------------------------------------


def lstm_cell(wi: Any, wh: Any, x: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
    """Flax's OptimizedLSTMCell, batched: the four gates' kernels concatenated on their outputs."""
    c, h = carry
    i, f, g, o = jnp.split(x @ wi + h @ wh, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return c, jax.nn.sigmoid(o) * jnp.tanh(c)


def lstm_outputs(wi: Any, wh: Any, xs: Any) -> Any:
    """The cell over time from a zero state, every step's output stacked (flax's nn.RNN)."""
    z = jnp.zeros((xs.shape[1], wh.shape[0]), xs.dtype)
    return lax.scan(lambda ch, x: ((ch := lstm_cell(wi, wh, x, ch)), ch[1]), (z, z), xs)[1]


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_pending_sum_carry_lands_at_its_readers_split(explicit: bool) -> None:
    """The corpus's flax_lstm dp_tp gradient, minimal: the gates split on 'b' (the kernels' columns), the batch on
    'a'.  The backward loop's h-cotangent carry is a dot's partial sum over 'b' (``dgates @ kernel_h.T``); its
    readers in the next trip multiply it with residuals split on 'b', and XLA reduce-scatters it there each trip
    (rules_control._readers_split), where explain had settled the carry whole and all-reduced it."""
    args = (_struct(16, 128), _struct(32, 128), _struct(6, 8, 16))
    case = Case(
        "scan",
        in_auto_axes(lstm_outputs) if explicit else lstm_outputs,
        args,
        (P(None, "b"), P(None, "b"), P(None, "a")),
        2,
        explicit,
        True,
        "recurrent",
    )
    check(case)
    mesh = _mesh(2, explicit)
    fn = _loss(case.fn, 3)
    _, got, got_sent, _ = _explain(case, mesh, fn)
    want, want_sent, _, _ = _xla(case, mesh, fn)
    assert got == want and got_sent == want_sent, (got, want, got_sent, want_sent)
    assert got["reduce-scatter"] >= 6, got  # one per trip


@settings(max_examples=3, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(
    hidden=st.sampled_from([16, 32]),
    batch=st.sampled_from([8, 16]),
    length=st.sampled_from([2, 6]),
    explicit=st.booleans(),
)
def test_pending_sum_carry_with_idle_axes_is_spread_over_them(
    hidden: int, batch: int, length: int, explicit: bool
) -> None:
    """The same LSTM under tp alone (the batch whole): the 'a' axis neither the gates nor the kernels split holds
    as many devices as the sum over 'b', and XLA spreads the h-cotangent's sum over it: each trip all-reduces the
    slice of the carry its idle group owns and permutes it onto the readers' split (rules_control._spread_over_idle;
    the corpus's flax_lstm tp gradient: 8 such permutes explain lacked).  Collectives per trip, bytes and peak
    held to XLA's (check)."""
    args = (_struct(16, 4 * hidden), _struct(hidden, 4 * hidden), _struct(length, batch, 16))
    spec = (P(None, "b"), P(None, "b"), P())
    fn = in_auto_axes(lstm_outputs) if explicit else lstm_outputs
    case = Case("scan", fn, args, spec, 2, explicit, True, "recurrent")
    check(case)
    mesh = _mesh(2, explicit)
    loss = _loss(case.fn, 3)
    _, got, got_sent, _ = _explain(case, mesh, loss)
    want, want_sent, _, _ = _xla(case, mesh, loss)
    assert got == want and got_sent == want_sent, (got, want, got_sent, want_sent)
    assert got["reduce-scatter"] == 0 and got["all-reduce"] >= length, got  # one slice's sum per trip
