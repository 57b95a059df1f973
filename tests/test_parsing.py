"""Parsing: generated valid expressions round-trip, arbitrary text fails cleanly, every error points where it should.

Strategies build expressions from the grammar's pieces (names, counts, stars,
'...', '@' mesh axes, '{U:...}') as item lists, so the same items can be
joined with different whitespace and the parsed objects compared.
"""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard
from einshard import EinshardError
from einshard._src.parsing import (
    AxisItem,
    EllipsisItem,
    ReplicaItem,
    Side,
    format_name,
    parse,
    parse_einsum,
    parse_placement,
)

# Parsing is cheap (about a millisecond an example): these properties afford more examples than the profile's default.
MANY = settings(max_examples=int(os.environ.get("EINSHARD_PARSING_EXAMPLES", "200")))

# ---------------------------------------------------------------------------
# Strategies for valid expressions

# Letters from several scripts: einshard 0.2 accepts any Unicode letter in a name.
LETTERS = "abcxyzABUXYZ_αβγδéßжшд中文ñ"
plain_names = st.text(alphabet=LETTERS, min_size=1, max_size=4)
# Names with digits must be written in braces: {layer1}.
braced_names = st.builds(
    lambda head, digits, tail: head + digits + tail,
    st.text(alphabet=LETTERS, min_size=1, max_size=3),
    st.text(alphabet="0123456789", min_size=1, max_size=2),
    st.text(alphabet=LETTERS + "0123456789", max_size=2),
)
axis_names = st.one_of(plain_names, braced_names)
mesh_names = st.builds(
    lambda head, tail: head + tail,
    st.text(alphabet="dmxyzUαé_", min_size=1, max_size=3),
    st.text(alphabet="dmxyz0123456789_", max_size=3),
)
counts = st.integers(min_value=1, max_value=64)

# Whitespace between items (one or more), and around '->' and ',' (zero or more).
gaps = st.text(alphabet=" \t\n", min_size=1, max_size=3)
pads = st.text(alphabet=" \t\n", max_size=3)


def _join(draw, sides_text: list[list[str]], spaced: bool) -> str:
    """Join item texts into an expression; `spaced=False` uses canonical single spaces."""

    def gap() -> str:
        return draw(gaps) if spaced else " "

    def pad() -> str:
        return draw(pads) if spaced else " "

    def side(items: list[str]) -> str:
        out = ""
        for i, item in enumerate(items):
            out += (gap() if i else "") + item
        return out

    inputs = [side(s) for s in sides_text[:-1]]
    text = ""
    for i, s in enumerate(inputs):
        text += (pad() + "," + pad() if i else "") + s
    text += pad() + "->" + pad() + side(sides_text[-1])
    return (draw(pads) if spaced else "") + text + (draw(pads) if spaced else "")


def _axis_text(name: str, count: int | None = None, star: bool = False, mesh: tuple[str, ...] | None = None) -> str:
    text = format_name(name)
    if count is not None:
        text += str(count)
    if star:
        text += "*"
    if mesh is not None:
        text += "@" + mesh[0] if len(mesh) == 1 else "@(" + ",".join(mesh) + ")"
    return text


@st.composite
def count_placements(draw, spaced: bool = False) -> str:
    """einshard-0.2 style: 'a b -> 2 a2* b4', '... a -> * ... a8' (right side in any order)."""
    names = draw(st.lists(axis_names, min_size=0, max_size=4, unique=True))
    ellipsis = draw(st.booleans()) or not names
    left = [format_name(n) for n in names]
    if ellipsis:
        left.insert(draw(st.integers(0, len(left))), "...")
    right: list[str] = []
    for name in draw(st.permutations(names)):
        count = draw(st.none() | counts)
        star = draw(st.booleans())
        right.append(_axis_text(name, count, star))
    if ellipsis:
        right.insert(draw(st.integers(0, len(right))), "...")
    # Standalone replications: '2', '*', '2*'; at least one count item overall.
    n_replicas = draw(st.integers(0, 2))
    has_count = any(t not in ("...",) and (t[-1] == "*" or t[-1].isdigit()) for t in right)
    if not has_count:
        n_replicas = max(n_replicas, 1)
    for _ in range(n_replicas):
        count = draw(st.none() | counts)
        star = count is None or draw(st.booleans())
        text = (str(count) if count is not None else "") + ("*" if star else "")
        right.insert(draw(st.integers(0, len(right))), text)
    return _join(draw, [left, right], spaced)


