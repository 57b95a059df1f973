"""The analyzer's fast paths build exactly what the plain constructors build.

The speed work (issue 10) fills frozen records directly, writes a plan's text on first read and prices a
part's operand moves only when it can still win; the golden file (tests/test_analysis_golden.py) pins the
results, and these tests pin each shortcut against the slow way it replaces.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

import einshard
import einshard.testing as et
from einshard._src.analysis.cost import PROFILES, Collective, all_gather, get_profile, price
from einshard._src.analysis.einsum.search import _with_operand
from einshard._src.core.layout import Layout, MeshAxis
from einshard._src.core.moves import Move
from einshard._src.parsing import AxisItem, parse_einsum

MESH = (MeshAxis("data", 4), MeshAxis("model", 2))
LAY = Layout(("b", "x"), (64, 128), MESH, (("data",), ("model",)))


def test_a_priced_move_equals_the_constructed_collective():
    """price() fills the record directly (Collective._derive); the dataclass's own constructor, with the
    all-gather's ring formula written out (V = the gathered block, 64·64 one-byte elements), gives the same."""
    after = LAY.with_dims(((), ("model",)))
    got = price(
        Move("all-gather", ("data",), 4, LAY, after, "w", 0), itemsize=1, profile=PROFILES["h100"], tensor="operand 1"
    )
    want = Collective(
        "all-gather",
        ("data",),
        4,
        3072,
        4096,
        PROFILES["h100"].collective_time("all-gather", 4, 3072, 4096, (4,)),
        "operand 1",
        "w",
        LAY,
        after,
        dim=0,
    )
    assert got == want
    assert vars(got) == vars(want)  # the fields not compared (before, after) too, in the same order
    assert repr(got) == repr(want)


def test_the_operand_set_on_a_copy_equals_dataclasses_replace():
    _, c = all_gather(LAY, ("data",), itemsize=2, tensor="operand 1", why="gather 'b'")
    got = _with_operand(c, 0)
    want = dataclasses.replace(c, operand=0)
    assert got == want and vars(got) == vars(want)
    assert c.operand is None  # the original untouched


def test_a_plan_s_text_read_late_equals_the_text_from_its_fields():
    """The text is written on first read from the candidate the plan keeps; a plan built from the fields
    alone (no candidate) writes the same strategy, roles and tutorial view, and the same reason when no
    operand is summed locally first."""
    plan = einshard.analyze(
        "b@data x, x y@model -> b? y?", mesh={"data": 4, "model": 2}, sizes={"b": 64, "x": 128, "y": 256}
    )
    bare = dataclasses.replace(plan, candidate=None, more=None)
    for name in ("expression", "strategy", "roles", "tutorial_view", "why"):
        assert getattr(bare, name) == getattr(plan, name), name
    assert plan.strategy == "hybrid DP×TP"
    assert plan.expression == "b@data x, x y@model -> b@data y@model"
    assert repr(bare) == repr(plan) and "strategy='hybrid DP×TP'" in repr(plan)
    assert bare == plan  # equality reads the fields, as before


def test_a_side_keeps_its_axes_and_names():
    expr = parse_einsum("b x@data, x y -> b? y?")
    for side in expr.sides:
        assert side.axes == tuple(i for i in side.items if isinstance(i, AxisItem))
        assert side.names == tuple(i.name for i in side.axes)
    again = dataclasses.replace(expr.inputs[0], items=expr.inputs[0].items[:1])
    assert again.names == ("b",)


def test_a_profile_by_name_is_the_preset():
    assert get_profile("h100") is PROFILES["h100"]
    assert get_profile("H100") is PROFILES["h100"]
    assert get_profile(None) is PROFILES["cpu"]


# -- the parser's scanner (einshard/_grammar.py) against Lark ----------------------------------------------

