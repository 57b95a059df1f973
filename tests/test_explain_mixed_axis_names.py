"""Elementwise ops whose operands name their axes differently (issue 20).

An argument laid out by an einshard expression names its axes (``'p q -> p@a q'``); an op's output has
positional names (d0, d1...).  An elementwise op between the two is one tensor shape: explain must compare
the layouts position by position (it raised "transition between different tensors" before).  The property
test draws chains mixing both kinds of operand and holds the named explanation to the positional one
(PartitionSpecs): the names must not change what is charged.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from explain_counts import explained_collectives
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.program import trace

MESH = {"a": 4, "b": 2}
B, C = 16, 32
SPLITS = ((), ("a",), ("b",))
BINARY = {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "max": jnp.maximum}


def _expr(names: tuple[str, str], dims: tuple[tuple[str, ...], ...]) -> str:
    """``'p q -> p@a q'``: the einshard expression of a 2-d layout (named axes)."""
    out = " ".join(n + (f"@{d[0]}" if d else "") for n, d in zip(names, dims))
    return f"{' '.join(names)} -> {out}"


def _spec(dims: tuple[tuple[str, ...], ...]) -> P:
    return P(*(d[0] if d else None for d in dims))


@st.composite
def layout_dims(draw: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    first = draw(st.sampled_from(SPLITS))
    second = draw(st.sampled_from([s for s in SPLITS if not s or s != first]))
    return first, second


@st.composite
def chain(draw: Any) -> tuple[list[tuple[str, str, bool]], tuple[Any, Any, Any]]:
    """Steps (op, named operand, operand first?) applied to the dot's positional output, and three layouts."""
    steps = draw(
        st.lists(
            st.tuples(st.sampled_from(sorted(BINARY)), st.sampled_from(["x", "y"]), st.booleans()),
            min_size=1,
            max_size=4,
        )
    )
    # The dot contracts whole axes (q unsplit in x and w): its own collectives are the dot rule's business
    # (tests/test_explain*.py); here its output is the positional operand the chain's ops meet.
    rows, cols = draw(st.sampled_from(SPLITS)), draw(st.sampled_from(SPLITS))
    if rows and rows == cols:
        cols = ()
    return steps, ((rows, ()), ((), cols), draw(layout_dims()))


def _program(steps: list[tuple[str, str, bool]]) -> Any:
    def f(x: jax.Array, w: jax.Array, y: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w)  # positional names d0 d1 from here on
        named = {"x": x, "y": y}
        for op, operand, first in steps:
            h = BINARY[op](named[operand], h) if first else BINARY[op](h, named[operand])
        return h

    return f


def _explain_collectives(fn: Any, args: tuple[Any, ...], exprs: tuple[str, ...]) -> tuple[Counter, int]:
    report = trace(fn, *args, mesh=MESH).report(exprs)
    assert report.complete, report
    return explained_collectives(report)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
@given(chain())
def test_elementwise_chain_mixing_named_and_positional_axes(drawn: Any) -> None:
    """Names must not matter: the chain explained with named expressions costs what it costs with
    PartitionSpecs (every axis positional), and the result is complete."""
    steps, (xd, wd, yd) = drawn
    fn = _program(steps)
    args = (
        jax.ShapeDtypeStruct((B, C), jnp.float32),
        jax.ShapeDtypeStruct((C, C), jnp.float32),
        jax.ShapeDtypeStruct((B, C), jnp.float32),
    )
    exprs = (_expr(("p", "q"), xd), _expr(("q", "r"), wd), _expr(("s", "t"), yd))
    named = _explain_collectives(fn, args, exprs)
    positional = _explain_collectives(fn, args, (_spec(xd), _spec(wd), _spec(yd)))
    assert named == positional, ((steps, exprs), named, positional)


def test_named_operand_meets_a_dot_output_with_positional_names() -> None:
    """The minimal form of the crash: x (named by its expression) + x @ w (positional), layouts differ."""
    args = (jax.ShapeDtypeStruct((B, C), jnp.float32), jax.ShapeDtypeStruct((C, C), jnp.float32))
    report = einshard.explain(lambda x, w: x + x @ w, *args, mesh=MESH, in_specs=("p q -> p q@b", "q r -> q r@a"))
    assert report.complete
    named = _explain_collectives(lambda x, w: x + x @ w, args, ("p q -> p q@b", "q r -> q r@a"))
    positional = _explain_collectives(lambda x, w: x + x @ w, args, (P(None, "b"), P(None, "a")))
    assert named == positional and named[0]["all-gather"] >= 1, (named, positional)


def test_cholesky_of_a_named_argument_explains() -> None:
    """Issue 20's repro: a gram matrix (positional) plus a constant, then an op with no partitioning rule."""
    report = einshard.explain(
        lambda x: jnp.linalg.cholesky(x @ x.T + 64 * jnp.eye(64)),
        jax.ShapeDtypeStruct((64, 64), jnp.float32),
        mesh={"data": 4, "model": 2},
        in_specs=("a b -> a@data b",),
    )
    assert report.ops and report.peak_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "mode"), [("tp", "fwd"), ("dp_tp", "grad")])
def test_keras_hub_resnet_explains(strategy: str, mode: str) -> None:
    """Issue 20's corpus repros: keras-hub's ResNet under tp (loss) and dp x tp (grad) raised in explain."""
    pytest.importorskip("keras_hub")
    from external_corpus.compare import measure

    outcome = measure("kh_resnet", strategy, mode, "auto")  # type: ignore[arg-type]
    assert outcome.error == "" and "explain raised" not in outcome.misses, outcome
    assert outcome.complete and outcome.values_equal, outcome
