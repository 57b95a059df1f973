"""A loop body's values computed from its constants alone are loop-invariant: XLA's while-loop invariant code
motion moves them, and a gather of them, out of the loop (session 16's probe: Flax's ``OptimizedLSTMCell`` under
``nn.RNN`` concatenates its gates' kernels inside the scan; on FSDP explain gathered the concatenation once per
step, x8 XLA's collectives).  explain's collectives, counts (per run) and bytes are compared with the HLO."""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, MESHES, Case, check

from einshard._src.analysis.program import trace
from einshard.testing import hlo

B, D, F, T = 8, 32, 64, 6


def _cell(h: Any, x: Any, wx: Any, wh: Any, u: Any) -> Any:
    # The gates' kernels concatenated in the body, as OptimizedLSTMCell does (invariant: read only constants).
    k = jnp.concatenate([wx, u], axis=1)
    return jnp.tanh(x @ k[:, :F] + h @ wh)


def _scan(params: Any, xs: Any, h0: Any) -> Any:
    wx, wh, u = params
    h, _ = jax.lax.scan(lambda h, x: (_cell(h, x, wx, wh, u), None), h0, xs)
    return jnp.mean(h**2)


def _while(params: Any, xs: Any, h0: Any) -> Any:
    wx, wh, u = params

    def body(c: Any) -> Any:
        i, h = c
        return i + 1, _cell(h, xs[i], wx, wh, u)

    return jnp.mean(jax.lax.while_loop(lambda c: c[0] < T, body, (0, h0))[1] ** 2)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("fn", [_scan, _while], ids=["scan", "while"])
def test_gather_of_a_value_made_from_loop_constants_is_hoisted(fn: Any, explicit: bool) -> None:
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    # FSDP: the kernels split over the batch's axis on their contracted (input) dimension.
    ws = (P("data"), P("data"), P("data"))
    xs_spec = P(None, "data")
    shapes = ((D, F), (F, F), (D, F))
    args = (
        tuple(jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p)) for s, p in zip(shapes, ws)),
        jax.ShapeDtypeStruct((T, B, D), jnp.float32, sharding=NamedSharding(mesh, xs_spec)),
        jax.ShapeDtypeStruct((B, F), jnp.float32, sharding=NamedSharding(mesh, P("data"))),  # the initial state
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
        report = trace(fn, *args).report(None, [P()])
    (got, sent_got), (want, sent_want) = _collectives(report, compiled)
    assert not report.unfollowed
    assert got == want, (got, want)
    assert abs(sent_got - sent_want) <= 0.1 * max(sent_want, 1), (sent_got, sent_want)
    # The concatenation is gathered once, outside the loop, as XLA does: not once per step.
    assert want["all-gather"] < T


def _collectives(report: Any, compiled: Any) -> tuple[tuple[Counter[str], float], tuple[Counter[str], float]]:
    """((explain's collectives by kind per run, bytes each device sends), (the compiled program's, the same)): a
    collective inside a loop counts once per trip on both sides."""
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    got: Counter[str] = Counter()
    for op in report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                got[c.kind] += op.repeat
    sent_got = sum(c.bytes * op.repeat for op in report.ops for c in op.collectives if c.group_size > 1)
    return (got, sent_got), (_runs(found), sum(c.sent_bytes * c.runs for c in found))


def _runs(found: list) -> Counter[str]:
    out: Counter[str] = Counter()
    for c in found:
        out[c.kind] += c.runs
    return out


# -- a move of any kind of a value made from loop constants ---------------------------------------------------------

G = 4  # the gates


def _gates(h: Any, x: Any, ws: Any, u: Any) -> Any:
    # OptimizedLSTMCell's fused input projection: the gates' kernels, each split on its outputs, concatenated in the
    # body (loop-invariant) along their split axis, the result split back into the gates.
    i, f, g, o = jnp.split(x @ jnp.concatenate(ws, axis=1), G, axis=1)
    return jax.nn.sigmoid(o) * jnp.tanh(jax.nn.sigmoid(f) * (h @ u) + jax.nn.sigmoid(i) * jnp.tanh(g))


