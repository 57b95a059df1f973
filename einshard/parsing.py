"""Parse einshard expressions into immutable objects.

The syntax lives in ``grammar/einshard.lark`` (loaded with Lark's LALR parser);
this module turns the parse tree into frozen dataclasses and checks the rules
a grammar cannot say well (which items may stand on which side), so that each
error can quote the expression, point at the column and teach the syntax.

Nothing here knows about JAX.

Example:
    >>> from einshard.parsing import parse_placement
    >>> e = parse_placement("a b -> a@data b")
    >>> e.output.items[0]
    AxisItem(name='a', count=None, star=False, mesh_axes=('data',), choose=False)
    >>> str(e)
    'a b -> a@data b'
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import lark

from ._caches import register
from .errors import EinshardError

__all__ = [
    "AxisItem",
    "ReplicaItem",
    "EllipsisItem",
    "Item",
    "Side",
    "Expression",
    "parse",
    "parse_placement",
    "parse_einsum",
    "format_name",
    "is_count_item",
]


# ---------------------------------------------------------------------------
# Parsed objects


@dataclass(frozen=True)
class AxisItem:
    """One named array axis on a side, with how it is sharded.

    ``a`` (unsharded), ``a4`` (split in 4), ``a2*`` (a proportional share of
    weight 2 of the devices left over), ``a@data`` / ``a@(data,model)`` (split
    over named mesh axes, major to minor).
    """

    name: str
    count: int | None = None
    star: bool = False
    mesh_axes: tuple[str, ...] | None = None
    column: int = field(default=-1, compare=False, repr=False)
    # 'b?' (einsum outputs only): the analyzer chooses this axis's layout.
    choose: bool = False

    def __str__(self) -> str:
        text = format_name(self.name)
        if self.count is not None:
            text += str(self.count)
        if self.star:
            text += "*"
        if self.choose:
            text += "?"
        if self.mesh_axes is not None:
            if len(self.mesh_axes) == 1:
                text += "@" + self.mesh_axes[0]
            else:
                text += "@(" + ",".join(self.mesh_axes) + ")"
        return text


@dataclass(frozen=True)
class ReplicaItem:
    """A standalone replication: ``2``, ``*`` or ``2*`` (a mesh axis that shards nothing)."""

    count: int | None = None
    star: bool = False
    column: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return (str(self.count) if self.count is not None else "") + ("*" if self.star else "")


@dataclass(frozen=True)
class EllipsisItem:
    """``...``: the array axes the side does not name."""

    column: int = field(default=-1, compare=False, repr=False)

    def __str__(self) -> str:
        return "..."


Item = AxisItem | ReplicaItem | EllipsisItem


@dataclass(frozen=True)
class Side:
    """One side of an expression: an operand, the placed array, or the output.

    ``unreduced`` lists the mesh axes over which the side holds pending partial
    sums (written ``{U:model}`` after the last axis, as JAX prints it).
    """

    items: tuple[Item, ...]
    unreduced: tuple[str, ...] = ()
    column: int = field(default=-1, compare=False, repr=False)
    unreduced_column: int = field(default=-1, compare=False, repr=False)

    @property
    def axes(self) -> tuple[AxisItem, ...]:
        """The named axes, in order."""
        return tuple(i for i in self.items if isinstance(i, AxisItem))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.items if isinstance(i, AxisItem))

    @property
    def has_ellipsis(self) -> bool:
        return any(isinstance(i, EllipsisItem) for i in self.items)

    def __str__(self) -> str:
        text = " ".join(str(i) for i in self.items)
        if self.unreduced:
            text += (" " if text else "") + "{U:" + ",".join(self.unreduced) + "}"
        return text


@dataclass(frozen=True)
class Expression:
    """A parsed expression: input sides, an arrow, an output side.

    Equality ignores the original text and columns, so printing an expression
    and parsing it again gives an equal object.
    """

    inputs: tuple[Side, ...]
    output: Side
    text: str = field(default="", compare=False, repr=False)

    def __str__(self) -> str:
        return ", ".join(str(s) for s in self.inputs) + " -> " + str(self.output)

    @property
    def sides(self) -> tuple[Side, ...]:
        return (*self.inputs, self.output)

    @property
    def uses_counts(self) -> bool:
        """Whether any side uses einshard-0.2 counts (``a4``, ``*``, a standalone ``2``)."""
        return any(is_count_item(i) for s in self.sides for i in s.items)

    @property
    def output_chosen(self) -> bool:
        """Whether the output side leaves its layout to the analyzer (``-> b? y?``)."""
        return any(i.choose for i in self.output.axes)

    @property
    def uses_mesh_axes(self) -> bool:
        """Whether any side names mesh axes with ``@`` or ``{U:...}``."""
        return any(
            (isinstance(i, AxisItem) and i.mesh_axes is not None) or s.unreduced for s in self.sides for i in s.items
        ) or any(s.unreduced for s in self.sides)

    def fail(self, reason: str, column: int | None = None, hint: str | None = None) -> EinshardError:
        """An EinshardError about this expression (returned, for the caller to raise)."""
        return EinshardError(reason, self.text or str(self), column, hint)


def is_count_item(item: Item) -> bool:
    if isinstance(item, ReplicaItem):
        return True
    return isinstance(item, AxisItem) and (item.count is not None or item.star)


_PLAIN_NAME = re.compile(r"[^\W\d]+")


def format_name(name: str) -> str:
    """Write an axis name as the grammar reads it: bare if it is letters and '_', else in braces."""
    return name if _PLAIN_NAME.fullmatch(name) else "{" + name + "}"


# ---------------------------------------------------------------------------
# The parser


def _grammar_text() -> str:
    # Installed wheels carry the grammar inside the package (see pyproject's
    # force-include); a source checkout has it at the repository root.
    packaged = importlib.resources.files("einshard").joinpath("grammar", "einshard.lark")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    source = pathlib.Path(__file__).resolve().parent.parent / "grammar" / "einshard.lark"
    return source.read_text(encoding="utf-8")


@functools.cache
def _lark() -> lark.Lark:
    return lark.Lark(_grammar_text(), parser="lalr", propagate_positions=True, maybe_placeholders=False)


# What each terminal means, for "expected ..." in syntax errors.
_TERMINAL_WORDS = {
    "NAME": "an axis name",
    "BRACED_NAME": "an axis name",
    "MESH_NAME": "a mesh axis name",
    "INT": "a count",
    "STAR": "'*'",
    "ELLIPSIS": "'...'",
    "_ARROW": "'->'",
    "_COMMA": "','",
    "_WS": "a space",
    "LPAR": "'('",
    "RPAR": "')'",
    "AT": "'@'",
    "RBRACE": "'}'",
    "$END": "the end of the expression",
}

_SYNTAX_HELP = (
    "The syntax: 'a b -> a4 b*' (einshard 0.2 counts) or 'a b -> a@data b' (named mesh axes); "
    "names are letters and '_', a name with digits goes in braces: {layer1}."
)


def _expected_words(expected: set[str]) -> str:
    words: list[str] = []
    for term in sorted(expected):
        word = _TERMINAL_WORDS.get(term)
        if word is None:
            if term.startswith("__ANON") or term == "LBRACE":
                word = "'{U:'"
            else:
                word = term.lower()
        if word not in words:
            words.append(word)
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _syntax_error(text: str, offset: int, err: lark.exceptions.UnexpectedInput) -> EinshardError:
    # pos_in_stream is an offset in the whole text; Lark's .column restarts on every line.
    pos = getattr(err, "pos_in_stream", None)
    column = offset + (pos if isinstance(pos, int) and pos >= 0 else 0)
    if isinstance(err, lark.exceptions.UnexpectedEOF):
        column = offset + len(text.strip())
        found = "the end of the expression"
        expected = {str(t) for t in err.expected}
    elif isinstance(err, lark.exceptions.UnexpectedToken):
        token = err.token
        found = "the end of the expression" if token.type == "$END" else repr(str(token).strip() or str(token))
        if token.type == "$END":
            column = offset + len(text.strip())
        elif token.type in ("_ARROW", "_COMMA"):
            # These terminals swallow leading spaces; point at the symbol itself.
            raw = str(token)
            column += len(raw) - len(raw.lstrip())
        expected = {str(t) for t in err.expected}
    else:  # UnexpectedCharacters
        found = repr(text[column]) if column < len(text) else "the end of the expression"
        expected = {str(t) for t in getattr(err, "allowed", None) or ()}
    hint = _SYNTAX_HELP
    ch = text[column] if 0 <= column < len(text) else ""
    if ch == "(":
        hint = "Parentheses only group mesh axes after '@': 'a@(data,model)'. " + _SYNTAX_HELP
    elif ch == "@" or text[column:].lstrip().startswith("@"):
        hint = "'@' follows its axis without a space: 'a@data'. " + _SYNTAX_HELP
    elif "_ARROW" in expected and "->" not in text:
        hint = "An expression needs '->': 'a b -> a@data b'."
    reason = f"invalid einshard expression: expected {_expected_words(expected)}, found {found} (column {column})"
    return EinshardError(reason, text, column, hint)


class _Build(lark.Transformer):  # type: ignore[type-arg]
    """Parse tree -> parsed objects, with 0-based columns in the original text."""

    def __init__(self, offset: int, text: str) -> None:
        super().__init__()
        self.offset = offset
        self.text = text  # the stripped text Lark parsed

    # start_pos, not .column: Lark's columns restart on every line of a multi-line expression.
    def _col(self, thing: lark.Token | lark.Tree) -> int:  # type: ignore[type-arg]
        if isinstance(thing, lark.Token):
            return self.offset + (thing.start_pos or 0)
        return self.offset + (thing.meta.start_pos or 0)

    def axis_name(self, children: list[lark.Token]) -> tuple[str, int]:
        tok = children[0]
        name = str(tok)
        if tok.type == "BRACED_NAME":
            name = name[1:-1]
        return name, self._col(tok)

    # Pieces of an item come back tagged, so `axis` can tell them apart.
    def count(self, children: list[lark.Token]) -> tuple[str, int, int]:
        return "count", int(children[0]), self._col(children[0])

    def mesh_axes(self, children: list[lark.Token]) -> tuple[str, tuple[str, ...]]:
        return "mesh", tuple(str(c) for c in children)

    def unreduced(self, children: list[lark.Token]) -> tuple[str, tuple[str, ...], int]:
        # children[0] is the first mesh axis name; '{U:' is the last one before it
        # (spaces may stand between them).
        first = children[0].start_pos or 0
        brace = self.text.rfind("{U:", 0, first)
        return "unreduced", tuple(str(c) for c in children), self.offset + (brace if brace >= 0 else first)

    def axis(self, children: list) -> tuple[AxisItem, tuple | None]:  # type: ignore[type-arg]
        (name, column), *rest = children
        count: int | None = None
        star = False
        mesh: tuple[str, ...] | None = None
        unreduced = None
        choose = False
        for c in rest:
            if isinstance(c, lark.Token) and c.type == "CHOOSE":
                choose = True
            elif isinstance(c, lark.Token):  # STAR
                star = True
            elif c[0] == "count":
                count = _check_count(c)
            elif c[0] == "mesh":
                mesh = c[1]
            else:
                unreduced = c
        return AxisItem(name, count, star, mesh, column, choose), unreduced

    @lark.v_args(meta=True)
    def replica(self, meta: lark.tree.Meta, children: list) -> tuple[ReplicaItem, None]:  # type: ignore[type-arg]
        count = None
        star = False
        for c in children:
            if isinstance(c, lark.Token):
                star = True
            else:
                count = _check_count(c)
        return ReplicaItem(count, star, self.offset + meta.start_pos), None

    def ellipsis(self, children: list[lark.Token]) -> tuple[EllipsisItem, None]:
        return EllipsisItem(self._col(children[0])), None

    @lark.v_args(meta=True)
    def side(self, meta: lark.tree.Meta, children: list) -> Side:  # type: ignore[type-arg]
        items: list[Item] = []
        unreduced: tuple[str, ...] = ()
        unreduced_col = -1
        for child in children:
            if child[0] == "unreduced":  # a bare '{U:...}' item
                item, pending = None, child
            else:
                item, pending = child
            if unreduced:
                col = item.column if item is not None else pending[2]
                raise _Pending(col, "'{U:...}' closes a side: nothing may follow it")
            if item is not None:
                items.append(item)
            if pending is not None:
                _, unreduced, unreduced_col = pending
        column = self.offset + (meta.start_pos if not meta.empty else 0)
        return Side(tuple(items), unreduced, column, unreduced_col)

    def start(self, children: list[Side]) -> tuple[Side, ...]:
        return tuple(children)


class _Pending(Exception):
    def __init__(self, column: int, reason: str) -> None:
        self.column = column
        self.reason = reason


def _check_count(tagged: tuple[str, int, int]) -> int:
    _, value, column = tagged
    if value == 0:
        raise _Pending(column, "a count must be at least 1 (a count of 0 shards nothing)")
    return value


def _cached_on_strings(fn: Callable[[str], Expression]) -> Callable[[str], Expression]:
    """Memoize a parser, checking first that it was given a string (an unhashable list must not reach the cache)."""
    cached = functools.lru_cache(maxsize=4096)(fn)
    register(cached.cache_clear)

    @functools.wraps(fn)
    def parser(text: str) -> Expression:
        if not isinstance(text, str):
            raise EinshardError(f"an einshard expression is a string, got {type(text).__name__}: {text!r}")
        return cached(text)

    parser.cache_clear = cached.cache_clear  # type: ignore[attr-defined]
    return parser


@_cached_on_strings
def parse(text: str) -> Expression:
    """Parse an expression of either kind (placement or einsum) without checking which.

    Raises EinshardError for syntax errors, zero counts, more than one
    ``...`` on a side and a mesh axis used twice in one side.
    """
    if not isinstance(text, str):
        raise EinshardError(f"an einshard expression is a string, got {type(text).__name__}: {text!r}")
    stripped = text.strip()
    offset = len(text) - len(text.lstrip())
    try:
        tree = _lark().parse(stripped)
        sides = _Build(offset, stripped).transform(tree)
    except lark.exceptions.UnexpectedInput as err:
        raise _syntax_error(text, offset, err) from None
    except lark.exceptions.VisitError as err:
        orig = err.orig_exc
        if isinstance(orig, _Pending):
            raise EinshardError(orig.reason, text, orig.column, _SYNTAX_HELP) from None
        raise
    expr = Expression(tuple(sides[:-1]), sides[-1], text)
    for side in expr.sides:
        _check_side(expr, side)
    return expr


def _check_side(expr: Expression, side: Side) -> None:
    ellipses = [i for i in side.items if isinstance(i, EllipsisItem)]
    if len(ellipses) > 1:
        raise expr.fail("'...' may appear at most once on a side", ellipses[1].column)
    seen: dict[str, int] = {}
    for item in side.items:
        if isinstance(item, AxisItem) and item.mesh_axes is not None:
            for m in item.mesh_axes:
                if m in seen:
                    raise expr.fail(
                        f"mesh axis {m!r} shards two array axes of one side; a mesh axis can split only one",
                        item.column,
                    )
                seen[m] = item.column
    for m in side.unreduced:
        if m in seen:
            raise expr.fail(
                f"mesh axis {m!r} both shards an axis and holds pending sums ('{{U:{m}}}') on one side",
                side.unreduced_column,
            )
    if len(set(side.unreduced)) != len(side.unreduced):
        raise expr.fail("a mesh axis is listed twice in '{U:...}'", side.unreduced_column)


# ---------------------------------------------------------------------------
# Placement expressions: 'a b -> a4 b*' or 'a b -> a@data b'


@_cached_on_strings
def parse_placement(text: str) -> Expression:
    """Parse and check a placement expression (one array, its axes, how they are laid out).

    The left side names the array's axes (and at most one ``...``); the right
    side lists each of them once, in the same order when ``@`` is used, each
    annotated with a count or with mesh axes.  Counts and ``@`` do not mix.

    Example:
        >>> str(parse_placement("a   b->a2* b"))
        'a b -> a2* b'
    """
    expr = parse(text)
    for side in expr.sides:
        for ax in side.axes:
            if ax.choose:
                raise expr.fail(
                    f"'{ax.name}?' (let the analyzer choose the layout) belongs on an einsum's output side, "
                    "not in a placement",
                    ax.column,
                    f"Write {ax.name!r} for a whole (replicated) axis or '{ax.name}@mesh_axis' to split it.",
                )
    if len(expr.inputs) != 1:
        second = expr.inputs[1]
        raise expr.fail(
            "a placement expression has one array on the left; ',' separates einsum operands "
            "(use einshard.analyze or einshard.einsum for an einsum)",
            second.column,
        )
    left, right = expr.inputs[0], expr.output
    for item in left.items:
        if isinstance(item, ReplicaItem):
            raise expr.fail(
                "the left side names the array's axes; a count or '*' belongs on the right",
                item.column,
                "Write 'a b -> 2 a b' to replicate over 2 devices.",
            )
        if isinstance(item, AxisItem) and (item.count is not None or item.star or item.mesh_axes is not None):
            hint = None
            if item.count is not None and not item.star and item.mesh_axes is None:
                hint = f"Digits after a name are a shard count; an axis named with digits is written in braces: {{{item.name}{item.count}}}."
            raise expr.fail(
                f"the left side names the array's axes; how axis {item.name!r} is sharded goes on the right",
                item.column,
                hint,
            )
    if left.unreduced or right.unreduced:
        side = left if left.unreduced else right
        raise expr.fail(
            "'{U:...}' (pending partial sums) describes einsum results, not a placement",
            side.unreduced_column,
        )
    if left.has_ellipsis != right.has_ellipsis:
        col = next((i.column for s in (left, right) for i in s.items if isinstance(i, EllipsisItem)), None)
        raise expr.fail("'...' must appear on both sides or on neither", col)
    seen: dict[str, int] = {}
    for item in left.axes:
        if item.name in seen:
            raise expr.fail(f"axis {item.name!r} is named twice on the left", item.column)
        seen[item.name] = item.column
    used: set[str] = set()
    for item in right.axes:
        if item.name not in seen:
            names = ", ".join(repr(n) for n in seen) or "none"
            raise expr.fail(
                f"axis {item.name!r} on the right is not an axis of the array (the left side names: {names})",
                item.column,
            )
        if item.name in used:
            raise expr.fail(f"axis {item.name!r} appears twice on the right", item.column)
        used.add(item.name)
    missing = [n for n in seen if n not in used]
    if missing:
        raise expr.fail(
            f"axis {missing[0]!r} of the array is missing on the right; list every axis, unsharded ones bare",
            seen[missing[0]],
        )
    if expr.uses_counts and expr.uses_mesh_axes:
        count_item = next(i for i in right.items if is_count_item(i))
        raise expr.fail(
            "counts ('a4', '*', a standalone '2') and mesh axes ('a@data') do not mix in one expression: "
            "counts build an anonymous mesh of all devices, '@' uses your mesh",
            count_item.column,
            "Use one style: 'a b -> a@data b' on your mesh, or 'a b -> a4 b' on an anonymous one.",
        )
    if expr.uses_mesh_axes:
        # With '@' the right side only annotates the left: same axes, same order.
        # (Without '@' or counts nothing is sharded, and einshard 0.2 accepts any
        # order there: 'a b -> b a' on one device.)
        order = [i for i in right.items if not isinstance(i, ReplicaItem)]
        lhs = list(left.items)
        for a, b in zip(lhs, order):
            if type(a) is not type(b) or (isinstance(a, AxisItem) and isinstance(b, AxisItem) and a.name != b.name):
                raise expr.fail(
                    "with mesh axes the right side lists the array's axes in the left side's order "
                    "(einshard places an array, it does not transpose it)",
                    b.column,
                )
    return expr


# ---------------------------------------------------------------------------
# Einsum expressions: 'b x@data, x y@model -> b y@model'


@_cached_on_strings
def parse_einsum(text: str) -> Expression:
    """Parse and check an einsum expression, optionally annotated with mesh axes.

    Operands are separated by ',', axes by spaces; ``@`` annotations and a
    trailing ``{U:axis}`` are optional.  Counts are not allowed: an einsum is
    laid out on a named mesh.

    Example:
        >>> str(parse_einsum("b x@data, x y -> b y"))
        'b x@data, x y -> b y'
    """
    expr = parse(text)
    for side in expr.sides:
        for item in side.items:
            if is_count_item(item):
                raise expr.fail(
                    "einsum operands are laid out on named mesh axes ('x@model'), not with counts",
                    item.column,
                )
        names = side.names
        for i, item in enumerate(side.axes):
            if item.name in names[:i]:
                raise expr.fail(
                    f"axis {item.name!r} appears twice in one operand (einshard does not take diagonals)",
                    item.column,
                )
    for side in expr.inputs:
        for item in side.axes:
            if item.choose:
                raise expr.fail(
                    f"'{item.name}?' (the analyzer chooses) is for the output side; an operand is laid out "
                    "as written ('x@model') or as the array already is (no '@')",
                    item.column,
                )
    out_axes = expr.output.axes
    if any(i.choose for i in out_axes):
        fixed = next((i for i in out_axes if not i.choose), None)
        if fixed is not None:
            raise expr.fail(
                f"output axis {fixed.name!r} has no '?' while others have one: mark every output axis with '?' "
                "(the analyzer chooses the whole result layout) or none (the layout as written; a bare name is "
                "whole)",
                fixed.column,
            )
        if expr.output.unreduced:
            raise expr.fail(
                "'?' lets the analyzer choose the result layout; '{U:...}' asks for one: write one or the other",
                expr.output.unreduced_column,
            )
    inputs_names = {n for s in expr.inputs for n in s.names}
    for item in expr.output.axes:
        if item.name not in inputs_names:
            raise expr.fail(f"output axis {item.name!r} is not an axis of any operand", item.column)
    if expr.output.has_ellipsis and not any(s.has_ellipsis for s in expr.inputs):
        col = next(i.column for i in expr.output.items if isinstance(i, EllipsisItem))
        raise expr.fail("'...' in the output needs '...' in an operand", col)
    return expr
