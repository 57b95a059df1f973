"""A partial sum settled where its consumer wants it: XLA reduce-scatters a sum over split axes when an elementwise
consumer's other operand splits the result over those mesh axes (its sharding propagation runs backwards from
the consumer), and all-reduces it otherwise.  Each case compiles the program and holds explain's collective kinds,
counts and bytes to the compiled HLO's, for reductions and dots, over 1-, 2- and 3-axis meshes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, Case, _explain, _mesh, _xla

F32 = jnp.float32
E, T, D = 8, 64, 16


def _sum_add(a: Any, x: Any) -> Any:
    return x + jnp.sum(a, axis=0)


def _sum_reshape_mul(a: Any, x: Any) -> Any:
    return x * jnp.sum(a, axis=0).reshape(x.shape)


def _dot_sub(a: Any, x: Any) -> Any:
    return x - jnp.einsum("etd,ed->td", a, jnp.ones((E, D), F32))


PROGRAMS: dict[str, tuple[Callable[..., Any], tuple[int, ...]]] = {
    "reduce_sum+add": (_sum_add, (T, D)),
    "reduce_sum+reshape+mul": (_sum_reshape_mul, (8, T // 8, D)),
    "dot_general+sub": (_dot_sub, (T, D)),
}


def _specs(rank: int, names: tuple[str, ...], partner: str) -> tuple[P, P]:
    summed = names[0] if rank == 1 else names[:2] if rank == 3 else names[0]
    a = P(summed)
    if partner == "summed axes":  # the partner splits the result's rows over the summed mesh axes: reduce-scatter
        return a, P(summed)
    if partner == "other axis" and rank > 1:  # over a mesh axis not summed: the sum is all-reduced
        return a, P(None, names[-1])
    return a, P()  # the partner whole: all-reduce


# A dot's sum whose consumer splits another axis over a mesh axis not summed: XLA slices the partial sum to that
# split first and all-reduces the smaller piece (half the bytes), and so does explain
# (rules_indexing.sliced_for_consumer).  A reduce_sum's sum is all-reduced whole there, in XLA as in explain.
def _params() -> list[Any]:
    out = []
    for name in sorted(PROGRAMS):
        for rank in (1, 2, 3):
            for partner in ("summed axes", "other axis", "whole"):
                out.append(pytest.param(name, rank, partner, id=f"{name}-{rank}-{partner}"))
    return out


@pytest.mark.parametrize("name, rank, partner", _params())
def test_a_sum_lands_where_its_elementwise_consumer_wants_it(name: str, rank: int, partner: str) -> None:
    fn, x_shape = PROGRAMS[name]
    mesh = _mesh(rank, False)
    specs = _specs(rank, tuple(mesh.axis_names), partner)
    args = (jax.ShapeDtypeStruct((E, T, D), F32), jax.ShapeDtypeStruct(x_shape, F32))
    case = Case(name, fn, args, specs, rank, False, False)
    want_kinds, want_bytes, _, _ = _xla(case, mesh, fn)
    _, got_kinds, got_bytes, _ = _explain(case, mesh, fn)
    assert got_kinds == want_kinds, (specs, got_kinds, want_kinds)
    assert got_bytes == want_bytes, (specs, got_bytes, want_bytes)
    if partner == "summed axes":
        assert want_kinds["reduce-scatter"] == 1 and not want_kinds["all-reduce"]


OPS: dict[str, Callable[[Any, Any], Any]] = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "max": jnp.maximum,
}


@st.composite
def _summed_then_combined(draw: Any) -> tuple[int, str, int, str, int]:
    """(mesh rank, op, summed mesh axes count, where the partner splits, which operand the sum is)."""
    rank = draw(st.sampled_from([1, 2, 3]))
    return (
        rank,
        draw(st.sampled_from(sorted(OPS))),
        draw(st.integers(1, rank)),
        draw(st.sampled_from(["rows", "columns", "whole"])),
        draw(st.integers(0, 1)),
    )


@FAST
@given(_summed_then_combined())
def test_drawn_sum_and_elementwise_consumer_match_xla(drawn: tuple[int, str, int, str, int]) -> None:
    _check_drawn(drawn)


@pytest.mark.slow
@DEEP
@given(_summed_then_combined())
def test_drawn_sum_and_elementwise_consumer_match_xla_deep(drawn: tuple[int, str, int, str, int]) -> None:
    _check_drawn(drawn)


def _check_drawn(drawn: tuple[int, str, int, str, int]) -> None:
    """Drawn: the mesh, the consumer, how many mesh axes the sum runs over, the partner's split, the operand order."""
    rank, op, n_summed, partner, side = drawn
    mesh = _mesh(rank, False)
    names = tuple(mesh.axis_names)
    summed = names[:n_summed]
    whole_part = P(*([None] * 2))
    parts = {"rows": P(summed if len(summed) > 1 else summed[0]), "columns": P(None, names[-1]), "whole": whole_part}

    def fn(a: Any, x: Any) -> Any:
        s = jnp.sum(a, axis=0)
        return OPS[op](s, x) if side == 0 else OPS[op](x, s)

    specs = (P(summed if len(summed) > 1 else summed[0]), parts[partner])
    args = (jax.ShapeDtypeStruct((E, T, D), F32), jax.ShapeDtypeStruct((T, D), F32))
    case = Case("reduce_sum", fn, args, specs, rank, False, False)
    want_kinds, want_bytes, _, _ = _xla(case, mesh, fn)
    _, got_kinds, got_bytes, _ = _explain(case, mesh, fn)
    if partner == "columns" and names[-1] not in summed and want_kinds["reduce-scatter"]:
        # XLA all-reduces over the summed axes and slices the columns to the partner's split on another mesh
        # axis; einshard.testing.hlo reads an all-reduce whose result a fusion dynamic-slices as a reduce-scatter
        # when the slice count equals the group size (2 and 2 here), so the two kinds are one here; the HLO
        # shows an all-reduce (the buffer is the same: array bytes compared below).
        want_kinds["all-reduce"] += want_kinds.pop("reduce-scatter")
    assert got_kinds == want_kinds, (drawn, got_kinds, want_kinds)
    assert got_bytes == want_bytes, (drawn, got_bytes, want_bytes)
