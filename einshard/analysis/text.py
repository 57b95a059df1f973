"""What ``analyze`` reads from an expression's text alone, once per text (a model's layers repeat it): its
axes, annotations and axis classes, and each side's layout as written (what the checks of a layout ask of it).

Nothing here depends on a mesh or on sizes; ``analyze`` combines these facts with its arguments
(:func:`einshard.analysis.api._analyze_plain`).
"""

from __future__ import annotations

from typing import NamedTuple

from .._caches import cached
from ..core.layout import Layout
from ..parsing import Expression, parse_einsum
from .inputs import _einsum_text
from .rule import classify
from .strategy import pick_weight

__all__: list[str] = []


class _Prepared(NamedTuple):
    """What analyze reads from an expression's text, once per text (a model's layers repeat it)."""

    text: str  # the einshard text (a jnp.einsum string rewritten)
    jnp_style: bool
    parsed: Expression
    names: tuple[tuple[str, ...], ...]  # per operand: its axes
    dims: tuple[tuple[tuple[str, ...], ...], ...]  # per operand: its '@' annotations
    unreduced: tuple[frozenset[str], ...]  # per operand: its '{U:...}'
    unique: tuple[str, ...]  # every operand axis once, in order of first appearance
    out_names: tuple[str, ...]
    out_dims: tuple[tuple[str, ...], ...]
    out_unreduced: frozenset[str]
    classes: dict[str, str]  # classify(names, out_names): read, never written
    weight: int | None  # pick_weight's operand (it reads the axis names only)
    chosen: bool  # parsed.output_chosen
    has_own: tuple[bool, ...]  # per operand: whether its side annotates a layout ('@' or '{U:...}')
    unique_set: frozenset[str]
    sides: tuple[_Side, ...]  # per operand: its layout's facts as written (``_analyze_plain``)
    out_side: _Side
    plain: bool  # no '...', every output axis an operand's, no mesh axis named twice on a side
    any_own: bool  # some operand's side annotates a layout
    bare: bool  # the output side names no layout and is not chosen ('-> b y')
    mesh_names: frozenset[str]  # every mesh axis a side names (splits and pending sums)
    at: tuple[dict[str, str], ...]  # rule._splits_of the layouts as written, without the output's
    at_out: tuple[dict[str, str], ...]  # the same, then the output's
    kept: dict[str, tuple[str | None, ...]]  # rule.options of ``at`` per mesh axis named (a size > 1 assumed)
    kept_out: dict[str, tuple[str | None, ...]]  # the same of ``at_out``


class _Side(NamedTuple):
    """A side's layout as written: what :func:`_valid_layout` checks of it, read once from the text."""

    names: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]
    unreduced: frozenset[str]
    split: tuple[tuple[int, tuple[str, ...]], ...]  # (position, mesh axes) of each split dimension
    at: dict[str, str]  # rule._split_at of the layout: {mesh axis: the einsum axis it splits}; read, never written
    once: bool  # no mesh axis named twice (two splits, or a split and a pending sum)


def _side_of(names: tuple[str, ...], dims: tuple[tuple[str, ...], ...], unreduced: frozenset[str]) -> _Side:
    named = [m for d in dims for m in d]
    at = {m: name for name, d in zip(names, dims, strict=True) for m in d}
    once = len(set(named)) == len(named) and not unreduced & set(named)
    return _Side(names, dims, unreduced, tuple([(i, d) for i, d in enumerate(dims) if d]), at, once)


def _prepare(expr: str) -> _Prepared:
    if not isinstance(expr, str):
        _einsum_text(expr)  # raises: an expression is a string (and an unhashable one must not reach the cache)
    return _prepare_text(expr)


@cached(maxsize=4096)
def _prepare_text(expr: str) -> _Prepared:
    text = _einsum_text(expr)
    return _prepared_of(parse_einsum(text), text, text != expr)


def _prepared_of(parsed: Expression, text: str, jnp_style: bool) -> _Prepared:
    names = tuple([side.names for side in parsed.inputs])
    out = parsed.output
    classes = classify(names, out.names)
    dims = tuple([tuple([item.mesh_axes or () for item in side.axes]) for side in parsed.inputs])
    unreduced = tuple([frozenset(side.unreduced) for side in parsed.inputs])
    out_dims = tuple([item.mesh_axes or () for item in out.axes])
    has_own = tuple([bool(side.unreduced) or any(item.mesh_axes for item in side.axes) for side in parsed.inputs])
    unique_set = frozenset([n for side in names for n in side])
    sides = tuple([_side_of(n, d, u) for n, d, u in zip(names, dims, unreduced, strict=True)])
    out_side = _side_of(out.names, out_dims, frozenset(out.unreduced))
    plain = (
        not any(side.has_ellipsis for side in parsed.sides)
        and unique_set.issuperset(out.names)
        and all(side.once for side in (*sides, out_side))
    )
    return _Prepared(
        text,
        jnp_style,
        parsed,
        names,
        dims,
        unreduced,
        tuple(dict.fromkeys([n for side in names for n in side])),
        out.names,
        out_dims,
        frozenset(out.unreduced),
        classes,
        _weight_by_names(names, classes),
        parsed.output_chosen,
        has_own,
        unique_set,
        sides,
        out_side,
        plain,
        any(has_own),
        not any(out_dims) and not out.unreduced and not parsed.output_chosen,
        frozenset([m for side in (*sides, out_side) for d in side.dims for m in d])
        | frozenset().union(*[side.unreduced for side in (*sides, out_side)]),
        tuple([side.at for side in sides]),
        tuple([side.at for side in (*sides, out_side)]),
        _kept_by_mesh_axis([side.at for side in sides]),
        _kept_by_mesh_axis([side.at for side in (*sides, out_side)]),
    )


def _kept_by_mesh_axis(at: list[dict[str, str]]) -> dict[str, tuple[str | None, ...]]:
    """``rule.options`` of layouts split as ``at`` says, for each mesh axis they name (of size > 1): the einsum
    axes it splits, in order of first appearance, then None."""
    seen: dict[str, list[str]] = {}
    for where in at:
        for m, e in where.items():
            if e not in seen.setdefault(m, []):
                seen[m].append(e)
    return {m: (*es, None) for m, es in seen.items()}


def _weight_by_names(names: tuple[tuple[str, ...], ...], classes: dict[str, str]) -> int | None:
    """:func:`pick_weight` of operands with these axes (it reads nothing else of them: stand-ins of size 1)."""
    return pick_weight(
        tuple([Layout._derive(n, (1,) * len(n), (), ((),) * len(n), frozenset()) for n in names]), classes
    )
