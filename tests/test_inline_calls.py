"""Nested ``jax.jit`` calls are inlined before the walk, as XLA inlines them before its propagation (:mod:`.inline`).

A user's jitted train step passed whole, ``jax.grad`` of a jitted loss, jitted helpers (``jnp.take``, ``jax.nn``'s
functions): XLA compiles each exactly as the program without the calls, and so must explain (the open values of
tests/test_open_values.py, inside a call, were not followed: 1 all-reduce where XLA has a permute and 2).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_open_values import PROGRAMS, _args, report_and_compiled

from einshard._src.analysis.program import trace
from einshard._src.analysis.program.inline import inlined_calls
from einshard.testing import hlo


def _collectives(report: Any) -> tuple[Counter, float]:
    ops = [(op, c) for op in report.ops for c in op.collectives if c.group_size > 1]
    return Counter(c.kind for op, c in ops for _ in range(op.repeat)), sum(c.bytes * op.repeat for op, c in ops)


# jax 0.12's XLA compiles the jitted two_blocks gradient on Explicit axes with one collective-permute more than the
# same program unwrapped (3 against 2; jax 0.10's compiles the two alike, and on Auto axes both releases do): its
# call keeps a border there that explain's inlining does not model (measured on jax 0.12.0.1 in CI's Python 3.12 run).
_JAX_012 = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)
_CASES = [
    pytest.param(
        name,
        axis,
        grad,
        id=f"{name}-{axis.name.lower()}-{'grad' if grad else 'loss'}",
        marks=pytest.mark.xfail(
            strict=True, reason="jax 0.12's XLA: a permute more for the jitted program than for the flat one"
        )
        if _JAX_012 and (name, axis, grad) == ("two_blocks", AxisType.Explicit, True)
        else (),
    )
    for name in sorted(PROGRAMS)
    for axis in (AxisType.Auto, AxisType.Explicit)
    for grad in (False, True)
]


@pytest.mark.parametrize(("name", "axis", "grad"), _CASES)
def test_a_jitted_program_is_explained_as_the_program_and_as_xla(name: str, axis: AxisType, grad: bool) -> None:
    """``jax.jit(f)`` passed whole: the report is the unwrapped program's, op for op, and its collectives and bytes
    are XLA's (which compiles the two alike)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis, axis))
    flat, _ = report_and_compiled(PROGRAMS[name], mesh, grad)
    wrapped, compiled = report_and_compiled(jax.jit(PROGRAMS[name]), mesh, grad)
    _same_as_flat_and_xla(wrapped, flat, compiled)


def _same_as_flat_and_xla(wrapped: Any, flat: Any, compiled: Any) -> None:
    """``wrapped`` is the ``flat`` program's report op for op (peak too), and its collectives and bytes are those
    of XLA's ``compiled`` program."""
    assert [(op.expression, op.collectives) for op in wrapped.ops] == [
        (op.expression, op.collectives) for op in flat.ops
    ]
    assert wrapped.peak_bytes == flat.peak_bytes
    kinds, sent = _collectives(wrapped)
    xla = [c for c in hlo.normalized(compiled.as_text() or "") if c.group_size > 1]
    assert kinds == Counter(c.kind for c in xla for _ in range(c.runs))
    assert sent == pytest.approx(sum(c.sent_bytes * c.runs for c in xla), rel=0.10)


def _nested(draw: st.DrawFn) -> Any:
    """``fn`` with its stages drawn into jit calls: the whole, the elementwise maker, each reader (one or two
    levels deep)."""

    def maybe_jit(g: Any) -> Any:
        depth = draw(st.integers(0, 2))
        for _ in range(depth):
            g = jax.jit(g)
        return g

    scale, tanh, dot = maybe_jit(lambda t: t * 2.0), maybe_jit(jnp.tanh), maybe_jit(lambda x, w: x @ w)
    square = maybe_jit(jnp.square)

    def program(t: Any, ids: Any, w: Any, w2: Any) -> Any:
        x = scale(t)
        return jnp.mean(square(x + tanh(dot(x, w))))

    return maybe_jit(program)