PIECES = ["b", "x", "data", "y_z", "é", "ab", "2", "@", "@data", "@(data,model)", "@( data,model)", "@(d,m", "?",
          "*", "...", "{U:model}", "{l1}", ",", " , ", ",  ", "->", " -> ", "->", " ", "  ", "\n", "\t", "(", "-"]  # fmt: skip


def _columns(sides):
    return [(s.column, s.unreduced_column, s.unreduced, [(type(i).__name__, vars(i)) for i in s.items]) for s in sides]


def _lark_sides(text: str):
    from einshard._src._grammar import _Build, lark_parser

    stripped = text.strip()
    offset = len(text) - len(text.lstrip())
    return _Build(offset, stripped).transform(lark_parser().parse(stripped))


def _agrees(text: str) -> None:
    from einshard._src._grammar import _scan

    got = _scan(text, len(text) - len(text.lstrip()), len(text.rstrip()))
    if got is None:
        return  # left to Lark
    want = _lark_sides(text)  # the scanner never reads what Lark refuses
    assert _columns(got) == _columns(want), text


@given(st.lists(st.sampled_from(PIECES), min_size=1, max_size=12))
def test_the_scanner_reads_what_lark_reads(pieces):
    _agrees("".join(pieces))


ITEMS = st.tuples(
    st.sampled_from(["b", "x", "data", "y_z", "é"]), st.sampled_from(["", "", "?", "@data", "@(data,model)", "@d2"])
)


@given(
    st.lists(st.tuples(ITEMS, st.sampled_from([" ", "  ", ",", " , ", "->", " -> ", "\t"])), min_size=1, max_size=8),
    st.sampled_from(["", " ", "\n"]),
)
def test_the_scanner_reads_well_formed_expressions_as_lark(items, pad):
    """Mostly well-formed: the scanner reads many of these (two arrows, a comma after the arrow, '->' at the
    end are left to Lark)."""
    text = pad + "".join(name + suffix + sep for (name, suffix), sep in items[:-1]) + "".join(items[-1][0]) + pad
    _agrees(text)


@pytest.mark.parametrize(
    "text",
    [
        "b@data x, x y -> b@data y",
        "  b x@(data,model), x@(data,model) y -> b? y?  ",
        "b h@model q d, b h@model k d -> b h@model q k",
        "a b -> a@data b",
        "a\tb ,c  ->  a?",
        "b x@data, x y, y z@model -> b? z?",
        "éa x -> éa",
    ],
)
def test_the_scanner_reads_the_common_expressions_as_lark(text):
    from einshard._src._grammar import _scan

    assert _scan(text, len(text) - len(text.lstrip()), len(text.rstrip())) is not None
    _agrees(text)


@pytest.mark.parametrize(
    "text", ["a b -> a2 b", "a -> a*", "... x -> ... x", "b x, x y -> b y {U:m}", "x -> ", "a@( d,m) -> a", "a b"]
)
def test_what_the_scanner_leaves_lark_reads(text):
    from einshard._src._grammar import _scan

    assert _scan(text, len(text) - len(text.lstrip()), len(text.rstrip())) is None


def test_an_enumerated_candidate_equals_the_constructed_one():
    from einshard._src.analysis.einsum.model import Candidate, Problem
    from einshard._src.analysis.einsum.search import enumerate_candidates

    w = Layout(("x", "y"), (128, 256), MESH, (("data",), ("model",)))
    problem = Problem((LAY, w), ("b", "y"), (("b", 64), ("x", 128), ("y", 256)), MESH, None, 2, PROFILES["h100"])
    cands = enumerate_candidates(problem)
    assert len(cands) > 3
    for c in cands:
        built = Candidate(**{f.name: getattr(c, f.name) for f in dataclasses.fields(Candidate)})
        assert c == built and list(vars(c)) == list(vars(built)) and repr(c) == repr(built)


