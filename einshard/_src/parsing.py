"""Parse einshard expressions into immutable objects.

The syntax lives in ``grammar/einshard.lark`` (loaded with Lark's LALR parser);
this module turns the parse tree into frozen dataclasses and checks the rules
a grammar cannot say well (which items may stand on which side), so that each
error can quote the expression, point at the column and teach the syntax.

Nothing here knows about JAX.

Example:
    >>> from einshard.placement import parse_placement
    >>> e = parse_placement("a b -> a@data b")
    >>> e.output.items[0]
    AxisItem(name='a', count=None, star=False, mesh_axes=('data',), choose=False)
    >>> str(e)
    'a b -> a@data b'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ._expression import (
    AxisItem,
    EllipsisItem,
    Expression,
    Item,
    ReplicaItem,
    Side,
    format_name,
    is_count_item,
)
from ._grammar import cached_on_strings, parse

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

# check_placement and build_placement are for einshard's own layers (not in __all__): they take parsed objects
# from the parser, which is what they trust.

# ---------------------------------------------------------------------------
# Placement expressions: 'a b -> a4 b*' or 'a b -> a@data b'


@cached_on_strings
def parse_placement(text: str) -> Expression:
    """Parse and check a placement expression (one array, its axes, how they are laid out).

    The left side names the array's axes (and at most one ``...``); the right
    side lists each of them once, in the same order when ``@`` is used, each
    annotated with a count or with mesh axes.  Counts and ``@`` do not mix.

    Example:
        >>> str(parse_placement("a   b->a2* b"))
        'a b -> a2* b'
    """
    return check_placement(parse(text))


def build_placement(left: Sequence[Item], right: Sequence[Item]) -> Expression:
    """The placement ``left -> right`` built from parsed items, checked as :func:`parse_placement` checks it.

    Nothing is parsed: its text is its printed form and every column points into that text, as parsing the
    printed form would set them, so its errors quote and point exactly as the parsed expression's do.  It is how a
    layer that holds a parsed einsum side (or adds a ``*`` to a placement) makes a placement of it.

    Example:
        >>> e = parse_einsum("b x@data, x y -> b y")
        >>> str(build_placement([AxisItem(i.name) for i in e.inputs[0].axes], e.inputs[0].items))
        'b x -> b x@data'
    """
    left_text = " ".join(str(i) for i in left)
    arrow = len(left_text) + 1  # where '->' stands in "left -> right"; an empty side points there (as parse)
    return check_placement(
        Expression((_placed(left, 0, arrow),), _placed(right, arrow + 3, arrow), f"{left_text} -> " + _text(right))
    )


def _text(items: Sequence[Item]) -> str:
    return " ".join(str(i) for i in items)


def _placed(items: Sequence[Item], start: int, empty: int) -> Side:
    """A side of the items written from column ``start`` on, one space apart, each item's column its own."""
    placed: list[Item] = []
    column = start
    for item in items:
        placed.append(dataclasses.replace(item, column=column))
        column += len(str(item)) + 1
    return Side(tuple(placed), column=placed[0].column if placed else empty)


def check_placement(expr: Expression) -> Expression:
    """``expr`` (parsed) checked as a placement: one array, every axis once on each side, counts or ``@``.

    Returns ``expr`` itself; raises :class:`~einshard.errors.EinshardError` quoting it.
    """
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
        # In the user's own words: their counts and their '@' axes, quoted from the expression.
        counts = ", ".join(repr(str(i)) for i in right.items if is_count_item(i))
        named = ", ".join(repr(str(i)) for i in right.items if isinstance(i, AxisItem) and i.mesh_axes is not None)
        raise expr.fail(
            f"counts ({counts}) and mesh axes ({named}) do not mix in one expression: "
            "counts build an anonymous mesh of all devices, '@' uses your mesh",
            count_item.column,
            "Use one style: name a mesh axis with '@' for every split axis, or counts only.",
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


@cached_on_strings
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