@st.composite
def named_placements(draw, spaced: bool = False) -> str:
    """'@' style: 'b d -> b@data d@(x,y)': the right side annotates the left, in its order."""
    names = draw(st.lists(axis_names, min_size=0, max_size=4, unique=True))
    ellipsis_at = draw(st.none() | st.integers(0, len(names)))
    pool = draw(st.lists(mesh_names, min_size=0, max_size=5, unique=True))
    left = [format_name(n) for n in names]
    right = []
    for name in names:
        k = draw(st.integers(0, min(2, len(pool))))
        mesh, pool = tuple(pool[:k]), pool[k:]
        right.append(_axis_text(name, mesh=mesh or None))
    if ellipsis_at is not None:
        left.insert(ellipsis_at, "...")
        right.insert(ellipsis_at, "...")
    return _join(draw, [left, right], spaced)


@st.composite
def einsums(draw, spaced: bool = False) -> str:
    """'b x@data, x y@(m,n) -> b y {U:k}': operands with distinct axes, mesh axes unique per side."""
    universe = draw(st.lists(axis_names, min_size=1, max_size=5, unique=True))
    mesh_pool = draw(st.lists(mesh_names, min_size=1, max_size=4, unique=True))
    n_inputs = draw(st.integers(1, 3))

    def side(names: list[str], ellipsis: bool, unreduced: bool) -> list[str]:
        free = list(mesh_pool)
        items = []
        for name in names:
            k = draw(st.integers(0, min(2, len(free))))
            mesh, free = tuple(free[:k]), free[k:]
            items.append(_axis_text(name, mesh=mesh or None))
        if ellipsis:
            items.insert(draw(st.integers(0, len(items))), "...")
        if unreduced and free:
            pending = free[: draw(st.integers(1, len(free)))]
            items.append("{U:" + ",".join(pending) + "}")
        return items

    sides, used, any_ellipsis = [], [], False
    for _ in range(n_inputs):
        names = draw(st.lists(st.sampled_from(universe), max_size=4, unique=True))
        ellipsis = draw(st.booleans())
        any_ellipsis |= ellipsis
        used.extend(n for n in names if n not in used)
        sides.append(side(names, ellipsis, False))
    out_names = draw(st.lists(st.sampled_from(used), max_size=4, unique=True)) if used else []
    out_ellipsis = any_ellipsis and draw(st.booleans())
    sides.append(side(out_names, out_ellipsis, draw(st.booleans())))
    return _join(draw, sides, spaced)


# ---------------------------------------------------------------------------
# Round trips


@MANY
@given(count_placements())
def test_count_placements_parse_and_round_trip(text):
    expr = parse_placement(text)
    assert expr.uses_counts and not expr.uses_mesh_axes
    again = parse_placement(str(expr))
    assert again == expr
    assert str(again) == str(expr)


@MANY
@given(named_placements())
def test_named_placements_parse_and_round_trip(text):
    expr = parse_placement(text)
    assert not expr.uses_counts
    assert parse_placement(str(expr)) == expr
    # The right side repeats the left's axes in order, with the mesh axes written.
    assert expr.output.names == expr.inputs[0].names


@MANY
@given(einsums())
def test_einsums_parse_and_round_trip(text):
    expr = parse_einsum(text)
    assert parse_einsum(str(expr)) == expr
    assert parse(str(expr)) == expr