def _plan_and_full_ranking_first(case: Any, profile: str) -> tuple[Any, Any, Any, Any]:
    """analyze's plan for a drawn einsum, its Problem, the requested output layout (None when chosen), and the
    first of the full enumeration's ranking: the answer every shortcut must give."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            plan = einshard.analyze(case.expression, mesh=dict(case.mesh), sizes=dict(case.sizes), profile=profile)
    except einshard.EinshardError:
        assume(False)
    chosen = parse_einsum(case.expression).output_chosen or not case.output
    requested = None if chosen else plan.out_layout
    problem, ref = _problem_and_full_ranking_first(plan, dict(case.sizes), tuple(case.output), requested)
    return plan, problem, requested, ref


def _problem_and_full_ranking_first(plan: Any, sizes: dict, out_axes: tuple, requested: Any) -> tuple[Any, Any]:
    """The search Problem behind ``plan`` and the first of its full enumeration's ranking."""
    from einshard._src.analysis.einsum.model import Problem
    from einshard._src.analysis.einsum.search import enumerate_candidates, rank

    all_sizes = tuple((a, sizes[a]) for a in dict.fromkeys(a for op in plan.operands for a in op.axes))
    chosen = requested is None  # '?': the cheapest complete result, all-reduced or reduce-scattered
    problem = Problem(plan.operands, out_axes, all_sizes, plan.mesh, requested, plan.itemsize, plan.profile, chosen)
    ranked = rank(enumerate_candidates(problem))
    complete = ("complete", "reduce-scatter")
    return problem, next(c for c in ranked if c.resolution in complete) if chosen else ranked[0]


@given(
    et.einsums(
        st.sampled_from([{"x": 2}, {"x": 4, "y": 2}, {"x": 2, "y": 1}]),
        operands=(1, 3),
        max_rank=3,
        sizes=(64, 1024, 4096),
    ),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
)
def test_the_search_skips_parts_only_when_they_cannot_win(case, profile):
    """At sizes where compute dominates, parts are skipped unpriced (their compute time alone exceeds the
    best); the plan must still be the full ranking's first, as in tests/test_analysis_golden.py."""
    plan, problem, requested, ref = _plan_and_full_ranking_first(case, profile)
    assert (plan.choice, plan.collectives, plan.out_layout, plan.operands_used, plan.time) == (
        ref.choice,
        ref.steps,
        ref.out,
        ref.targets,
        ref.time,
    )


def test_a_built_plan_equals_the_constructed_one():
    from einshard._src.analysis.einsum.plan import EinsumPlan

    plan = einshard.analyze("b x@model, x@model y -> b? y?", mesh={"model": 4}, sizes={"b": 64, "x": 128, "y": 256})
    for p in (plan, *plan.alternatives):
        built = EinsumPlan(**{f.name: getattr(p, f.name) for f in dataclasses.fields(EinsumPlan)})
        fields = [f.name for f in dataclasses.fields(EinsumPlan)]
        assert built == p and [k for k in vars(p) if k in fields] == fields
        assert repr(built) == repr(p) and built.to_dict(alternatives=False) == p.to_dict(alternatives=False)


@given(
    et.einsums(
        st.sampled_from([{"x": 2}, {"x": 4, "y": 2}, {"x": 2, "y": 1}, {"x": 2, "y": 2, "z": 2}, {"x": 8}]),
        operands=(1, 3),
        max_rank=3,
        sizes=(8, 64, 4096, 16384),
    ),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
)
def test_the_operands_as_given_are_the_answer_only_when_nothing_beats_them(case, profile):
    """The first choice (the operands as given) is taken without a search only when no other can beat it
    (search._as_given); at any sizes the answer is the full ranking's first."""
    from einshard._src.analysis.einsum.model import classify
    from einshard._src.analysis.einsum.search import Enumeration as _Enumeration
    from einshard._src.analysis.einsum.search import _as_given

    plan, problem, requested, ref = _plan_and_full_ranking_first(case, profile)
    en = _Enumeration(problem, classify(tuple(op.axes for op in problem.operands), problem.out_axes))
    got, _, decided = _as_given(en, complete=requested is None)
    if decided:
        assert got is not None
        assert (got.choice, got.steps, got.out, got.targets, got.time) == (
            ref.choice,
            ref.steps,
            ref.out,
            ref.targets,
            ref.time,
        )


