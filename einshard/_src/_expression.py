"""The parsed form of an einshard expression: frozen :class:`Expression`, :class:`Side` and items (private).

Import these from :mod:`einshard.parsing`.  Nothing here knows about JAX or the grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .errors import EinshardError

__all__ = ["AxisItem", "ReplicaItem", "EllipsisItem", "Item", "Side", "Expression", "format_name", "is_count_item"]


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

    def __post_init__(self) -> None:
        # Read for every analysis of the expression: kept once, beside the fields (not fields: equality,
        # repr and replace() see the items alone).
        axes = tuple([i for i in self.items if isinstance(i, AxisItem)])
        object.__setattr__(self, "_axes", axes)
        object.__setattr__(self, "_names", tuple([i.name for i in axes]))

    @property
    def axes(self) -> tuple[AxisItem, ...]:
        """The named axes, in order."""
        return self._axes  # type: ignore[attr-defined,no-any-return]

    @property
    def names(self) -> tuple[str, ...]:
        return self._names  # type: ignore[attr-defined,no-any-return]

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

    def __hash__(self) -> int:
        # Caches are keyed on the parsed expression (it travels instead of its text): hashed once, on first use, as
        # str keeps its hash, not field by field on every lookup.
        try:
            return self._hash  # type: ignore[attr-defined,no-any-return]
        except AttributeError:
            value = hash((self.inputs, self.output))
            object.__setattr__(self, "_hash", value)
            return value

    def __reduce__(self) -> tuple[type[Expression], tuple[tuple[Side, ...], Side, str]]:
        # Rebuilt through __init__, so the hash is this process's (str hashes differ between processes).
        return (Expression, (self.inputs, self.output, self.text))

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
    if not isinstance(item, (AxisItem, EllipsisItem)):
        raise EinshardError(f"is_count_item: item= takes an item of a parsed expression, got {type(item).__name__}")
    return isinstance(item, AxisItem) and (item.count is not None or item.star)


_PLAIN_NAME = re.compile(r"[^\W\d]+")


def format_name(name: str) -> str:
    """Write an axis name as the grammar reads it: bare if it is letters and '_', else in braces."""
    if name.__class__ is not str or not name:
        raise EinshardError(f"format_name: name= takes a non-empty axis name (a string), got {name!r:.60}")
    return name if _PLAIN_NAME.fullmatch(name) else "{" + name + "}"
