"""``einshard.analyze`` returns the same plans as before its fast path: golden values recorded from the
analyzer before the speed work (commit 00e1234), compared field by field (strategy, roles, collectives with
their bytes, times and reasons, FLOPs, the reason line and every alternative in order).

Regenerate (only when a change of results is intended, and say so in the commit):

    PYTHONPATH=. python tests/test_analysis_golden.py --write
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import sys
import warnings

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from test_core_moves import layout_pairs  # the layout pairs the moves' own tests draw

import einshard
import einshard.testing as et
from einshard._src.analysis.einsum.model import Problem
from einshard._src.analysis.einsum.search import enumerate_candidates, rank
from einshard._src.parsing import parse_einsum

GOLDEN = pathlib.Path(__file__).parent / "golden" / "analysis_plans.json"

DM = {"data": 4, "model": 2}

# (expression, mesh, sizes, extra keyword arguments): the benchmark's einsums and the analyzer's corner cases.
CASES: list[tuple[str, dict[str, int], dict[str, int], dict]] = [
    ("b@data x, x y -> b@data y", {"data": 8}, {"b": 1024, "x": 4096, "y": 4096}, {}),
    ("b x, x y@model -> b y@model", {"model": 8}, {"b": 1024, "x": 4096, "y": 16384}, {}),
    ("b x@model, x@model y -> b? y?", {"model": 8}, {"b": 1024, "x": 16384, "y": 4096}, {}),
    ("b@data x, x y@model -> b@data y@model", DM, {"b": 1024, "x": 4096, "y": 16384}, {}),
    ("b@data x, x@data y -> b@data y", {"data": 8}, {"b": 1024, "x": 4096, "y": 4096}, {}),
    ("b x@data, x y@model -> b? y?", DM, {"b": 1024, "x": 4096, "y": 16384}, {}),
    ("b h@model q d, b h@model k d -> b h@model q k", DM, {"b": 8, "h": 16, "q": 512, "k": 512, "d": 64}, {}),
    ("b x@(data,model), x@(data,model) y -> b? y?", DM, {"b": 1024, "x": 4096, "y": 4096}, {}),
    ("b x@data, x y, y z@model -> b? z?", DM, {"b": 512, "x": 1024, "y": 1024, "z": 1024}, {}),
    (
        "b@data s d@model, d@model f@fsdp -> b@data s f",
        {"data": 64, "fsdp": 4, "model": 8},
        {"b": 2048, "s": 4096, "d": 8192, "f": 28672},
        {},
    ),
    ("b x@(data,model), x@(data,model) y -> b y", DM, {"b": 8, "x": 128, "y": 256}, {}),
    ("b x z@model, x y -> b y", DM, {"b": 64, "x": 128, "y": 256, "z": 16}, {}),
    ("b x z@model, x y -> b y@model", DM, {"b": 8, "x": 128, "y": 256, "z": 4}, {}),
    ("b x z@model, x y -> b? y?", DM, {"b": 64, "x": 128, "y": 256, "z": 16}, {}),
    ("b x@model, x@data y -> b? y?", DM, {"b": 64, "x": 128, "y": 256}, {}),
    ("b@data x, x y@model -> b? y?", DM, {"b": 64, "x": 128, "y": 256}, {}),
    ("b@data d, b@data f -> d? f?", {"data": 8}, {"b": 16, "d": 128, "f": 128}, {}),
    ("b@(data,model) d, b@(data,model) f -> d f", DM, {"b": 8, "d": 128, "f": 128}, {}),
    ("b x@model, x@model y -> b y {U:model}", {"model": 4}, {"b": 64, "x": 128, "y": 256}, {}),
    ("b x {U:model}, x y -> b? y?", DM, {"b": 64, "x": 128, "y": 256}, {}),
    ("b x {U:model}, x y@model -> b? y?", DM, {"b": 64, "x": 128, "y": 256}, {}),
    ("b x@model, x@model y -> b y@model", {"model": 4}, {"b": 64, "x": 128, "y": 256}, {}),
    ("a@x b, b c@x -> a? c?", {"x": 4, "y": 1}, {"a": 16, "b": 32, "c": 64}, {}),
    ("a b@(x,y), b@(y,x) c -> a? c?", {"x": 2, "y": 4}, {"a": 16, "b": 32, "c": 64}, {}),
    ("a b@x, b c -> a c@x", {"x": 4}, {"a": 16, "b": 32, "c": 64}, {}),
    ("i j@x k, j k l@y -> i? l?", {"x": 2, "y": 2}, {"i": 8, "j": 8, "k": 4, "l": 8}, {}),
    ("b i j@x, b j k -> b i k", {"x": 4}, {"b": 2, "i": 8, "j": 16, "k": 8}, {}),
    ("bx,xy->by", DM, {"b": 64, "x": 128, "y": 256}, {"in_specs": (P("data", None), P(None, "model"))}),
    ("bx,xy->by", DM, {"b": 64, "x": 128, "y": 256}, {"in_specs": (P(None, "data"), P("data", None))}),
    (
        "b x, x y -> b y",
        DM,
        {"b": 64, "x": 128, "y": 256},
        {"in_specs": (P(None, "model"), P("model", None)), "out_spec": P("data", "model")},
    ),
    ("b x@data, x y -> b y", DM, {"b": 64, "x": 128, "y": 256}, {"dtype": "f32", "profile": "tpu-v5p"}),
    ("b x@data, x y@model, y z -> b? z?", DM, {"b": 64, "x": 32, "y": 32, "z": 16}, {"profile": "cpu"}),
    ("x@data, x -> ", DM, {"x": 64}, {}),
]


def _record(expr: str, mesh: dict[str, int], sizes: dict[str, int], kw: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = einshard.analyze(expr, mesh=mesh, sizes=sizes, dtype=kw.get("dtype", "bf16"), **_rest(kw))
    d = plan.to_dict()
    d["choice"] = [list(c) for c in plan.choice]
    d["options"] = [p.expression for p in plan.options]
    d["warned"] = sorted({type(w.message).__name__ for w in caught})
    for alt in d["alternatives"]:  # an alternative's steps are pinned by kind, axes, bytes and reason
        for c in alt["collectives"]:
            del c["before"], c["after"]
    return _sorted_sets(json.loads(json.dumps(d)))


def _sorted_sets(d):
    """``unreduced={'model', 'data'}`` printed in one order (a set's order follows the hash seed)."""
    if isinstance(d, dict):
        return {k: _sorted_sets(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_sorted_sets(v) for v in d]
    if isinstance(d, str) and "unreduced={" in d:
        # jax 0.12 prints the default kind of a pending sum ("unreduced_kind=sum"); jax 0.10 does not.
        d = d.replace(", unreduced_kind=sum", "")
        return re.sub(r"\{([^{}]*)\}", lambda m: "{" + ", ".join(sorted(m.group(1).split(", "))) + "}", d)
    return d


def _rest(kw: dict) -> dict:
    out = {k: v for k, v in kw.items() if k != "dtype"}
    out.setdefault("profile", "h100")
    return out


def _key(expr: str, mesh: dict[str, int], sizes: dict[str, int], kw: dict) -> str:
    return json.dumps([expr, mesh, sizes, {k: str(v) for k, v in kw.items()}])


def _close(got, want, path="") -> None:
    """Equal, floats to 1e-12 relative (sums may associate differently)."""
    if isinstance(want, float) or isinstance(got, float):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-18), f"{path}: {got} != {want}"
    elif isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{path}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _close(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _close(g, w, f"{path}[{i}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plans_equal_the_recorded_ones(case):
    golden = json.loads(GOLDEN.read_text())
    _close(_record(*case), golden[_key(*case)])


def test_a_cached_plan_equals_a_fresh_one():
    for case in CASES[:12]:
        first = _record(*case)
        again = _record(*case)
        einshard.clear_caches()
        fresh = _record(*case)
        assert first == again == fresh


MESHES = [{"x": 2}, {"x": 4}, {"x": 4, "y": 2}, {"x": 2, "y": 1}, {"x": 2, "y": 2, "z": 2}]


@given(
    et.einsums(st.sampled_from(MESHES), operands=(1, 3), max_rank=3, sizes=(4, 8, 16)),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
)
def test_the_pruned_search_finds_the_full_ranking_s_best(case, profile):
    """analyze prices the result's delivery only for operand moves that can still win; its plan (and,
    when read, its alternatives) must be exactly the reference: every candidate enumerated and ranked."""
    try:
        with warnings.catch_warnings():  # a bare output's FutureWarning (its own tests are elsewhere)
            warnings.simplefilter("ignore", FutureWarning)
            plan = einshard.analyze(case.expression, mesh=dict(case.mesh), sizes=dict(case.sizes), profile=profile)
    except einshard.EinshardError:
        assume(False)  # a requested result no candidate can deliver (its error is tested elsewhere)
    chosen = parse_einsum(case.expression).output_chosen or not case.output  # a scalar is whole either way
    requested = None if chosen else plan.out_layout
    sizes = tuple((a, case.sizes[a]) for a in dict.fromkeys(a for op in case.operands for a in op))
    problem = Problem(
        plan.operands, tuple(case.output), sizes, plan.mesh, requested, plan.itemsize, plan.profile, requested is None
    )
    ranked = rank(enumerate_candidates(problem))
    # A chosen result ('?'): the cheapest complete one, all-reduced or reduce-scattered onto an output axis.
    complete = ("complete", "reduce-scatter")
    ref = next(c for c in ranked if c.resolution in complete) if requested is None else ranked[0]
    assert (plan.choice, plan.collectives, plan.out_layout, plan.operands_used, plan.resolution) == (
        ref.choice,
        ref.steps,
        ref.out,
        ref.targets,
        ref.resolution,
    )
    assert (plan.time, plan.flops) == (ref.time, ref.flops)
    rest = [c for c in ranked if c is not ref]
    assert [(a.choice, a.collectives, a.out_layout, a.time) for a in plan.alternatives] == [
        (c.choice, c.steps, c.out, c.time) for c in rest
    ]


@given(layout_pairs())
def test_transition_s_collectives_run_as_the_lowering_runs_them(pair):
    """Each collective transition records takes its ``before`` layout to its ``after`` when run as the
    lowering runs it (its Steps through :func:`einshard._src.core.moves.apply_to_layout`, written separately from
    the moves), the collectives chain (free slices between them), and the last leaves ``dst`` (mesh axes of
    size 1 aside).  (Before issue 23 this compared transition's quick paths with its general steps; the
    quick paths are the path now, and this holds them against the lowering's reading of the same record.)"""
    import dataclasses

    from einshard._src.core.moves import apply_to_layout, drop_trivial
    from einshard.analysis import transition

    src, dst = pair
    try:
        got, steps = transition(src, dst, itemsize=2, tensor="t")
    except einshard.EinshardError:
        # the one refusal: a complete value does not become a pending sum (64 splits over every drawn group)
        assert dst.unreduced - src.unreduced
        return
    assert drop_trivial(got) == drop_trivial(dst)
    cur = drop_trivial(src)
    for c in steps:
        assert c.group_size > 1 and c.before is not None and c.after is not None
        before, after = drop_trivial(c.before), drop_trivial(c.after)
        if c.kind == "all-gather" and c.why.startswith("re-split") and before.dims == after.dims:
            # regroup's second move (core.moves.regroup, p % q == 0): the permute leaves f copies of each new
            # block, which a Layout cannot write (its ``before`` is the new split already); the gather over the
            # old mesh axes joins the copies and leaves the layout as it is.
            cur = after
            continue
        assert all(b[: len(a)] == a for a, b in zip(cur.dims, before.dims, strict=True)), (cur, before)
        if c.kind != "collective-permute" and c.group_size != math.prod(before.mesh_sizes[m] for m in c.axes):
            # a gather or all-to-all over part of its mesh axes' devices (XLA's by tile counts: core.moves'
            # _coarsened, _swapped_counts): no named step runs it, and the lowering runs an alternative
            # (lowering.einsum._runs); its layouts hold the blocks XLA's run leaves: a gather's grown by its group
            grow = c.group_size if c.kind == "all-gather" else 1
            assert after.bytes_per_device(1) == before.bytes_per_device(1) * grow, (c, before, after)
            cur = after
            continue
        lay = before
        for step in dataclasses.replace(c, operand=0).steps:
            lay = apply_to_layout(lay, step)
        assert (lay.dims, lay.unreduced) == (after.dims, after.unreduced), (c, lay)
        cur = after


if __name__ == "__main__" and "--write" in sys.argv:
    GOLDEN.write_text(
        "{\n"
        + ",\n".join(f"{json.dumps(_key(*c))}: {json.dumps(_record(*c), ensure_ascii=False)}" for c in CASES)
        + "\n}"
        + "\n"
    )
    print(f"wrote {GOLDEN} ({len(CASES)} einsums)")