@pytest.mark.parametrize(
    ("expr", "mesh", "sizes", "decided"),
    [
        ("b@data x, x y -> b@data y", {"data": 8}, {"b": 1024, "x": 4096, "y": 4096}, True),  # nothing moves
        ("b x@model, x@model y -> b? y?", {"model": 8}, {"b": 1024, "x": 16384, "y": 4096}, True),  # AR < 7/8 compute
        ("b x@model, x@model y -> b? y?", {"model": 8}, {"b": 8, "x": 16, "y": 8}, False),  # latency-bound: search
        ("b@data x, x@data y -> b@data y", {"data": 8}, {"b": 1024, "x": 4096, "y": 4096}, False),  # 3 options
    ],
)
def test_the_operands_as_given_decide_the_common_cases(expr, mesh, sizes, decided):
    """Which einsums the first choice decides without a search (the speed of analyze rests on it), and that
    the answer is the full ranking's first either way."""
    from einshard._src.analysis.einsum.model import classify
    from einshard._src.analysis.einsum.search import Enumeration as _Enumeration
    from einshard._src.analysis.einsum.search import _as_given

    plan = einshard.analyze(expr, mesh=mesh, sizes=sizes, dtype="bf16", profile="h100")
    requested = None if parse_einsum(expr).output_chosen else plan.out_layout
    out_axes = plan.out_layout.axes
    problem, ref = _problem_and_full_ranking_first(plan, sizes, out_axes, requested)
    en = _Enumeration(problem, classify(tuple(op.axes for op in problem.operands), out_axes))
    got, _, was_decided = _as_given(en, complete=requested is None)
    assert was_decided is decided
    assert (plan.choice, plan.collectives, plan.time) == (ref.choice, ref.steps, ref.time)
    if decided:
        assert (got.choice, got.steps, got.time) == (ref.choice, ref.steps, ref.time)


@given(
    st.sampled_from(
        [
            ("b x@m, x@m y -> b? y?", ("m",)),
            ("b x@d, x y@m -> b? y?", ("d", "m")),
            ("b x@d, x y, y z@m -> b? z?", ("d", "m")),
            ("b@d s x@m, x@m y@f -> b@d s y", ("d", "f", "m")),
            ("b x@(d,m), x@(d,m) y -> b? y?", ("d", "m")),
        ]
    ),
    st.lists(st.sampled_from([1, 2, 4, 8]), min_size=3, max_size=3),
    st.lists(st.sampled_from([8, 64, 1024, 16384]), min_size=5, max_size=5),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
)
def test_a_contraction_kept_split_is_decided_as_the_full_ranking_decides(expr_axes, mesh_sizes, sizes, profile):
    """Einsums whose first choice keeps a contracted split (pending sums, then collectives): the first
    choice decides only when every other choice computes slower than it takes in all (search._as_given);
    at compute- or communication-bound sizes the plan is the full ranking's first."""
    from einshard._src.analysis.einsum.model import classify
    from einshard._src.analysis.einsum.search import Enumeration as _Enumeration
    from einshard._src.analysis.einsum.search import _as_given

    expr, axes = expr_axes
    mesh = dict(zip(axes, mesh_sizes, strict=False))
    names = sorted({n for n in parse_einsum(expr).inputs for n in n.names})
    size = dict(zip(names, sizes + [sizes[0]] * len(names), strict=False))
    try:
        plan = einshard.analyze(expr, mesh=mesh, sizes=size, dtype="bf16", profile=profile)
    except einshard.EinshardError:
        assume(False)
    requested = None if parse_einsum(expr).output_chosen else plan.out_layout
    out_axes = plan.out_layout.axes
    problem, ref = _problem_and_full_ranking_first(plan, size, out_axes, requested)
    assert (plan.choice, plan.collectives, plan.out_layout, plan.operands_used, plan.time) == (
        ref.choice,
        ref.steps,
        ref.out,
        ref.targets,
        ref.time,
    )
    en = _Enumeration(problem, classify(tuple(op.axes for op in problem.operands), out_axes))
    got, _, decided = _as_given(en, complete=requested is None)
    if decided:
        assert (got.choice, got.steps, got.time) == (ref.choice, ref.steps, ref.time)