@given(data=st.data(), grad=st.booleans())
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_drawn_nestings_of_jit_calls_explain_as_the_flat_program(data: st.DataObject, grad: bool) -> None:
    """Drawn: which stages of a residual block are jit calls, and how deep; the report is the flat program's (which
    XLA's is: tests above), and the traced program holds no call at its top level."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    nested = _nested(data.draw)

    def flat(t: Any, ids: Any, w: Any, w2: Any) -> Any:
        x = t * 2.0
        return jnp.mean(jnp.square(x + jnp.tanh(x @ w)))

    got, _ = report_and_compiled(nested, mesh, grad)
    want, _ = report_and_compiled(flat, mesh, grad)
    assert [(op.expression, op.collectives) for op in got.ops] == [(op.expression, op.collectives) for op in want.ops]
    assert got.peak_bytes == want.peak_bytes
    fn = jax.grad(nested, argnums=(2, 3)) if grad else nested
    traced = trace(fn, *_args(), mesh={"data": 4, "model": 2})
    assert not [e for e in traced.jaxpr.eqns if e.primitive.name == "jit"]


def test_a_call_that_places_its_result_stays_a_call() -> None:
    """A jit with ``out_shardings`` fixes a layout at its border (a placement, as XLA keeps it): not inlined."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    placed = jax.jit(lambda x: x * 2.0, out_shardings=NamedSharding(mesh, P("data")))
    closed = jax.make_jaxpr(lambda x: jnp.sum(placed(x) + 1.0))(jnp.ones((8, 4)))
    assert [e.primitive.name for e in inlined_calls(closed.jaxpr).eqns].count("jit") == 1


def test_a_body_called_twice_is_inlined_with_fresh_variables() -> None:
    """JAX reuses one traced body for every call on the same shapes: each inlined copy binds its own variables."""
    double = jax.jit(lambda x: jnp.sin(x) * 2.0)
    closed = jax.make_jaxpr(lambda x: double(double(x)))(jnp.ones((4,)))
    calls = [e for e in closed.jaxpr.eqns if e.primitive.name == "jit"]
    assert len(calls) == 2 and calls[0].params["jaxpr"] is calls[1].params["jaxpr"]
    flat = inlined_calls(closed.jaxpr)
    made = [v for e in flat.eqns for v in e.outvars]
    assert len(made) == len({id(v) for v in made}) == 4  # sin, mul, sin, mul: each bound once
    out = jax.core.eval_jaxpr(flat, closed.consts, np.ones(4, np.float32))[0]
    np.testing.assert_allclose(out, np.sin(np.sin(np.ones(4)) * 2.0) * 2.0, rtol=1e-6)


# (no jax 0.12 mark here: a call naming its shardings compiles as the flat program there too, measured on 0.12.0.1)
_STEP_CASES = [
    pytest.param(name, axis, grad, id=f"{name}-{axis.name.lower()}-{'grad' if grad else 'loss'}")
    for name in sorted(PROGRAMS)
    for axis in (AxisType.Auto, AxisType.Explicit)
    for grad in (False, True)
]


@pytest.mark.parametrize(("name", "axis", "grad"), _STEP_CASES)
def test_a_jitted_step_with_shardings_is_explained_as_xla_compiles_it(name: str, axis: AxisType, grad: bool) -> None:
    """The user's step as MaxText-style code jits it, ``jax.jit(step, in_shardings=..., out_shardings=...,
    donate_argnums=...)``, passed to explain whole with no specs: its shardings are the program's argument and output
    layouts (XLA compiles the call as the program), so the report is the unwrapped program's with those layouts, op
    for op, and its collectives and bytes are XLA's.  Before, the call was walked as a call and its body's open values
    were not followed (tanh_residual's loss on Auto axes: 1 all-reduce, where XLA has a permute and 2).  Arguments
    given as ShapeDtypeStructs without a sharding take the call's ``in_shardings`` (on Auto axes: on Explicit axes
    JAX types such an argument whole, and reshards it at the call)."""
    from test_open_values import SPECS

    import einshard

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis, axis))
    fn = jax.grad(PROGRAMS[name], argnums=(2, 3)) if grad else PROGRAMS[name]
    args = _args()
    shardings = tuple(einshard.sharding(e, a.shape, mesh=mesh) for e, a in zip(SPECS, args))
    out = (shardings[2], shardings[3]) if grad else NamedSharding(mesh, P())
    step = jax.jit(fn, in_shardings=shardings, out_shardings=out, donate_argnums=(2, 3) if grad else ())
    placed = jax.device_put(args, shardings)
    asked = [s.spec for s in out] if grad else [P()]  # type: ignore[union-attr]
    with jax.set_mesh(mesh):
        compiled = step.lower(*placed).compile()
        flat = trace(fn, *placed, mesh=mesh).report(None, asked)
        wrapped = trace(step, *placed, mesh=mesh).report()
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
        unplaced = trace(step, *shapes, mesh=mesh).report()
    _same_as_flat_and_xla(wrapped, flat, compiled)
    if axis == AxisType.Auto:  # (on Explicit axes an unsharded ShapeDtypeStruct is typed whole: JAX's own program)
        assert [(op.expression, op.collectives) for op in unplaced.ops] == [
            (op.expression, op.collectives) for op in flat.ops
        ]


