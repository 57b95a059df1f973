"""The parsed Expression travels (issue 23, "expr"): parsed once at the public entry, never printed and re-parsed.

Checked against the parser itself (a placement built from parsed items equals, column for column, the parse of its
printed form), against the old behaviour (error messages quoted literally), and by counting parses per call.
"""

from __future__ import annotations

import ast
import pathlib
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
import einshard._src.placement as placement_module
from einshard._src._placement.resolve import _replicated, resolve_layout
from einshard._src.core.layout import Layout, MeshAxis, spec_dims
from einshard._src.parsing import (
    AxisItem,
    EllipsisItem,
    Expression,
    ReplicaItem,
    build_placement,
    parse_einsum,
    parse_placement,
)
from einshard.errors import EinshardError
from einshard.lowering import einsum_layouts

ROOT = pathlib.Path(__file__).resolve().parent.parent
MESH = jax.make_mesh((4, 2), ("data", "model"))


def _columns(expr: Expression) -> list[tuple[int, int, list[tuple[str, int]]]]:
    return [(s.column, s.unreduced_column, [(str(i), i.column) for i in s.items]) for s in expr.sides]


# ---------------------------------------------------------------------------
# build_placement: a placement made of parsed items is what parsing its printed form gives


_NAMES = st.sampled_from(["a", "b", "d", "batch", "x1", "k_v"])
_MESH_AXES = st.sampled_from([None, ("data",), ("model",), ("data", "model")])


@st.composite
def _placements(draw: st.DrawFn) -> tuple[list[AxisItem | EllipsisItem], list[AxisItem | ReplicaItem | EllipsisItem]]:
    names = draw(st.lists(_NAMES, unique=True, max_size=4))
    ellipsis = draw(st.booleans())
    counts = draw(st.booleans())
    left: list[AxisItem | EllipsisItem] = [AxisItem(n) for n in names]
    right: list[AxisItem | ReplicaItem | EllipsisItem] = []
    used: set[str] = set()
    for n in names:
        if counts:
            right.append(AxisItem(n, count=draw(st.sampled_from([None, 2, 4])), star=draw(st.booleans())))
        else:
            axes = draw(_MESH_AXES)
            if axes and used & set(axes):
                axes = None  # a mesh axis splits one array axis
            used |= set(axes or ())
            right.append(AxisItem(n, mesh_axes=axes))
    if ellipsis:
        at = draw(st.integers(0, len(names)))
        left.insert(at, EllipsisItem())
        right.insert(at, EllipsisItem())
    if counts and draw(st.booleans()):
        right.insert(draw(st.integers(0, len(right))), ReplicaItem(count=draw(st.sampled_from([None, 2])), star=True))
    return left, right


@given(_placements())
def test_a_built_placement_is_the_parse_of_its_text(items) -> None:
    left, right = items
    built = build_placement(left, right)
    parsed = parse_placement(built.text)
    assert built == parsed
    assert built.text == str(parsed)
    assert _columns(built) == _columns(parsed)


@pytest.mark.parametrize(
    ("left", "right"),
    [
        (["a", "b"], ["b", "a@data"]),  # with '@', the left side's order
        (["a"], ["a?"]),  # '?' is for einsum outputs
        (["a", "b"], ["a"]),  # an axis missing on the right
    ],
)
def test_a_built_placement_fails_as_its_parse_fails(left: list[str], right: list[str]) -> None:
    right_items = [parse_einsum(f"{' '.join(left)} -> {r}").output.items[0] for r in right]
    with pytest.raises(EinshardError) as built:
        build_placement([AxisItem(n) for n in left], right_items)
    with pytest.raises(EinshardError) as parsed:
        parse_placement(f"{' '.join(left)} -> {' '.join(right)}")
    assert str(built.value) == str(parsed.value)


def test_the_replication_of_a_bare_placement_is_built_not_reparsed() -> None:
    for text in ("a b -> a b", "  a   b->a b", "... d -> ... d", "->"):
        expr = parse_placement(text)
        built = _replicated(expr)
        want = parse_placement(str(expr).replace("->", "-> *", 1))
        # (The parsed text of '-> *' kept the trailing space of ' -> ' ; messages strip it, see below.)
        assert built == want and built.text == want.text.rstrip() and _columns(built) == _columns(want)