def _plain_and_general(expr: str, mesh: dict, sizes: dict, dtype: Any = "bf16", profile: Any = "h100") -> tuple:
    """analyze's entry for the common call (layouts read once from the text) and its general path (every
    check of the arguments, layouts through read.side_layout): (plan or None, plan or error)."""
    from einshard._src.analysis.einsum import analyze as api
    from einshard._src.analysis.einsum.read import analysis_mesh

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        plain = api._analyze_plain(expr, mesh, sizes, dtype, profile)
        try:
            general: Any = api._analyze(
                expr, (), analysis_mesh(mesh, ()), tuple(sizes.items()) or None, dtype, profile, None, None
            )
        except einshard.EinshardError as e:
            general = e
    return plain, general


def _same_plan(a: Any, b: Any) -> None:
    assert a == b and repr(a) == repr(b)
    assert a.to_dict() == b.to_dict()  # the alternatives too, in order
    for x in (a, *a.alternatives):  # every layout the fast entry built is a valid one (Layout's own checks)
        for lay in (*x.operands, x.out_layout):
            assert Layout(lay.axes, lay.shape, lay.mesh, lay.dims, lay.unreduced) == lay


@given(
    et.einsums(
        st.sampled_from([{"x": 2}, {"x": 4, "y": 2}, {"x": 2, "y": 1}, {"x": 2, "y": 2, "z": 2}]),
        operands=(1, 3),
        max_rank=3,
        sizes=(2, 8, 64, 4096),
    ),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
    st.sampled_from([None, "bf16", "f32"]),
)
def test_the_common_call_reads_the_text_as_the_general_path(case, profile, dtype):
    """The common call (a dict mesh, sizes, layouts from the text) skips the general path's re-validation;
    its plan, alternatives and text equal the general path's, and where the general path refuses the einsum
    the fast entry answers nothing (None: the general path then raises its message)."""
    plain, general = _plain_and_general(case.expression, dict(case.mesh), dict(case.sizes), dtype, profile)
    if isinstance(general, Exception):
        assert plain is None
    else:
        assert plain is not None
        _same_plan(plain, general)


