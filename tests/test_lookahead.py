"""The look-ahead of sharding propagation (``rules_indexing.consumer_split``) is precomputed once per value.

Where a dot's (or a reduction's) partial sum lands is found by searching its consumers; ahead of the walk
nothing is laid out, so in an unrolled decoder the search used to run through the rest of the program at every
dot.  Its course is now computed once per value (:mod:`einshard._src.analysis.program.lookahead`) and each
costing tests only the points that read a layout already bound.  The guards: every answer equals the walked
search's (``_walk_consumers``) on unrolled decoders under drawn layouts, requested output layouts, Auto and
Explicit meshes, with the segment memo recording; and the steps one search takes do not grow with depth
(counted, never timed).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_memo import BATCH, DOWN, MESH, UP, _specs, decoder
from test_segment_memo import _out_specs, _plain

from einshard._src.analysis.program import lookahead, rules_indexing, trace
from einshard._src.analysis.program.walker import Walker
from einshard._src.planner.combining import combined_report


def _program(layers: int, how: str, mesh: str) -> Any:
    fn, params, x = decoder(layers, how) if how != "plain" else _plain(layers)
    axes = MESH if mesh == "auto" else jax.make_mesh((4, 2), ("data", "model"))  # Explicit: make_mesh's default
    return trace(fn, params, x, mesh=axes)


def _cross_checked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, Any]]:
    """Every consumer_split answer, with the walked search's over plain copies of the walk's tables (their
    reads then leave no mark on the segment memo's recording): (answer, walked answer) per call."""
    answers: list[tuple[Any, Any]] = []
    fast = rules_indexing.consumer_split

    def both(w: Any, var: Any, out: Any, sums: frozenset[str]) -> Any:
        got = fast(w, var, out, sums)
        plain = SimpleNamespace(costs=w.costs, uses=dict(w.uses), requested=dict(w.requested), env=dict(w.env))
        answers.append((got, rules_indexing._walk_consumers(plain, var, out, sums)))
        return got

    monkeypatch.setattr(rules_indexing, "consumer_split", both)
    return answers


@settings(max_examples=20, deadline=None)
@given(
    layers=st.integers(1, 5),
    how=st.sampled_from(["remat", "plain", "jit", "scan"]),
    mesh=st.sampled_from(["auto", "explicit"]),
    layouts=st.lists(
        st.tuples(st.integers(0, len(UP) - 1), st.integers(0, len(DOWN) - 1), st.integers(0, len(BATCH) - 1)),
        min_size=1,
        max_size=3,
    ),
    grads_like_params=st.booleans(),
)
def test_the_precomputed_look_ahead_answers_as_the_walk(layers, how, mesh, layouts, grads_like_params):
    with pytest.MonkeyPatch.context() as mp:
        answers = _cross_checked(mp)
        t = _program(layers, how, mesh)
        for up, down, batch in layouts:
            out_specs = _out_specs(up, down) if grads_like_params else None
            combined_report(t, _specs(up, down, batch), out_specs)
            t.report(_specs(up, down, batch), out_specs)
    assert [a for a, _ in answers] == [b for _, b in answers]


# Layouts under which sums land split on a consumer (the row-parallel down projection's sum meets the residual,
# the weight gradients meet their FSDP splits): the checks that fire are exercised, not only the ones that pass.
_FIRING = [(1, 1, 1), (3, 3, 1), (2, 2, 2), (1, 3, 0)]


@pytest.mark.parametrize("how", ["plain", "remat"])
def test_sums_that_land_split_are_found_as_the_walk_finds_them(monkeypatch, how):
    answers = _cross_checked(monkeypatch)
    t = _program(3, how, "auto")
    for up, down, batch in _FIRING:
        combined_report(t, _specs(up, down, batch), _out_specs(up, down))
    assert [a for a, _ in answers] == [b for _, b in answers]
    assert any(a is not None for a, _ in answers)


def _steps(layers: int, how: str) -> tuple[int, int, int]:
    """(the most steps one search took, the searches walked the plain way, the longest precomputed reach)."""
    t = _program(layers, how, "auto")
    for up, down, batch in [(1, 1, 0), (0, 0, 1), (2, 2, 2), (1, 3, 1)]:
        combined_report(t, _specs(up, down, batch))
    counts = lookahead.counts_of(t.costs)
    reaches = [r for r in lookahead.reach_cache(t.costs).values() if r is not None]
    assert counts.searches > 0 and reaches
    return counts.most, counts.walked, max(len(r.steps) for r in reaches)


def test_the_steps_of_one_search_do_not_grow_with_depth():
    # The forward inlined (the backward in one call per layer, as llama's remat decoder): a dot's sum is followed
    # through the residual stream to the program's end, where nothing is laid out yet.
    # (At 4 layers a stretch the segment memo records still ends within a search's course: while it records,
    # the search takes the walk's steps up to its end, one more at that depth; from 8 layers on the count is flat.)
    most8, walked8, reach8 = _steps(8, "remat")
    most16, walked16, reach16 = _steps(16, "remat")
    assert reach16 > reach8  # the search's course grows with depth (the walk took every step of it each time)...
    assert most16 <= most8  # ...the steps taken per costing do not
    assert walked8 == walked16 == 0


def test_a_value_outside_the_walked_jaxprs_is_searched_the_plain_way():
    # A value no walked jaxpr makes (its position unknown): consumer_split walks its consumers as it always did.
    t = _program(1, "plain", "auto")
    t.report(_specs(1, 1, 1))
    jaxpr = jax.make_jaxpr(lambda a, b: jnp.transpose(a * 2.0) @ b)(jnp.ones((8, 4)), jnp.ones((8, 2))).jaxpr
    var = jaxpr.eqns[0].outvars[0]
    assert lookahead.home_of(t.costs, var) is None
    uses: dict[int, list[tuple[Any, int]]] = {}
    for e in jaxpr.eqns:
        for k, v in enumerate(e.invars):
            uses.setdefault(id(v), []).append((e, k))
    walker = Walker(t.costs)
    out = walker.relayout(var.aval, [("data",), ()])
    w = SimpleNamespace(
        costs=t.costs,
        uses=uses,
        requested={},
        env={jaxpr.invars[1]: walker.relayout(jaxpr.invars[1].aval, [("model",), ()])},
    )
    before = lookahead.counts_of(t.costs).walked
    # The transposed value's rows meet b's model-split rows in the dot: the sum lands split over model there.
    found = rules_indexing.consumer_split(w, var, out, frozenset({"model"}))
    assert found == rules_indexing._walk_consumers(w, var, out, frozenset({"model"})) == [("model",), ()]
    assert lookahead.counts_of(t.costs).walked == before + 1
