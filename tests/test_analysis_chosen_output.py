"""A chosen result ('-> b? y?') is the cheapest complete one (issue 22, item 6).

A result with no pending sums is complete whether its sums were all-reduced in the layout the local einsums
left, or reduce-scattered onto an output axis. The analyzer chose among the first kind only, so the README's
example picked a 38.4 µs gather while a 22.7 µs reduce-scatter it listed was as complete (CLI: 85.3 vs 51.3).
"""

import functools
import warnings

import jax
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
import einshard.testing as et
from einshard._src.analysis.cost import PROFILES
from einshard._src.lowering.einsum import runs_exactly
from einshard.errors import EinshardWarning

MESHES = [{"x": 2}, {"x": 4}, {"x": 4, "y": 2}, {"x": 2, "y": 1}, {"x": 2, "y": 2, "z": 2}]


def _chosen(case: et.EinsumCase) -> str:
    """The case's einsum with every output axis chosen: 'a b@x, b c -> a? c?'."""
    return case.expression.split("->")[0] + "-> " + " ".join(f"{a}?" for a in case.output)


def test_the_readme_example_picks_the_cheapest_complete_result():
    mesh, sizes = {"data": 4, "model": 2}, {"b": 64, "x": 128, "y": 256}
    plan = einshard.analyze("b x@data, x y@model -> b? y?", mesh=mesh, sizes=sizes, dtype="f32", profile="cpu")
    assert plan.expression == "b x@data, x y@model -> b@data y@model"
    assert [c.kind for c in plan.collectives] == ["reduce-scatter"]
    # compute 5.24 µs + the reduce-scatter's: 3 ring steps of the cpu profile's latency (the ring count its
    # alternatives are ranked on: Profile.walking; 14 µs since session 19, 20 before) and 24.6 KB sent at 10 GB/s
    ring = PROFILES["cpu"].walking()
    assert np.isclose(plan.time, 5.24288e-6 + 3 * ring.latency + 24576 / ring.bandwidth)
    complete = [a for a in plan.alternatives if not a.out_layout.unreduced]
    gather = [a for a in complete if [c.kind for c in a.collectives] == ["all-gather"]]
    # what it used to pick: the same bytes and steps after 4x the compute (the operand gathered, 20.97 µs)
    assert [a.time for a in gather] == [pytest.approx(2.097152e-5 + 3 * ring.latency + 24576 / ring.bandwidth)]
    assert all(plan.time <= a.time for a in complete)


@settings(max_examples=40, deadline=None)
@given(
    et.einsums(st.sampled_from(MESHES), operands=(1, 3), max_rank=3, sizes=(4, 16, 64, 1024)),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
)
def test_a_chosen_result_costs_no_more_than_any_listed_complete_one(case, profile):
    assume(case.output)  # a scalar has no layout to choose
    plan = einshard.analyze(_chosen(case), mesh=dict(case.mesh), sizes=dict(case.sizes), profile=profile)
    assert not plan.out_layout.unreduced
    agreed = plan.candidate.unsplits_agreed
    for alt in plan.alternatives:
        if alt.out_layout.unreduced:
            continue  # pending sums: not a complete result
        if alt.candidate.unsplits_agreed and not agreed:
            continue  # gathers a split every operand agrees on: ranked last by design (analysis.search.rank)
        assert plan.time <= alt.time * (1 + 1e-12), (plan.expression, plan.time, alt.expression, alt.time)


@functools.cache
def _mesh(shape: tuple[int, ...], explicit: bool):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, ("x", "y")[: len(shape)], axis_types=(kind,) * len(shape))


@settings(max_examples=8, deadline=None)
@given(
    st.sampled_from([((8,), True), ((4, 2), True), ((4, 2), False), ((2, 4), True)]).flatmap(
        lambda m: et.einsums(_mesh(*m), operands=(1, 2), max_rank=3, sizes={"a": 8, "b": 16, "c": 8})
    ),
    st.sampled_from(["sync", "async"]),
)
def test_lower_runs_the_chosen_complete_result(case, mode):
    """The chosen plan (a reduce-scatter onto an output axis, where that is cheapest) runs: values equal the
    unsharded einsum, and the result is laid out as the plan that ran says."""
    assume(case.output)
    arrays = case.arrays(1)
    program = einshard.lower(_chosen(case), *arrays, mesh=case.mesh, mode=mode)
    best = einshard.analyze(_chosen(case), *arrays, mesh=case.mesh)
    if runs_exactly(best):
        assert program.plan.out_layout == best.out_layout
    y = program(*arrays)
    assert not program.plan.out_layout.unreduced
    want_sharding = NamedSharding(case.mesh, P(*program.plan.out_layout.spec_entries()))
    assert y.sharding.is_equivalent_to(want_sharding, y.ndim)
    want = np.einsum(case.subscripts, *[np.asarray(x, np.float64) for x in arrays])
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


def test_analyze_says_when_the_written_layout_is_not_the_operands_own():
    """The README placed x 'b@data x' and analysed 'b x@data': the annotation is analysed (it is what the user
    asks for, and what einshard.einsum lays the operand out as), and analyze says so, on every call."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    w = einshard.einshard(np.ones((128, 256), np.float32), "x y -> x y@model", mesh=mesh)
    x = einshard.einshard(np.ones((64, 128), np.float32), "b x -> b@data x", mesh=mesh)
    for _ in range(2):  # the second call is answered from the cache, and says it again
        with pytest.warns(EinshardWarning, match=r"operand 1 is laid out b@data x .*writes b x@data.*as written"):
            plan = einshard.analyze("b x@data, x y@model -> b? y?", x, w, mesh=mesh)
        assert plan.operands[0].dims == ((), ("data",))
    placed = einshard.einshard(np.ones((64, 128), np.float32), "b x -> b x@data", mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # annotations that agree with the arrays: nothing to say
        einshard.analyze("b x@data, x y@model -> b? y?", placed, w, mesh=mesh)
        einshard.analyze("b x, x y -> b? y?", x, w, mesh=mesh)  # no annotations: the arrays' own layouts