@pytest.mark.parametrize(
    ("expr", "mesh", "sizes"),
    [
        ("b x@data, x y -> b? y?", {"data": 3}, {"b": 8, "x": 16, "y": 8}),  # indivisible split
        ("b x@fsdp, x y -> b? y?", {"data": 4}, {"b": 8, "x": 16, "y": 8}),  # unknown mesh axis
        ("b x@data, x y@data -> b? y?", {"data": 4}, {"b": 8, "x": 16, "y": 8}),  # fine: two operands
        ("b x@(data,data), x y -> b? y?", {"data": 2}, {"b": 8, "x": 16, "y": 8}),  # one mesh axis twice
        ("b x@data {U:data}, x y -> b? y?", {"data": 2}, {"b": 8, "x": 16, "y": 8}),  # split and pending sum
        ("b x {U:fsdp}, x y -> b? y?", {"data": 2}, {"b": 8, "x": 16, "y": 8}),  # pending sum off the mesh
        ("b x@data, x y -> b y@data", {"data": 4}, {"b": 8, "x": 16, "y": 6}),  # requested split indivisible
        ("b x@data, x y -> b y", {"data": 4}, {"b": 8, "x": 16, "y": 8}),  # bare output (warns)
        ("b x@data, x y -> b? y?", {"data": 4}, {"b": 8, "x": 16}),  # a size missing
        ("b x@data, x y -> b? y?", {"data": 4}, {"b": 8, "x": 16, "y": 8, "z": 2}),  # a size too many
        ("b x@data, x y -> b? y?", {"data": 4}, {"b": -8, "x": 16, "y": 8}),  # a negative size
        ("b x@data, x y -> b? y?", {"data": 4}, {"b": True, "x": 16, "y": 8}),  # a bool size
        ("b x@data, x y -> b? y?", {"data": 4, "model": 1}, {"b": 8, "x": 16, "y": 8}),  # a mesh axis of 1
        ("b x@data, x y -> b? y?", {"data": 0}, {"b": 8, "x": 16, "y": 8}),  # an empty mesh axis
        ("bx,xy->by", {"data": 4}, {"b": 8, "x": 16, "y": 8}),  # a jnp.einsum string: chosen output
        ("b x, x y -> ", {"data": 4}, {"b": 8, "x": 16, "y": 8}),  # a scalar result
    ],
)
def test_the_common_call_falls_back_where_the_general_path_checks(expr, mesh, sizes):
    """Each argument the fast entry does not take as the common call takes it (or that fails a check) goes to
    the general path, which raises with its message; otherwise both give the same plan."""
    try:
        plain, general = _plain_and_general(expr, mesh, sizes)
    except einshard.EinshardError:  # the text itself refused (the parser checks it before either path)
        return
    if isinstance(general, Exception):
        assert plain is None
        with pytest.raises(einshard.EinshardError) as got:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                einshard.analyze(expr, mesh=mesh, sizes=sizes)
        assert str(got.value) == str(general)  # the general path's message, column and hint
    elif plain is not None:
        _same_plan(plain, general)


def test_the_common_call_warns_as_the_general_path_on_a_bare_output():
    mesh, sizes = {"data": 4}, {"b": 8, "x": 16, "y": 8}
    from einshard._src.analysis.einsum import analyze as api

    plan = api._analyze_plain("b@data x, x y -> b y", mesh, sizes, None, None)
    assert "bare output" in plan.__dict__["_bare_output_warning"]  # analyze() warns it (cached or not)
    for _ in range(2):  # the second call returns the cached plan, and warns again
        with pytest.warns(FutureWarning, match="bare output"):
            einshard.analyze("b@data x, x y -> b y", mesh=mesh, sizes=sizes)


def _moves_checked(problem: Any) -> int:
    """The enumeration fills each collective's operand in place (search.Enumeration.transition), which is
    sound only because ``transition`` records every collective afresh: its moves equal ``transition``'s
    records with the operand set by ``dataclasses.replace``, and no record is shared between two calls.
    Returns how many collectives were compared."""
    from einshard._src.analysis.cost import transition
    from einshard._src.analysis.einsum.model import classify
    from einshard._src.analysis.einsum.search import Enumeration as _Enumeration

    en = _Enumeration(problem, classify(tuple(op.axes for op in problem.operands), problem.out_axes))
    moves = 0
    for part in en.parts():
        for i, (src, dst) in enumerate(zip(part.operands, part.targets, strict=True)):
            got = en.transition(src, dst, i)
            if got is None:
                continue
            kw = {"itemsize": problem.itemsize, "profile": problem.profile, "tensor": f"operand {i + 1}"}
            fresh = transition(src, dst, **kw)[1]
            assert all(c.operand is None for c in fresh)
            want = tuple(dataclasses.replace(c, operand=i) for c in fresh)
            assert got == want and [vars(a) for a in got] == [vars(b) for b in want]
            again = transition(src, dst, **kw)[1]
            assert not {id(c) for c in again} & {id(c) for c in (*got, *fresh)}
            moves += len(got)
    return moves


