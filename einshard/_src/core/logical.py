"""Logical axis names: the one resolver that turns ``b@batch`` into the mesh axes a rules table gives ``batch``.

Flax, MaxText, Keras and most JAX model code lay models out through a table from *logical* axis names
(``'batch'``, ``'embed'``, ``'mlp'``) to mesh axes.  einshard reads the same tables: after ``@`` an
expression may name a logical axis instead of a mesh axis, resolved through the :class:`AxisRules` given as
``axis_rules=`` to any function that takes a mesh, or made current with ``with einshard.axis_rules(...)``.

Precedence, per array (one side of an expression), as Flax's ``logical_to_mesh_axes``:

1. A name that is a mesh axis is that mesh axis (expressions without logical names mean what they always
   meant).  A name that is both a mesh axis and a rule whose mesh axes are not just itself is ambiguous: an
   error.
2. The mesh axes named directly on the side are taken first.
3. The rules are then read in order; a rule applies to the side's dimension of that logical name when the
   dimension is still unassigned and none of the rule's mesh axes is taken (by a direct name or an earlier
   rule).  A name may have several rules (the list form), tried in order: the first whose mesh axes are free
   wins.
4. A logical name whose every rule finds its mesh axes taken is replicated (Flax's fallback), as is one whose
   rule maps it to ``None``.
5. A name that is neither a mesh axis nor a logical name is an :class:`~einshard.errors.EinshardError` naming
   both tables and pointing at the column.

The rules are read when an expression is resolved against a mesh: eagerly at the call, and under
``jax.jit`` at trace time (as Flax's ``logical_axis_rules``: a function already traced keeps the layout the
rules gave when it was traced).

Example:
    >>> from einshard._src.core.logical import AxisRules, resolve_side_names
    >>> rules = AxisRules.of({'batch': ('data', 'fsdp'), 'embed': None, 'mlp': 'model'})
    >>> resolve_side_names((('batch',), ('embed',), ('mlp',)), rules, ('data', 'fsdp', 'model'))
    (('data', 'fsdp'), (), ('model',))
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import EinshardError

__all__ = [
    "AxisRules",
    "AxisRulesLike",
    "axis_rules",
    "current_axis_rules",
    "scoped_axis_rules",
    "takes_axis_rules",
    "logical_to_mesh",
    "resolve_side_names",
    "resolve_expression",
    "resolve_text",
]

# One rule: a logical name and the mesh axes it maps to (major to minor; () is replicated).
Rule = tuple[str, tuple[str, ...]]


@dataclass(frozen=True)
class AxisRules:
    """An ordered table from logical axis names to mesh axes (immutable and hashable: it keys caches).

    Attributes:
        rules: ``(logical name, mesh axes)`` pairs in priority order; ``()`` maps a name to no mesh axis
            (replicated).  A name may appear more than once (Flax's list form): the first rule whose mesh
            axes are free wins.
    """

    rules: tuple[Rule, ...]

    @staticmethod
    def of(table: AxisRulesLike, argument: str = "axis_rules") -> AxisRules:
        """A rules table from what users write: a dict ``{'batch': ('data', 'fsdp'), 'embed': None}``, Flax's
        list of pairs ``[('batch', 'data'), ('batch', None)]`` (MaxText's lists ``[['embed', ['fsdp']]]`` too),
        or an :class:`AxisRules`.  ``argument``: the parameter's name in errors (``logical_axis_rules`` for
        ``from_maxtext``)."""
        if isinstance(table, AxisRules):
            return table
        if isinstance(table, Mapping):
            pairs: list[Any] = list(table.items())
        elif isinstance(table, (list, tuple)):
            pairs = list(table)
        else:
            raise EinshardError(
                f"{argument}= takes a dict {{logical name: mesh axes}} or a list of (logical name, mesh axes) "
                f"pairs, got {type(table).__name__}: {table!r:.80}"
            )
        return AxisRules(tuple(_rule(pair, argument) for pair in pairs))

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The logical names, each once, in first-rule order (computed once: every resolution reads it)."""
        return tuple(dict.fromkeys(name for name, _ in self.rules))

    @functools.cached_property
    def _targets(self) -> dict[str, tuple[tuple[str, ...], ...]]:
        out: dict[str, list[tuple[str, ...]]] = {}
        for name, axes in self.rules:
            out.setdefault(name, []).append(axes)
        return {name: tuple(axes) for name, axes in out.items()}

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is a logical name of this table."""
        return name in self._targets

    def targets(self, name: str) -> tuple[tuple[str, ...], ...]:
        """The mesh axes of each rule for ``name``, in priority order."""
        return self._targets.get(name, ())

    def to_list(self) -> list[tuple[str, str | tuple[str, ...] | None]]:
        """Flax's form: ``[(name, None | 'axis' | ('a', 'b')), ...]``."""
        return [(n, None if not a else a[0] if len(a) == 1 else a) for n, a in self.rules]

    def __str__(self) -> str:
        return "{" + ", ".join(f"{n!r}: {_show_axes(a)}" for n, a in self.rules) + "}"


AxisRulesLike = AxisRules | Mapping[str, Any] | Sequence[Any]


def _show_axes(axes: tuple[str, ...]) -> str:
    return "None" if not axes else repr(axes[0]) if len(axes) == 1 else repr(axes)


def _rule(pair: Any, argument: str) -> Rule:
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise EinshardError(f"{argument}=: a rule is a (logical name, mesh axes) pair, got {pair!r}")
    name, target = pair
    if not isinstance(name, str) or not name:
        raise EinshardError(f"{argument}=: a logical name is a non-empty string, got {name!r} (in {pair!r})")
    if target is None:
        return name, ()
    if isinstance(target, str) and target:
        return name, (target,)
    if isinstance(target, (tuple, list)) and all(isinstance(m, str) and m for m in target):
        if len(set(target)) != len(target):
            raise EinshardError(f"{argument}=: the rule for {name!r} names a mesh axis twice: {tuple(target)}")
        return name, tuple(target)
    raise EinshardError(
        f"{argument}=: logical name {name!r} maps to {target!r}; a rule's mesh axes are None, a mesh axis name, "
        "or a tuple of them"
    )


# ---------------------------------------------------------------------------
# The current table: `with einshard.axis_rules(...)`, and axis_rules= for one call

_CURRENT: contextvars.ContextVar[AxisRules | None] = contextvars.ContextVar("einshard_axis_rules", default=None)


def current_axis_rules() -> AxisRules | None:
    """The table made current by :func:`axis_rules` (or by a call's ``axis_rules=``), or None."""
    return _CURRENT.get()


@contextlib.contextmanager
def axis_rules(table: AxisRulesLike | None) -> Iterator[AxisRules | None]:
    """Make a logical-axis table current for the block: every expression resolved inside reads it.

    ``None`` turns logical names off for the block.  Nested blocks replace (do not merge) the outer table.

    Example:
        >>> import einshard
        >>> with einshard.axis_rules({'batch': 'data', 'embed': None}):
        ...     print(tuple(einshard.spec('b d -> b@batch d@embed', (8, 4), mesh={'data': 4})))
        ('data', None)
    """
    rules = None if table is None else AxisRules.of(table)
    token = _CURRENT.set(rules)
    try:
        yield rules
    finally:
        _CURRENT.reset(token)


def scoped_axis_rules(table: AxisRulesLike | None) -> contextlib.AbstractContextManager[Any]:
    """The context a call with ``axis_rules=table`` runs in: that table, or (None) the current one unchanged."""
    return contextlib.nullcontext() if table is None else axis_rules(table)


F = TypeVar("F", bound=Callable[..., Any])


def takes_axis_rules(*, binds_result: bool = False) -> Callable[[F], F]:
    """Decorate a public function that declares ``axis_rules: AxisRulesLike | None = None``: the table is
    current while the function runs.  ``binds_result``: the function returns a function (a loss to
    differentiate), which gets the table made current each time it is called (traced), too."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            table = kwargs.get("axis_rules")
            if table is None:
                return fn(*args, **kwargs)
            rules = AxisRules.of(table)
            with axis_rules(rules):
                result = fn(*args, **kwargs)
            if binds_result and callable(result):
                return _bound(result, rules)
            return result

        return call  # type: ignore[return-value]

    return wrap


def _bound(fn: Callable[..., Any], rules: AxisRules) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with axis_rules(rules):
            return fn(*args, **kwargs)

    return call


# ---------------------------------------------------------------------------
# Flax's algorithm, on names only


def logical_to_mesh(
    dims: Sequence[str | None], rules: AxisRules, taken: frozenset[str] = frozenset()
) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of each dimension of one array whose dimensions carry logical names (None: no name).

    ``taken``: mesh axes the array already uses (named directly).  Rules are read in order; a rule applies
    when its dimension is unassigned and its mesh axes are free; what stays unassigned is replicated.
    """
    named = [d for d in dims if d is not None]
    if len(set(named)) != len(named):
        dup = next(d for d in named if named.count(d) > 1)
        raise EinshardError(f"logical axis {dup!r} names two dimensions of one array")
    result: list[tuple[str, ...] | None] = [None if d is not None else () for d in dims]
    used = set(taken)
    position = {d: i for i, d in enumerate(dims) if d is not None}
    for name, axes in rules.rules:
        i = position.get(name)
        if i is None or result[i] is not None or used.intersection(axes):
            continue
        result[i] = axes
        used.update(axes)
    return tuple(() if r is None else r for r in result)


def resolve_side_names(
    names: Sequence[tuple[str, ...] | None], rules: AxisRules | None, mesh: Sequence[str] | None
) -> tuple[tuple[str, ...] | None, ...]:
    """Each dimension's names after ``@`` (None: no ``@``) resolved to mesh axes; the names-only core.

    Raises a bare :class:`EinshardError` with the index of the offending dimension in ``.column``
    (:func:`resolve_expression` turns it into the expression's column).
    """
    is_mesh = (lambda n: n in mesh) if mesh is not None else (lambda n: rules is None or n not in rules)
    logical: list[str | None] = []
    taken: set[str] = set()
    for i, group in enumerate(names):
        if group is None or all(is_mesh(n) for n in group):
            for n in group or ():
                if rules is not None and mesh is not None and n in rules:
                    if any(t != (n,) for t in rules.targets(n)):
                        raise EinshardError(
                            f"{n!r} is both a mesh axis and a logical axis name (axis rules: {n!r} -> "
                            f"{', '.join(_show_axes(t) for t in rules.targets(n))}): which one is meant is ambiguous",
                            column=i,
                            hint="Rename the logical axis in the rules, or map it to itself.",
                        )
            logical.append(None)
            taken.update(group or ())
            continue
        if len(group) > 1:
            raise EinshardError(
                "a logical axis name stands alone after '@' (its rule says which mesh axes, in which order): "
                f"{'(' + ','.join(group) + ')'}",
                column=i,
                hint="Write b@batch with a rule for 'batch', or name mesh axes only: b@(data,fsdp).",
            )
        (name,) = group
        if rules is None or name not in rules:
            raise EinshardError(_unknown(name, rules, mesh), column=i, hint=_suggest(name, rules, mesh))
        logical.append(name)
    resolved = logical_to_mesh(logical, rules, frozenset(taken)) if rules is not None else ()
    out: list[tuple[str, ...] | None] = []
    for i, group in enumerate(names):
        if logical[i] is None:
            out.append(group)
            continue
        axes = resolved[i]
        missing = [m for m in axes if mesh is not None and m not in mesh]
        if missing:
            raise EinshardError(
                f"logical axis {logical[i]!r} maps to {_show_axes(axes)} by the axis rules, but {missing[0]!r} is "
                f"not an axis of the mesh (mesh axes: {', '.join(map(repr, mesh or ()))})",
                column=i,
                hint="Give the mesh that axis (size 1 is fine), or change the rule.",
            )
        out.append(axes)
    return tuple(out)


def _unknown(name: str, rules: AxisRules | None, mesh: Sequence[str] | None) -> str:
    mesh_text = ", ".join(map(repr, mesh)) if mesh is not None else "no mesh given"
    rule_text = ", ".join(map(repr, rules.names)) if rules is not None and rules.names else "none are set"
    return f"{name!r} is neither a mesh axis (mesh axes: {mesh_text}) nor a logical axis name (axis rules: {rule_text})"


def _suggest(name: str, rules: AxisRules | None, mesh: Sequence[str] | None) -> str:
    import difflib

    options = [*(mesh or ()), *(rules.names if rules is not None else ())]
    close = difflib.get_close_matches(name, options, n=1)
    how = "Pass axis_rules={...} or use `with einshard.axis_rules(...)` to name logical axes."
    return (f"Did you mean {close[0]!r}? " if close else "") + how


# ---------------------------------------------------------------------------
# On parsed expressions and on text


def resolve_expression(expr: Any, mesh: Sequence[str] | None, rules: AxisRules | None = None) -> Any:
    """``expr`` (a parsed :class:`~einshard.parsing.Expression`) with every logical name after ``@`` replaced
    by its mesh axes, side by side; the same object when there is nothing to resolve.

    ``rules`` defaults to the current table; ``mesh`` is the mesh's axis names (None: not known, then a name
    that is a rule is logical and any other is taken for a mesh axis).  Columns and the original text are
    kept, so later errors still point into what the user wrote.
    """
    from ..parsing import AxisItem

    rules = rules if rules is not None else current_axis_rules()
    if rules is None:
        return expr  # no logical names: the mesh-axis checks downstream say what is wrong with a name
    sides = []
    changed = False
    for side in expr.sides:
        items = [i for i in side.items if isinstance(i, AxisItem)]
        if not any(i.mesh_axes for i in items):
            sides.append(side)
            continue
        try:
            resolved = resolve_side_names([i.mesh_axes for i in items], rules, mesh)
        except EinshardError as err:
            column = _names_column(expr.text, items[err.column].column) if err.column is not None else None
            raise expr.fail(err.reason, column, err.hint) from None
        if all(r == i.mesh_axes for r, i in zip(resolved, items)):
            sides.append(side)
            continue
        new = dict(zip((id(i) for i in items), resolved))
        changed = True
        sides.append(
            dataclasses.replace(
                side,
                items=tuple(
                    dataclasses.replace(i, mesh_axes=new[id(i)] or None) if id(i) in new else i for i in side.items
                ),
            )
        )
    if not changed:
        return expr
    return dataclasses.replace(expr, inputs=tuple(sides[:-1]), output=sides[-1])


def _names_column(text: str, column: int) -> int:
    """The column of the names after ``@`` of the axis that starts at ``column`` (the axis itself if unknown)."""
    at = text.find("@", column) if text and column >= 0 else -1
    return at + 1 if at >= 0 and not text[column:at].strip(" {}").count(" ") else column


def resolve_text(text: Any, mesh: Sequence[str] | None, rules: AxisRules | None = None) -> Any:
    """An expression string with its logical names resolved (re-written); the text itself when there are
    none, no rules are given or current, or it names no axes after ``@`` (the hot path: one context-variable
    read).  For the functions whose caches are keyed on the text (einsums); placements resolve the parsed
    expression in :func:`~einshard.core.layout.resolve_named`."""
    rules = rules if rules is not None else current_axis_rules()
    if rules is None or not isinstance(text, str) or "@" not in text:
        return text
    from ..parsing import parse

    expr = parse(text)
    resolved = resolve_expression(expr, mesh, rules)
    return text if resolved is expr else str(resolved)