def _gates_scan(params: Any, xs: Any, h0: Any) -> Any:
    ws, u = params
    h, _ = jax.lax.scan(lambda h, x: (_gates(h, x, ws, u), None), h0, xs)
    return jnp.mean(h**2)


def _gates_while(params: Any, xs: Any, h0: Any) -> Any:
    ws, u = params

    def body(c: Any) -> Any:
        i, h = c
        return i + 1, _gates(h, xs[i], ws, u)

    return jnp.mean(jax.lax.while_loop(lambda c: c[0] < T, body, (0, h0))[1] ** 2)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.parametrize("fn", [_gates_scan, _gates_while], ids=["scan", "while"])
def test_any_move_of_a_value_made_from_loop_constants_is_hoisted(fn: Any, explicit: bool) -> None:
    """Tensor parallel: the gates' kernels split on their outputs over 'model', concatenated in the body.  XLA moves
    the concatenation out of the loop with its all-to-alls (the pieces to the joined split, the result back): once,
    not once per step (explain counted them per step: x T all-to-alls, as on the corpus's flax_lstm tp / dp_tp
    forward, 80 against XLA's 10).  The gates' split of each step's product stays in the loop (its permutes per
    step).  Collectives, counts per run, bytes and peak are held to the compiled program."""
    kind = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind,) * 2)
    kernel = jax.ShapeDtypeStruct((D, F), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    args = (
        ((kernel,) * G, jax.ShapeDtypeStruct((F, F), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))),
        jax.ShapeDtypeStruct((T, B, D), jnp.float32, sharding=NamedSharding(mesh, P(None, "data"))),
        # the state split as the gates are (the carry's type on Explicit axes)
        jax.ShapeDtypeStruct((B, F), jnp.float32, sharding=NamedSharding(mesh, P("data", "model"))),
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn).lower(*args).compile()
        report = trace(fn, *args).report(None, [P()])
    (got, sent_got), (want, sent_want) = _collectives(report, compiled)
    m = compiled.memory_analysis()
    peak_want = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert not report.unfollowed
    assert got == want, (got, want)
    assert abs(sent_got - sent_want) <= 0.1 * max(sent_want, 1), (sent_got, sent_want)
    assert 0.75 <= report.peak_bytes / peak_want <= 1.25, (report.peak_bytes, peak_want)
    # The concatenation's all-to-alls run once, outside the loop, as XLA makes them.
    assert 0 < want["all-to-all"] < T


# -- the property: drawn loops whose body moves a value made from its constants -------------------------------------


def _concatenating_scan(wx: Any, wh: Any, u: Any, xs: Any, h0: Any) -> Any:
    # _cell's program at the drawn width: the kernels concatenated in the body (loop-invariant), then sliced.
    width = wx.shape[1]

    def cell(h: Any, x: Any) -> Any:
        k = jnp.concatenate([wx, u], axis=1)
        return jnp.tanh(x @ k[:, :width] + h @ wh), None

    h, _ = jax.lax.scan(cell, h0, xs)
    return jnp.mean(h**2)


@st.composite
def loop_constant_case(draw: Any) -> Case:
    """A scan whose body concatenates its kernels (as _cell): its length, the kernels' shape, the batch, over the
    (8,), (4, 2) and (2, 2, 2) meshes, the loss or its gradient, in the layouts the hoisting rule is stated for:
    FSDP (the kernels split on their contracted input over the batch's axis) or tensor parallel (the kernels split
    on their outputs, the state split like them, the batch whole or over another axis); Auto or
    Explicit axes (the arguments typed with their layout; check() rejects a draw JAX refuses there)."""
    steps = draw(st.integers(2, 8))
    d = draw(st.sampled_from([16, 32]))
    f = draw(st.sampled_from([16, 32, 64]))
    batch = draw(st.sampled_from([8, 16]))
    rank = draw(st.sampled_from([1, 2, 3]))
    names = MESHES[rank][1]
    axis = draw(st.sampled_from(names))
    if draw(st.booleans()):  # FSDP
        # Over the batch's axis where XLA gathers the kernels (hoisted), the rule's premise: where the batch's axis
        # leaves a larger idle part of the mesh, XLA moves the kernels onto it instead (a permute, hoisted, beside
        # the product's all-reduce in the loop), which the rule does not hoist: LOOP_MISSES below.
        rank, axis = draw(st.sampled_from([(1, "a"), (2, "a")]))
        names = MESHES[rank][1]
        specs = (P(axis),) * 3 + (P(None, axis), P(axis))
    else:
        batch_axis = draw(st.sampled_from([None, *(n for n in names if n != axis)]))
        specs = (P(None, axis),) * 3 + (P(None, batch_axis), P(batch_axis, axis))
    args = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((d, f), (f, f), (d, f), (steps, batch, d), (batch, f)))
    return Case("scan", _concatenating_scan, args, specs, rank, draw(st.booleans()), draw(st.booleans()))