def test_a_program_that_is_one_call_with_constants_stays_a_call() -> None:
    """A jitted step that closes over constants is left a call (the constants are the call's, not arguments)."""
    from einshard._src.analysis.program.inline import sole_call

    table = np.arange(8.0, dtype=np.float32)
    step = jax.jit(lambda x: x * jnp.asarray(table))
    closed = jax.make_jaxpr(step)(jnp.ones((8,)))
    found = sole_call(closed.jaxpr)
    body = closed.jaxpr.eqns[0].params["jaxpr"]
    assert (found is None) == bool(getattr(body, "consts", None))
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    shard = NamedSharding(mesh, P("data"))
    placed_step = jax.jit(lambda x: x * 2.0, in_shardings=shard, out_shardings=shard)
    body_of, ins, outs = sole_call(jax.make_jaxpr(placed_step)(jnp.ones((8,))).jaxpr)  # type: ignore[misc]
    assert ins == (P("data"),) and outs == (P("data"),) and [e.primitive.name for e in body_of.eqns] == ["mul"]


@given(data=st.data())
@settings(max_examples=6, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
def test_drawn_jitted_steps_explain_as_xla_compiles_them(data: st.DataObject) -> None:
    """Drawn: the program, Auto or Explicit axes, loss or gradient, which arguments the jit names an
    ``in_shardings`` for (the others left to the arrays' own), whether it names ``out_shardings`` and donates.  The
    report with no specs is the flat program's under the layouts XLA compiles (the arrays' own, the call's
    ``out_shardings`` where named) op for op, and its collectives and bytes are XLA's."""
    from test_open_values import SPECS

    import einshard

    name = data.draw(st.sampled_from(sorted(PROGRAMS)), label="program")
    axis = data.draw(st.sampled_from([AxisType.Auto, AxisType.Explicit]), label="axis")
    grad = data.draw(st.booleans(), label="grad")
    named = data.draw(st.lists(st.booleans(), min_size=4, max_size=4), label="in_shardings named")
    name_out = data.draw(st.booleans(), label="out_shardings named")
    if _JAX_012 and (name, axis, grad) == ("two_blocks", AxisType.Explicit, True) and not (any(named) or name_out):
        return  # (a plain jit there: jax 0.12's XLA makes a permute more than for the flat program; _CASES marks it)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis, axis))
    fn = jax.grad(PROGRAMS[name], argnums=(2, 3)) if grad else PROGRAMS[name]
    args = _args()
    shardings = tuple(einshard.sharding(e, a.shape, mesh=mesh) for e, a in zip(SPECS, args))
    out = (shardings[2], shardings[3]) if grad else NamedSharding(mesh, P())
    step = jax.jit(
        fn,
        in_shardings=tuple(s if n else None for s, n in zip(shardings, named)),
        out_shardings=out if name_out else None,
        donate_argnums=(2, 3) if grad and data.draw(st.booleans(), label="donate") else (),
    )
    placed = jax.device_put(args, shardings)
    with jax.set_mesh(mesh):
        compiled = step.lower(*placed).compile()
        wrapped = trace(step, *placed, mesh=mesh).report()
        asked = [s.spec for s in out] if grad else [P()]  # type: ignore[union-attr]
        flat = trace(fn, *placed, mesh=mesh).report(None, asked if name_out else None)
    _same_as_flat_and_xla(wrapped, flat, compiled)
