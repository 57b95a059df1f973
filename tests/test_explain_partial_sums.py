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
from jax.sharding import PartitionSpec as P
from test_primitive_rules import Case, _explain, _mesh, _xla

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
# split first and all-reduces the smaller piece (half the bytes); explain all-reduces the dot's whole result.
# (A reduce_sum's pending sum is sliced first, as XLA does; a dot settles its sum where it is computed.)
DOT_SLICED_FIRST = "explain all-reduces a dot's whole sum where XLA slices it to the consumer's split first"


def _params() -> list[Any]:
    out = []
    for name in sorted(PROGRAMS):
        for rank in (1, 2, 3):
            for partner in ("summed axes", "other axis", "whole"):
                known = name == "dot_general+sub" and partner == "other axis" and rank > 1
                marks = [pytest.mark.xfail(reason=DOT_SLICED_FIRST, strict=True)] if known else []
                out.append(pytest.param(name, rank, partner, marks=marks, id=f"{name}-{rank}-{partner}"))
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