@MANY
@given(st.data())
def test_whitespace_variations_parse_to_equal_objects(data):
    kind = data.draw(st.sampled_from([count_placements, named_placements, einsums]))
    canonical = data.draw(kind())
    expr = parse(canonical)
    # The same items, joined with random whitespace (spaces, tabs, newlines).
    sides = [
        [str(i) for i in side.items] + (["{U:" + ",".join(side.unreduced) + "}"] if side.unreduced else [])
        for side in expr.sides
    ]
    text = data.draw(_respaced(sides))
    assert parse(text) == expr
    checker = parse_einsum if kind is einsums else parse_placement
    assert checker(text) == checker(canonical)


@st.composite
def _respaced(draw, sides: list[list[str]]) -> str:
    # Spaces may also stand inside '@( ... )' and '{U: ... }' around the names.
    def loosen(item: str) -> str:
        if "@(" in item or item.startswith("{U:"):
            head, _, rest = item.partition("(" if "@(" in item else ":")
            body = rest[:-1]
            names = body.split(",")
            inner = ("," + draw(pads)).join(names) if len(names) > 1 else body
            return (
                head
                + ("(" if "@(" in item else ":")
                + draw(st.sampled_from(["", " "]))
                + inner
                + draw(st.sampled_from(["", " "]))
                + rest[-1]
            )
        return item

    return _join(draw, [[loosen(i) for i in s] for s in sides], spaced=True)


def test_whitespace_is_not_ignored_between_a_name_and_its_count():
    # 'a2' is axis a split in 2; 'a 2' is axis a then a replication of 2 (as in einshard 0.2).
    assert parse("a -> a2").output.items == (AxisItem("a", 2),)
    assert parse("a -> a 2").output.items == (AxisItem("a"), ReplicaItem(2))


def test_printed_forms():
    assert str(parse_placement("a b -> 2 a2* b4")) == "a b -> 2 a2* b4"
    assert str(parse_placement(" ... a->*  ...\ta8 ")) == "... a -> * ... a8"
    assert str(parse_placement("{layer1} x -> {layer1}@(x1,y) x")) == "{layer1} x -> {layer1}@(x1,y) x"
    assert str(parse_einsum("b x@data ,x y@model->b y{U:model}")) == "b x@data, x y@model -> b y {U:model}"
    assert parse("α β -> α* β").output.items == (AxisItem("α", None, True), AxisItem("β"))
    assert parse("{l1} -> {l1}3*").output.items == (AxisItem("l1", 3, True),)
    assert parse("->") == parse(" -> ")  # a scalar
    assert parse("->").output == Side(())
    assert isinstance(parse("... -> ...").inputs[0].items[0], EllipsisItem)


def test_equality_ignores_columns():
    a, b = parse("a b -> a4 b"), parse("  a   b  ->  a4   b")
    assert a == b and hash(a) == hash(b)
    assert a.output.items[0].column != b.output.items[0].column


# ---------------------------------------------------------------------------
# Arbitrary text never raises anything but EinshardError

ALPHABET_PIECES = [
    "a",
    "b",
    "1",
    "2",
    "*",
    "@",
    "(",
    ")",
    ",",
    "->",
    "...",
    "{",
    "}",
    "U",
    ":",
    " ",
    "0",
    "α",
    "\t",
    "\n",
]
grammarish = st.lists(st.sampled_from(ALPHABET_PIECES), max_size=16).map("".join)
_SHAPES = [(8,), (8, 8), (4, 8, 2), (), (3, 5)]


def _only_einshard_errors(text: str) -> None:
    for fn in (parse, parse_placement, parse_einsum, einshard.spec):
        try:
            fn(text)
        except EinshardError:
            pass
    for shape in _SHAPES:
        try:
            einshard.spec(text, shape)
        except EinshardError:
            pass


@MANY
@given(st.text(max_size=30))
def test_arbitrary_text_raises_only_einshard_error(text):
    _only_einshard_errors(text)


@MANY
@given(grammarish)
def test_grammar_alphabet_text_raises_only_einshard_error(text):
    _only_einshard_errors(text)