def test_a_rank_error_without_a_mesh_quotes_as_before() -> None:
    # The message einshard gave before the expression travelled (recorded on main, b7370dc).
    with pytest.raises(EinshardError) as err:
        einshard.layout("  a b -> a b", (2, 3, 4))
    assert str(err.value) == (
        "the left side names 2 axes but the array has rank 3\n    a b -> * a b\n    ^\n"
        "Name every axis, or use '...' for the ones you do not shard: 'b ... -> b@data ...'."
    )
    with pytest.raises(EinshardError) as err:
        einshard.layout("->", (3,))
    assert str(err.value) == (
        "the left side names 0 axes but the array has rank 1\n     -> *\n     ^\n"
        "Name every axis, or use '...' for the ones you do not shard: 'b ... -> b@data ...'."
    )


# ---------------------------------------------------------------------------
# einsum_layouts: each side's placement built from the parsed einsum; its errors as before


@pytest.mark.parametrize(
    ("expr", "shapes", "message"),
    [
        (
            "b x@modl, x y -> b y",
            [(4, 6), (6, 8)],
            "mesh axis 'modl' is not an axis of the mesh ('data': 4, 'model': 2)\n    b x -> b x@modl\n"
            "             ^\nDid you mean 'model'? The mesh axes are: 'data', 'model'.",
        ),
        (
            "b x@data, x y -> b y",
            [(4, 6), (6, 8)],
            "axis 'x' has size 6, which does not split over @data(4) into 4 equal shards\n    b x -> b x@data\n"
            "             ^\nPad the axis to 8 (a multiple of 4), or shard it fewer ways.",
        ),
        (
            "b x, x y -> b? y?",
            [(4, 6), (6, 8)],
            "'b?' (let the analyzer choose the layout) belongs on an einsum's output side, not in a placement\n"
            "    b y -> b? y?\n           ^\nWrite 'b' for a whole (replicated) axis or 'b@mesh_axis' to split it.",
        ),
        (
            "b x, x y -> b y",
            [(4, 6, 1), (6, 8)],
            "the left side names 2 axes but the array has rank 3\n    b x -> b x\n    ^\n"
            "Name every axis, or use '...' for the ones you do not shard: 'b ... -> b@data ...'.",
        ),
    ],
)
def test_einsum_layouts_errors_are_unchanged(expr: str, shapes: list[tuple[int, ...]], message: str) -> None:
    with pytest.raises(EinshardError) as err:
        einsum_layouts(expr, shapes, MESH)
    assert str(err.value) == message


def test_einsum_layouts_of_a_scalar_operand() -> None:
    ins, out = einsum_layouts(", a -> a", [(), (4,)], MESH)
    assert [str(x) for x in ins] == ["[]", "[a:4]"] and str(out) == "[a:4]"


def test_einsum_layouts_match_the_placements_they_write() -> None:
    (x, w), out = einsum_layouts("b x@model, x@model y@data -> b y@data {U:model}", [(4, 6), (6, 8)], MESH)
    assert x == einshard.layout("b x -> b x@model", (4, 6), mesh=MESH)
    assert w == einshard.layout("x y -> x@model y@data", (6, 8), mesh=MESH)
    assert out.dims == ((), ("data",)) and out.unreduced == frozenset({"model"})


# ---------------------------------------------------------------------------
# The Expression as a cache key


def test_equal_expressions_hash_alike_and_pickle_anew() -> None:
    a, b = parse_placement("a  b->a@data b"), parse_placement("a b -> a@data b")
    assert a is not b and a == b and hash(a) == hash(b)
    again = pickle.loads(pickle.dumps(a))
    assert again == a and hash(again) == hash(a) and again.text == a.text
    assert {a: 1}[b] == 1


def test_the_layout_cache_is_keyed_on_the_parsed_expression() -> None:
    einshard.clear_caches()
    einshard.layout("a b -> a@data b", (8, 2), mesh=MESH)
    hits = resolve_layout.cache_info().hits
    # Another spelling of the same expression: the same key, so the cache answers.
    einshard.layout("a  b->a@data  b", (8, 2), mesh=MESH)
    assert resolve_layout.cache_info().hits == hits + 1


def _count_parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = placement_module.parse_placement

    def counting(text: str) -> Expression:
        calls.append(text)
        return real(text)

    monkeypatch.setattr(placement_module, "parse_placement", counting)
    return calls