def test_loop_constant_moves_match_xla() -> None:
    """Collectives (kinds, counts per run), bytes and peak against the compiled program, by the per-primitive tests'
    rule (tests/test_primitive_rules.check): within the report's stated bound, zero where nothing is approximate."""
    settings(FAST, max_examples=6)(given(loop_constant_case())(check))()


# Drawn programs where explain and XLA disagree (the first two found by the deep run and the wider strategy).
LOOP_MISSES = {
    "fsdp-onto-idle-axes": (
        "FSDP on the (4, 2) mesh's 'b' (the batch and the kernels' inputs), 2 steps: XLA moves the kernels onto the "
        "idle 'a' (a collective-permute of each, hoisted: run once) and all-reduces each step's product over 'a'; "
        "explain names the same collectives but counts the permutes once per step (walker._hoisted_repeat hoists an "
        "op's collectives only where all of them gather loop constants: the dot's permute of its constant operand "
        "sits beside its product's all-reduce, which stays in the loop). Also (2, 2, 2) over 'a'."
    ),
    "fsdp-gradient-accumulation": (
        "FSDP on the (8,) mesh, kernels (32, 16), 5 steps, the gradient: explain names 5 of the backward loop's "
        "all-reduces reduce-scatters (bytes equal, 24580 B), where XLA all-reduces all 11: in the backward loop XLA all-reduces "
        "the FSDP kernels' per-step gradient contributions whole (one tuple all-reduce of two whole dots a step, "
        "the accumulator whole in the carry: likely XLA's larger peak too, not measured apart) where explain reduce-scatters one of them a "
        "step; not the hoisting rule's "
        "(seen with 16-wide kernels only; (32, 64) kernels match). The deep run's first miss is this one: kernels "
        "(16, 16), 2 steps: 2 reduce-scatters + 3 all-reduces against XLA's 5 all-reduces, 8196 B both, and "
        "explain's peak 7424 B against XLA's 11456 B."
    ),
}


def _loop_miss_case(name: str) -> Case:
    d, f, batch, steps, rank, axis, grad = {
        "fsdp-onto-idle-axes": (16, 16, 8, 2, 2, "b", False),
        "fsdp-gradient-accumulation": (32, 16, 16, 5, 1, "a", True),
    }[name]
    specs = (P(axis),) * 3 + (P(None, axis), P(axis))
    args = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in ((d, f), (f, f), (d, f), (steps, batch, d), (batch, f)))
    return Case("scan", _concatenating_scan, args, specs, rank, False, grad)


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.xfail(reason=why, strict=True)) for n, why in LOOP_MISSES.items()]
)
def test_loop_constant_moves_known_misses(name: str) -> None:
    check(_loop_miss_case(name))


def _accumulates_whole(case: Case) -> bool:
    # LOOP_MISSES["fsdp-gradient-accumulation"]: the FSDP gradient with 16-wide kernels, kept as its strict xfail above
    # so that the deep run holds every other draw to XLA.
    fsdp = case.specs[0][0] is not None
    return case.grad and fsdp and case.args[0].shape[1] == 16


@pytest.mark.slow
def test_loop_constant_moves_match_xla_deep() -> None:
    DEEP(given(loop_constant_case().filter(lambda case: not _accumulates_whole(case)))(check))()