@MANY
@given(
    st.one_of(count_placements(), named_placements(), einsums()).flatmap(
        lambda t: st.tuples(st.just(t), st.integers(0, max(len(t) - 1, 0)), st.sampled_from(ALPHABET_PIECES + [""]))
    )
)
def test_mutated_valid_expressions_raise_only_einshard_error(case):
    text, at, piece = case
    _only_einshard_errors(text[:at] + piece + text[at + 1 :])


def test_error_is_a_value_error():
    assert issubclass(EinshardError, ValueError)
    for bad in (None, 3, b"a -> a", ["a -> a"], {"a": "a -> a"}):
        for fn in (parse, parse_placement, parse_einsum, einshard.spec):
            with pytest.raises(EinshardError, match="is a string"):
                fn(bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# The error catalogue: each path quotes the expression, points at a column, names what is wrong


def assert_points(err: EinshardError, expression: str, column: int, *words: str) -> None:
    """The message quotes `expression`, puts a caret under `column`, and contains every word."""
    lines = str(err).split("\n")
    assert err.expression == expression
    assert err.column == column, f"caret at {err.column}, expected {column}:\n{err}"
    assert lines[1] == "    " + "".join(" " if c.isspace() else c for c in expression)
    assert lines[2] == "    " + " " * column + "^"
    for word in words:
        assert word in str(err), f"{word!r} not in:\n{err}"


@pytest.fixture(scope="module")
def mesh42():
    return jax.make_mesh((4, 2), ("data", "model"))


def _raise(fn, *args, **kwargs) -> EinshardError:
    with pytest.raises(EinshardError) as info:
        fn(*args, **kwargs)
    return info.value


def test_error_syntax():
    e = _raise(parse_placement, "a b -> a (b)")
    assert_points(e, "a b -> a (b)", 9, "found '('", "expected", "Parentheses only group mesh axes")
    e = _raise(parse_placement, "a b -> a b %")
    assert_points(e, "a b -> a b %", 11, "'%'")
    e = _raise(parse_placement, "a b")
    assert_points(e, "a b", 3, "'->'", "the end of the expression")
    e = _raise(parse_placement, "a b -> a @data b")
    assert_points(e, "a b -> a @data b", 9, "'@' follows its axis without a space")


def test_error_syntax_in_multi_line_expression_points_at_the_right_column():
    text = "a b\r\n\x0c -> a\x0b\n  b %"
    e = _raise(parse_placement, text)
    assert_points(e, text, text.index("%"), "'%'")
    text = "a\n b -> a c"
    assert_points(_raise(parse_placement, text), text, text.index("c"), "'c'")


def test_error_unknown_axis_on_the_right():
    e = _raise(parse_placement, "a b -> a c")
    assert_points(e, "a b -> a c", 9, "axis 'c'", "'a', 'b'")
    # einshard 0.2 silently accepted this one.
    e = _raise(einshard.einshard, np.zeros((4, 8)), "a b -> a b c*")
    assert_points(e, "a b -> a b c*", 11, "axis 'c'")


def test_error_axis_twice():
    assert_points(_raise(parse_placement, "a a -> a* a"), "a a -> a* a", 2, "'a'", "twice on the left")
    assert_points(_raise(parse_placement, "a b -> a b a"), "a b -> a b a", 11, "'a'", "twice on the right")
    assert_points(_raise(parse_einsum, "i i, i -> i"), "i i, i -> i", 2, "'i'", "twice in one operand")


def test_error_rank_mismatch():
    e = _raise(einshard.spec, "a b -> a b*", (4,))
    assert_points(e, "a b -> a b*", 0, "names 2 axes", "rank 1")
    e = _raise(einshard.spec, "a b ... -> a b* ...", (4,))
    assert_points(e, "a b ... -> a b* ...", 0, "2 axes besides '...'", "rank 1")


def test_error_indivisible_dimension(mesh42):
    e = _raise(einshard.spec, "a b -> a8 b", (5, 8))
    assert_points(e, "a b -> a8 b", 7, "axis 'a'", "size 5", "8 equal shards", "Pad the axis to 8")
    e = _raise(einshard.sharding, "a b -> a@(data,model) b", (12, 8), mesh=mesh42)
    assert_points(e, "a b -> a@(data,model) b", 7, "axis 'a'", "size 12", "data(4)", "model(2)", "8 equal shards")
    e = _raise(einshard.spec, "x ... -> x ...8", (3, 2, 5))
    # '...8' is not a thing: digits follow names, not '...'.
    assert e.column == 14


def test_error_more_devices_than_exist():
    n = jax.device_count()
    text = f"a b -> a{2 * n} b"
    e = _raise(einshard.spec, text, (4 * n, 2))
    assert_points(e, text, 7, f"{2 * n} devices", f"{n} there are")


def test_error_count_zero():
    assert_points(_raise(parse_placement, "a b -> a0 b"), "a b -> a0 b", 8, "at least 1")
    assert_points(_raise(parse_placement, "a b -> a b 0*"), "a b -> a b 0*", 11, "at least 1")


def test_error_mixing_counts_and_mesh_axes():
    e = _raise(parse_placement, "a b -> a@data b2")
    assert_points(e, "a b -> a@data b2", 14, "do not mix", "'a@data'")
    e = _raise(parse_placement, "a b -> * a@data b")
    assert_points(e, "a b -> * a@data b", 7, "do not mix")
    # In the user's names (issue 22): their counts and '@' axes, not a generic 'a4'.
    e = _raise(parse_placement, "x y -> x@data y*")
    assert_points(e, "x y -> x@data y*", 14, "counts ('y*') and mesh axes ('x@data') do not mix")
    assert "a4" not in str(e)
    e = _raise(parse_einsum, "a b, b c -> a c4")
    assert_points(e, "a b, b c -> a c4", 14, "named mesh axes")


def test_error_unknown_mesh_axis(mesh42):
    e = _raise(einshard.sharding, "a b -> a@dat b", (8, 8), mesh=mesh42)
    assert_points(e, "a b -> a@dat b", 7, "'dat'", "'data': 4", "'model': 2", "Did you mean 'data'?")


def test_error_mesh_axis_used_twice(mesh42):
    e = _raise(einshard.sharding, "a b -> a@data b@data", (8, 8), mesh=mesh42)
    assert_points(e, "a b -> a@data b@data", 14, "'data'", "only one")
    e = _raise(parse_placement, "a b -> a@(data,data) b")
    assert_points(e, "a b -> a@(data,data) b", 7, "'data'")
    e = _raise(parse_einsum, "a b, b -> a@m b {U:m}")
    assert_points(e, "a b, b -> a@m b {U:m}", 16, "'m'", "pending sums")


def test_error_ellipsis_on_one_side():
    assert_points(_raise(parse_placement, "a ... -> a*"), "a ... -> a*", 2, "'...'", "both sides")
    assert_points(_raise(parse_placement, "a -> a* ..."), "a -> a* ...", 8, "'...'", "both sides")
    assert_points(_raise(parse_placement, "... a ... -> a"), "... a ... -> a", 6, "at most once")


def test_error_digits_in_a_left_name():
    e = _raise(parse_placement, "layer1 b -> layer1 b")
    assert_points(e, "layer1 b -> layer1 b", 0, "'layer'", "{layer1}")


def test_error_no_mesh_for_an_at_expression():
    e = _raise(einshard.sharding, "a b -> a b@model", (8, 8))
    assert_points(e, "a b -> a b@model", 9, "no mesh", "jax.set_mesh")
    e = _raise(einshard.einshard, np.zeros((8, 8)), "a b -> a b@model")
    assert_points(e, "a b -> a b@model", 9, "no mesh")


def test_error_rule_miss_in_a_pytree():
    tree = {"encoder": {"w": np.zeros((8, 4)), "b": np.zeros(4)}}
    with pytest.raises(EinshardError) as info:
        einshard.einshard(tree, {r"\['w'\]": "a b -> a* b"})
    assert "['encoder']['b']" in str(info.value)
    assert repr(r"\['w'\]") in str(info.value)  # the patterns tried, as written


def test_error_in_a_pytree_leaf_keeps_the_caret_and_names_the_path():
    tree = {"w": np.zeros((5, 4))}
    e = _raise(einshard.einshard, tree, {"w": "a b -> a8 b"})
    assert_points(e, "a b -> a8 b", 7, "['w']", "(5, 4)", "size 5")


def test_error_left_side_carries_counts_or_mesh_axes():
    assert_points(_raise(parse_placement, "a4 b -> a b"), "a4 b -> a b", 0, "goes on the right")
    assert_points(_raise(parse_placement, "a b@x -> a b"), "a b@x -> a b", 2, "goes on the right")
    assert_points(_raise(parse_placement, "2 a -> a"), "2 a -> a", 0, "belongs on the right")


def test_error_a_placement_with_an_einsum():
    assert_points(_raise(parse_placement, "a b, b c -> a c"), "a b, b c -> a c", 5, "one array on the left")


def test_error_transposing_with_mesh_axes():
    e = _raise(parse_placement, "a b -> b@x a")
    assert_points(e, "a b -> b@x a", 7, "left side's order")


def test_error_unreduced_misplaced():
    e = _raise(parse_placement, "a b -> a b {U:x}")
    assert_points(e, "a b -> a b {U:x}", 11, "pending partial sums")
    e = _raise(parse, "a b -> a {U:x} b")
    assert_points(e, "a b -> a {U:x} b", 15, "closes a side")
    e = _raise(parse, "a b -> a b {U: x,x}")
    assert_points(e, "a b -> a b {U: x,x}", 11, "listed twice")


def test_error_stars_without_a_fitting_split():
    e = _raise(einshard.spec, "a b -> a* b*", (3, 3))
    assert_points(e, "a b -> a* b*", 7, "no split", "size 3")


def test_error_bad_shape():
    e = _raise(einshard.spec, "a -> a", (-1,))
    assert "non-negative integers" in str(e)
    e = _raise(einshard.spec, "a -> a", "ab")
    assert "non-negative integers" in str(e)


def test_error_einsum_output():
    e = _raise(parse_einsum, "b x, x y -> b z")
    assert_points(e, "b x, x y -> b z", 14, "output axis 'z'")
    e = _raise(parse_einsum, "b x, x y -> b ...")
    assert_points(e, "b x, x y -> b ...", 14, "'...' in the output")


# -- '?' on an einsum's output: the analyzer chooses (bare names are whole, as in a placement) ------------


def test_question_mark_marks_a_chosen_output():
    from einshard._src.parsing import parse_einsum

    e = parse_einsum("b x@data, x y -> b? y?")
    assert e.output_chosen and [str(i) for i in e.output.axes] == ["b?", "y?"]
    assert not parse_einsum("b x@data, x y -> b y").output_chosen
    assert parse_einsum("... d, d f -> ... f?").output_chosen


@pytest.mark.parametrize(
    "text, message, column",
    [
        ("b x, x y -> b? y", "output axis 'y' has no '?'", 15),
        ("b? x, x y -> b y", "is for the output side", 0),
        ("b x, x y -> b? y? {U:data}", "write one or the other", 18),
        ("b x, x y -> b?@data y?", None, None),  # '?' and '@' on one axis: a syntax error
    ],
)
def test_question_mark_errors(text, message, column):
    from einshard._src.parsing import parse_einsum

    with pytest.raises(EinshardError, match=message) as info:
        parse_einsum(text)
    if column is not None:
        assert info.value.column == column


def test_question_mark_is_not_a_placement():
    with pytest.raises(EinshardError, match="belongs on an einsum's output side") as info:
        parse_placement("a b -> a? b")
    assert info.value.column == 7