@given(
    et.einsums(
        st.sampled_from([{"x": 2}, {"x": 4, "y": 2}, {"x": 2, "y": 1}]),
        operands=(1, 3),
        max_rank=3,
        sizes=(8, 64, 4096),
    ),
    st.sampled_from(["cpu", "h100"]),
)
def test_the_enumeration_s_moves_are_transition_s_with_their_operand(case, profile):
    _, problem, _, _ = _plan_and_full_ranking_first(case, profile)
    _moves_checked(problem)


def test_the_enumeration_s_moves_on_a_searched_einsum():
    """The same on an einsum whose search moves operands (gathers, all-to-alls, permutes)."""
    plan = einshard.analyze(
        "b x@(data,model), x@(data,model) y -> b? y?", mesh={"data": 4, "model": 2}, sizes={"b": 64, "x": 128, "y": 256}
    )
    problem, _ = _problem_and_full_ranking_first(plan, {"b": 64, "x": 128, "y": 256}, ("b", "y"), None)
    assert _moves_checked(problem) >= 4


@given(
    et.einsums(
        st.sampled_from([{"x": 2}, {"x": 4, "y": 2}, {"x": 2, "y": 2, "z": 2}, {"x": 8}]),
        operands=(1, 3),
        max_rank=3,
        sizes=(8, 64, 4096),
    ),
    st.sampled_from(["cpu", "h100", "tpu-v5p"]),
)
def test_a_result_completed_directly_equals_its_resolutions_through_transition(case, profile):
    """search._completed (pending sums completed by all_reduce, without transition's general checks) gives
    what _resolutions and transition give, for every part's computed result with pending sums."""
    from einshard._src.analysis.einsum.model import classify
    from einshard._src.analysis.einsum.search import Enumeration as _Enumeration
    from einshard._src.analysis.einsum.search import _completed, _resolutions, _split_all_reduces

    _, problem, requested, _ = _plan_and_full_ranking_first(case, profile)
    assume(requested is None)
    en = _Enumeration(problem, classify(tuple(op.axes for op in problem.operands), problem.out_axes))
    for part in en.parts():
        if not part.pending:
            continue
        computed = Layout(problem.out_axes, en.out_shape, problem.mesh, part.out_dims, part.pending)
        want = []
        # (_completed gives the all-reduced result; a chosen result's reduce-scatters come from transition)
        resolutions = _resolutions(problem, computed, en.mesh_sizes, complete=True)
        for resolution, target in [r for r in resolutions if r[0] == "complete"]:
            steps = en.transition(computed, target, "out")
            assert steps is not None
            want.append((resolution, target, steps))
            split = _split_all_reduces(steps, en)
            if split is not None:
                want.append((resolution, target, split))
        got = _completed(en, computed)
        assert got == want
        assert [[vars(c) for c in steps] for _, _, steps in got] == [[vars(c) for c in steps] for _, _, steps in want]


def test_a_result_completed_directly_on_a_two_axis_sum():
    """The same where the sums span two mesh axes (one all-reduce over both, and one per axis)."""
    from einshard._src.analysis.einsum.search import Enumeration as _Enumeration
    from einshard._src.analysis.einsum.search import _completed, _resolutions, _split_all_reduces

    plan = einshard.analyze(
        "b x@(data,model), x@(data,model) y -> b? y?", mesh={"data": 4, "model": 2}, sizes={"b": 8, "x": 128, "y": 256}
    )
    problem, _ = _problem_and_full_ranking_first(plan, {"b": 8, "x": 128, "y": 256}, ("b", "y"), None)
    en = _Enumeration(problem, plan.classes)
    computed = Layout(("b", "y"), (8, 256), problem.mesh, ((), ()), frozenset({"model", "data"}))
    ((resolution, target),) = [r for r in _resolutions(problem, computed, en.mesh_sizes, True) if r[0] == "complete"]
    steps = en.transition(computed, target, "out")
    got = _completed(en, computed)
    assert got == [(resolution, target, steps), (resolution, target, _split_all_reduces(steps, en))]
    assert got[0][2][0].axes == ("data", "model") and [c.axes for c in got[1][2]] == [("data",), ("model",)]