@pytest.mark.parametrize("where", ["host", "jax.Array", "jit", "process_local", "tree", "set_mesh"])
def test_each_placement_parses_its_expression_once(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    einshard.clear_caches()
    calls = _count_parses(monkeypatch)
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    expr = "a b -> a@data b@model"
    if where == "host":
        y = einshard.einshard(x, expr, mesh=MESH)
    elif where == "jax.Array":
        y = einshard.einshard(jax.device_put(x), expr, mesh=MESH)
    elif where == "jit":
        with jax.set_mesh(MESH):
            y = jax.jit(lambda v: einshard.einshard(v, expr))(x)
    elif where == "process_local":
        y = einshard.einshard(x, expr, mesh=MESH, process_local=True)
    elif where == "tree":
        y = einshard.einshard({"w": x, "b": x[0]}, {"w": expr, "b": "a -> a"}, mesh=MESH)["w"]
    else:
        with jax.set_mesh(MESH):
            y = einshard.einshard(x, expr)
    leaves = 2 if where == "tree" else 1
    assert len(calls) == leaves, calls
    np.testing.assert_array_equal(np.asarray(y), x)
    assert y.sharding.spec == P("data", "model")
    if where in ("host", "jax.Array", "tree"):
        # Eager placement's hot path (per array, per step) is one cache keyed on the text: no parse at all.
        if where == "tree":
            einshard.einshard({"w": x, "b": x[0]}, {"w": expr, "b": "a -> a"}, mesh=MESH)
        else:
            einshard.einshard(x, expr, mesh=MESH)
        assert len(calls) == leaves, calls


def test_placement_modules_do_not_parse() -> None:
    # Below the public entry the parsed Expression is passed down: no module of _placement/ parses text.
    modules = sorted((ROOT / "einshard" / "_src" / "_placement").glob("*.py"))
    assert len(modules) > 3
    for path in modules:
        if path.name == "describe.py":
            continue  # describe() writes an expression from a sharding and parses what it wrote (its own entry)
        tree = ast.parse(path.read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & {"parse", "parse_placement", "parse_einsum"}, path.name


# ---------------------------------------------------------------------------
# One current_mesh


def test_one_current_mesh() -> None:
    defined = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "einshard").rglob("*.py")
        if "def current_mesh(" in p.read_text()
    ]
    assert defined == ["einshard/_src/core/mesh.py"]
    assert not hasattr(einshard.placement, "current_mesh")


def test_placement_reads_the_concrete_current_mesh() -> None:
    x = np.ones((8, 4), np.float32)
    with jax.set_mesh(MESH):
        assert einshard.einshard(x, "a b -> a@data b").sharding == NamedSharding(MESH, P("data", None))
        # Under jit only the abstract mesh is current: the constraint is on it, the value comes back on MESH.
        y = jax.jit(lambda v: einshard.einshard(v * 2, "a b -> a b@model"))(x)
    assert y.sharding.spec == P(None, "model")
    np.testing.assert_array_equal(np.asarray(y), 2 * x)


# ---------------------------------------------------------------------------
# spec_dims: the one spec -> dims reading


def _by_hand(spec: P, rank: int) -> tuple[tuple[str, ...], ...]:
    # The idiom spec_dims replaced (written in ~11 places before).
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


_ENTRIES = st.sampled_from([None, "data", "model", ("data",), ("data", "model"), ("model", "data"), ()])


@given(st.lists(_ENTRIES, max_size=4), st.integers(0, 3))
def test_spec_dims_reads_a_spec_as_the_hand_written_idiom(entries: list, extra: int) -> None:
    used = [m for e in entries if e is not None for m in ((e,) if isinstance(e, str) else e)]
    assume(len(used) == len(set(used)))  # a mesh axis splits one array axis
    spec = P(*entries)
    rank = len(entries) + extra
    assert spec_dims(spec, rank) == _by_hand(spec, rank)
    assert spec_dims(spec) == _by_hand(spec, len(entries))


def test_layout_from_spec_reads_through_spec_dims() -> None:
    mesh = (MeshAxis("data", 4), MeshAxis("model", 2))
    lay = Layout.from_spec(P(("data", "model")), (8, 3), mesh)
    assert lay.dims == (("data", "model"), ())
    with pytest.raises(EinshardError, match=r"gives .* \(2 entries\) to an array of shape \(8,\) \(rank 1\)"):
        Layout.from_spec(P("data", "model"), (8,), mesh)


def test_describe_reads_specs_through_spec_dims() -> None:
    y = jnp.ones((8, 16))
    assert einshard.describe(jax.device_put(y, NamedSharding(MESH, P(None, ("model", "data"))))) == (
        "a b -> a b@(model,data)"
    )
    assert einshard.describe(jax.device_put(y, NamedSharding(MESH, P("data")))) == "a b -> a@data b"


def test_an_anonymous_mesh_refuses_float_sizes_after_the_int_one_exists() -> None:
    n = jax.device_count()
    assert einshard.placement.anonymous_mesh((2, n // 2)).shape == {"a0": 2, "a1": n // 2}
    with pytest.raises(EinshardError, match="shape= takes a tuple of positive integers"):
        einshard.placement.anonymous_mesh((2.0, n // 2))
