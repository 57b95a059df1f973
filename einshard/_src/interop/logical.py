"""Logical-axis rule sets as data (MaxText's ``logical_axis_rules``, Flax's rule lists): read, and write.

A logical layout is two tables: rules from logical names to mesh axes, and, per variable, the logical name
of each dimension (MaxText keeps those in its parameters' ``nn.with_logical_partitioning`` annotations).
:func:`from_logical` reads both, given as data (no MaxText import), into einshard path rules for a pytree,
resolving each name by einshard's one resolver (:mod:`einshard.core.logical`, Flax's precedence).
:func:`to_logical` writes einshard rules back as such a pair, for Flax (``nn.logical_axis_rules`` and
``nnx.with_partitioning``) or MaxText (its YAML lists).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any

from .._checks import naming
from ..core.logical import AxisRules, AxisRulesLike
from ..core.mesh import MeshLike
from ..errors import EinshardError
from ..tree_rules import Rules, leaf_expressions
from ._leaves import Format, ImportedRules, as_names, imported, leaves_of, spec_expression

__all__ = ["from_logical", "from_maxtext", "to_logical", "LogicalLayout", "logical_expression"]


def logical_expression(names: Any, rank: int) -> str:
    """The einshard expression of one variable's logical names, ``('embed', None, 'mlp')`` ->
    ``'embed b mlp -> embed@embed b mlp@mlp'`` (resolved later through the rules)."""
    if isinstance(names, str):
        names = (names,)
    if not isinstance(names, (tuple, list)) or not all(n is None or isinstance(n, str) for n in names):
        raise EinshardError(f"logical axis names are a tuple of names (or None), got {names!r}")
    if len(names) != rank:
        raise EinshardError(f"the logical names {tuple(names)} are {len(names)} for an array of rank {rank}")
    return spec_expression(tuple(names), rank, tuple(names))


def from_logical(
    axis_rules: AxisRulesLike,
    logical_axes: Any,
    params: Any,
    *,
    mesh: MeshLike | None = None,
    fmt: Format = "maxtext",
) -> ImportedRules:
    """Read a logical rule list and per-variable logical names into einshard path rules for ``params``.

    Args:
        axis_rules: ``[('batch', ('data', 'fsdp')), ('embed', 'fsdp'), ('mlp', 'tensor'), ...]`` (Flax pairs,
            MaxText's lists ``[['embed', ['fsdp', 'sequence']], ['norm', []]]`` or a dict).
        logical_axes: each variable's logical names: a pytree like ``params`` of tuples, or a mapping from
            variable names (``'decoder/mlp/wi'``) or ``keystr`` paths to tuples.  A variable without names
            is replicated (and listed as unmatched).
        params: the pytree (arrays or ``ShapeDtypeStruct``s).
        mesh: the mesh or its sizes; its axis names are checked (a rule naming an axis it lacks is an error:
            give such axes size 1, as MaxText does).
    """
    if fmt not in _FORMATS:
        raise EinshardError(f"from_logical: fmt= takes one of {', '.join(map(repr, _FORMATS))}, got {fmt!r:.60}")
    return _from_logical(AxisRules.of(axis_rules), logical_axes, params, mesh, fmt, "axis_rules")


_FORMATS: tuple[Format, ...] = typing.get_args(Format)


def _from_logical(
    table: AxisRules, logical_axes: Any, params: Any, mesh: MeshLike | None, fmt: Format, argument: str
) -> ImportedRules:
    """``argument``: the rule table's parameter name in errors (``axis_rules``, ``logical_axis_rules``)."""
    where = "from_maxtext" if fmt == "maxtext" else "from_logical"
    leaves = leaves_of(params)
    with naming(where, "logical_axes"):
        names_of = as_names(logical_axes, params)
    mesh_names = _mesh_names(mesh)
    layouts: list[tuple[str | None, str]] = []
    for leaf in leaves:
        names = names_of.get(leaf.path)
        if names is None:
            layouts.append((None, spec_expression((), len(leaf.shape))))
            continue
        try:
            text = logical_expression(names, len(leaf.shape))
        except EinshardError as err:  # the names given for this leaf: a logical_axes entry
            raise EinshardError(f"{where}: in logical_axes=, {leaf.name} (shape {leaf.shape}): {err.reason}") from None
        layouts.append((" ".join(str(n) for n in names), text))
    sources = tuple(dict.fromkeys(s for s, _ in layouts if s is not None))
    try:
        return imported(fmt, leaves, layouts, mesh_names, sources, table)
    except EinshardError as err:
        if "by the axis rules" not in err.reason:
            raise
        # a rule a variable reached maps to an axis the mesh lacks: the table is the argument at fault
        raise EinshardError(f"{where}: in {argument}=, {err.reason}", err.expression, err.column, err.hint) from None


def from_maxtext(
    logical_axis_rules: Any, logical_axes: Any, params: Any, *, mesh: MeshLike | None = None
) -> ImportedRules:
    """:func:`from_logical` for MaxText's ``logical_axis_rules`` as data (a list of ``[name, axes]``)."""
    table = AxisRules.of(logical_axis_rules, "logical_axis_rules")
    return _from_logical(table, logical_axes, params, mesh, "maxtext", "logical_axis_rules")


def _mesh_names(mesh: MeshLike | None) -> tuple[str, ...] | None:
    if mesh is None:
        return None
    from ..core.mesh import as_mesh

    return tuple(str(n) for n in as_mesh(mesh).axis_names)


@dataclass(frozen=True)
class LogicalLayout:
    """A layout as logical axis rules plus each variable's logical names (what Flax and MaxText read).

    Attributes:
        axis_rules: one rule per logical name (so the precedence never comes into play).
        names: variable name (``'up/kernel'``) -> the logical name of each dimension.
    """

    axis_rules: AxisRules
    names: dict[str, tuple[str, ...]]

    def flax_rules(self) -> list[tuple[str, str | tuple[str, ...] | None]]:
        """For ``flax.linen.logical_axis_rules(...)`` / ``nnx`` ``sharding_rules``: ``[(name, axes), ...]``."""
        return self.axis_rules.to_list()

    def maxtext(self) -> dict[str, Any]:
        """MaxText's YAML data: ``{'logical_axis_rules': [[name, [axes]]], 'logical_axes': {var: [names]}}``."""
        return {
            "logical_axis_rules": [[name, list(axes)] for name, axes in self.axis_rules.rules],
            "logical_axes": {path: list(names) for path, names in self.names.items()},
        }


def to_logical(rules: Rules, params: Any, mesh: MeshLike) -> LogicalLayout:
    """Write einshard path ``rules`` for ``params`` as logical rules and per-variable logical names.

    Each dimension is named after its axis in the rule's expression; where one name is laid out two ways in
    two variables, the second gets the mesh axes as a suffix (``f_model``, ``f_whole``).  Reading the result
    back (:func:`from_logical`, or Flax's ``logical_to_mesh_axes``) gives the same layouts.
    """
    from ..placement import layout

    table: dict[str, tuple[str, ...]] = {}
    names: dict[str, tuple[str, ...]] = {}
    for leaf, text in zip(leaves_of(params), leaf_expressions(params, rules)):
        if text is None:
            text = spec_expression((), len(leaf.shape))
        lay = layout(text, leaf.shape, mesh=mesh)
        mine: list[str] = []
        for axis, dims in zip(lay.axes, lay.dims):
            base = "dim" if axis.startswith("...") else axis
            mine.append(_name_for(base, tuple(dims), table, set(mine)))
        names[leaf.name] = tuple(mine)
    return LogicalLayout(AxisRules(tuple(table.items())), names)


def _name_for(base: str, dims: tuple[str, ...], table: dict[str, tuple[str, ...]], used: set[str]) -> str:
    candidates = [base, f"{base}_{'_'.join(dims) or 'whole'}"]
    candidates += [f"{candidates[1]}_{i}" for i in range(2, 100)]
    for name in candidates:
        if name in used:
            continue
        if name not in table:
            table[name] = dims
            return name
        if table[name] == dims:
            return name
    raise EinshardError(f"could not name the logical axis {base!r} laid out over {dims}")  # 100 layouts of one name
