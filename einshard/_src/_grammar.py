"""The parser: ``grammar/einshard.lark`` (Lark, LALR) to frozen :class:`~einshard.parsing.Expression` (private).

Syntax errors quote the expression, point at the column and say what was expected; the checks that hold for
both kinds of expression (one ``...`` per side, a mesh axis used once per side) are here too.  The checks of
each kind (placement, einsum) are in :mod:`einshard.parsing`.
"""

from __future__ import annotations

import functools
import importlib.resources
import pathlib
import re
from collections.abc import Callable

import lark

from ._caches import register
from ._expression import AxisItem, EllipsisItem, Expression, Item, ReplicaItem, Side
from .errors import EinshardError

__all__ = ["parse"]


def _grammar_text() -> str:
    # Installed wheels carry the grammar inside the package (see pyproject's
    # force-include); a source checkout has it at the repository root.
    packaged = importlib.resources.files("einshard").joinpath("grammar", "einshard.lark")
    if packaged.is_file():
        return packaged.read_text(encoding="utf-8")
    source = pathlib.Path(__file__).resolve().parents[2] / "grammar" / "einshard.lark"
    return source.read_text(encoding="utf-8")


@functools.cache
def lark_parser() -> lark.Lark:
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


_MAX_COUNT_DIGITS = 18


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
        digits = str(children[0])
        if len(digits.lstrip("0")) > _MAX_COUNT_DIGITS:
            # Python refuses int() of over 4,300 digits; no mesh has even 10**18 devices.
            raise _Pending(
                self._col(children[0]),
                f"a count of {len(digits)} digits is more devices than any mesh has "
                f"(counts have at most {_MAX_COUNT_DIGITS} digits)",
            )
        return "count", int(digits), self._col(children[0])

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


def cached_on_strings(fn: Callable[[str], Expression]) -> Callable[[str], Expression]:
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


@cached_on_strings
def parse(text: str) -> Expression:
    """Parse an expression of either kind (placement or einsum) without checking which.

    Raises EinshardError for syntax errors, zero counts, more than one
    ``...`` on a side and a mesh axis used twice in one side.
    """
    if not isinstance(text, str):
        raise EinshardError(f"an einshard expression is a string, got {type(text).__name__}: {text!r}")
    stripped = text.strip()
    offset = len(text) - len(text.lstrip())
    fast = _scan(text, offset, len(text.rstrip()))
    if fast is not None:
        expr = Expression(fast[:-1], fast[-1], text)
        for side in expr.sides:
            _check_side(expr, side)
        return expr
    try:
        tree = lark_parser().parse(stripped)
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


# The common expressions ('b x@data, x y@(data,model) -> b? y?': names, '@' one mesh axis or a
# parenthesised list without spaces, '?') are read by a scanner with the grammar's own terminals, giving
# the objects and columns Lark's tree would; anything else (counts, '*', '...', braces, '{U:...}', an
# empty side, spaces inside '@(...)', any syntax error) is left to Lark, so its errors are the grammar's.
_ITEM = re.compile(r"([^\W\d]+)(?:(\?)|@([^\W\d]\w*)|@\(([^\W\d]\w*(?:,[^\W\d]\w*)*)\))?")
_ARROW = re.compile(r"\s*->\s*")
_COMMA = re.compile(r"\s*,\s*")
_SPACE = re.compile(r"\s+")


def _scan(text: str, pos: int, end: int) -> tuple[Side, ...] | None:
    """The sides of ``text[pos:end]`` (stripped) if it is in the scanner's subset, else None (for Lark)."""
    sides: list[Side] = []
    items: list[Item] = []
    start = pos
    arrow = False
    while True:
        m = _ITEM.match(text, pos, end)
        if m is None:
            return None
        name, choose, one, many = m.groups()
        mesh = (one,) if one is not None else tuple(many.split(",")) if many is not None else None
        items.append(AxisItem(name, None, False, mesh, pos, choose is not None))
        pos = m.end()
        if pos == end:
            if not arrow:
                return None
            sides.append(Side(tuple(items), (), start, -1))
            return tuple(sides)
        # the separators outrank a space, as in the grammar (_ARROW.2, _COMMA.2)
        sep = _ARROW.match(text, pos, end)
        if sep is not None:
            if arrow:
                return None
            arrow = True
        else:
            sep = _COMMA.match(text, pos, end)
            if sep is not None and arrow:
                return None
        if sep is not None:
            sides.append(Side(tuple(items), (), start, -1))
            items = []
            pos = start = sep.end()
            continue
        sep = _SPACE.match(text, pos, end)
        if sep is None:
            return None
        pos = sep.end()


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
