"""What every reader and writer shares: a pytree's leaves with their names, and the record a foreign rule set
is read into (:class:`ImportedRules`: einshard path rules, plus which foreign rule each leaf came from)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import PartitionSpec

from .._compat import dtype_itemsize, is_array_dtype
from ..core.layout import expand_names
from ..core.logical import AxisRules, resolve_expression
from ..errors import EinshardError
from ..parsing import format_name, parse_placement

__all__ = ["Leaf", "LeafMatch", "ImportedRules", "leaves_of", "leaf_pattern", "spec_expression", "Format"]

Format = Literal["einshard", "keras", "flax", "maxtext"]


@dataclass(frozen=True)
class Leaf:
    """One array of a pytree: its ``keystr`` path, its name as the frameworks write it (``'up/kernel'``),
    its shape and its size in bytes."""

    path: str
    name: str
    shape: tuple[int, ...]
    nbytes: int


def _key_text(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _is_nnx_variable(x: Any) -> bool:
    return type(x).__module__.startswith("flax.nnx") and hasattr(x, "get_metadata")


def leaves_of(tree: Any, argument: str = "params") -> tuple[Leaf, ...]:
    """The leaves of ``tree`` (arrays, ``ShapeDtypeStruct``s, Flax NNX variables), in flatten order.

    A leaf's name joins its keys with ``/`` (a dict keyed by Keras variable paths gives those paths back;
    an NNX state gives ``'up/kernel'``).  A leaf JAX cannot hold (strings, bytes, objects) is an error naming
    ``argument``: its layout would be read off an array no step can take.
    """
    out = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_nnx_variable)[0]:
        value = x.get_value() if _is_nnx_variable(x) and hasattr(x, "get_value") else x
        shape = tuple(int(s) for s in np.shape(value)) if not hasattr(value, "shape") else tuple(value.shape)
        dtype = getattr(value, "dtype", None) or np.asarray(value).dtype
        name = "/".join(_key_text(k) for k in path)
        if not is_array_dtype(dtype):  # bfloat16, int4, typed PRNG keys pass: NumPy calls ml_dtypes' kind 'V'
            raise EinshardError(
                f"{argument}=: the leaf {jax.tree_util.keystr(path) or '(the root)'} holds {dtype} values, "
                "which no JAX array holds (give arrays or jax.ShapeDtypeStructs of numbers)"
            )
        out.append(Leaf(jax.tree_util.keystr(path), name, shape, math.prod(shape) * dtype_itemsize(dtype)))
    return tuple(out)


def leaf_pattern(leaf: Leaf) -> str:
    """A path rule that matches this leaf alone: its ``keystr`` path, escaped and anchored (an NNX
    variable's ``.value`` suffix allowed, so the rule fits the state and its pure dict alike)."""
    return "^" + re.escape(leaf.path) + r"(\.value)?$"


def spec_expression(entries: Sequence[Any], rank: int, names: Sequence[str | None] | None = None) -> str:
    """The placement expression of a ``PartitionSpec``-like tuple of entries (None, a mesh axis, or a tuple
    of them; logical names work the same) for an array of ``rank``; axis names from ``names`` where they
    are usable, else ``a``, ``b``, ...

    Example:
        >>> spec_expression((None, 'model'), 2)
        'a b -> a b@model'
    """
    entries = list(entries)
    if len(entries) > rank:
        raise EinshardError(f"a layout of {len(entries)} entries ({tuple(entries)}) for an array of rank {rank}")
    entries += [None] * (rank - len(entries))
    axis_names = _axis_names(rank, names)
    left = " ".join(axis_names)
    right = []
    for name, entry in zip(axis_names, entries):
        if entry is None or entry == ():
            right.append(name)
        elif isinstance(entry, str):
            right.append(f"{name}@{entry}")
        else:
            group = tuple(entry)
            right.append(f"{name}@{group[0]}" if len(group) == 1 else f"{name}@(" + ",".join(group) + ")")
    return f"{left} -> {' '.join(right)}"


def _axis_names(rank: int, names: Sequence[str | None] | None) -> list[str]:
    letters = [chr(ord("a") + i) if i < 26 else f"{{x{i}}}" for i in range(rank)]
    if names is None:
        return letters
    chosen: list[str] = []
    for i, n in enumerate(names):
        text = format_name(n) if isinstance(n, str) and n and re.fullmatch(r"\w+", n) else None
        chosen.append(text if text is not None and text not in chosen else letters[i])
    # a letter may collide with a name used elsewhere: fall back to letters for all then
    return chosen if len(set(chosen)) == len(chosen) else letters


@dataclass(frozen=True)
class LeafMatch:
    """One leaf as a rule set lays it out.

    Attributes:
        leaf: the leaf.
        source: the foreign rule that gave its layout (a Keras regex, a Flax/MaxText logical annotation such
            as ``'embed mlp'``, an einshard path pattern), or None when no rule matched it (it is replicated).
        expression: its einshard placement expression, in mesh axes.
        spec: its ``PartitionSpec``.
    """

    leaf: Leaf
    source: str | None
    expression: str
    spec: PartitionSpec
    logical: tuple[str | None, ...] = ()

    def fallbacks(self, rules: AxisRules | None) -> tuple[str, ...]:
        """The logical names of this leaf left whole although a rule maps them to mesh axes: every such rule
        found its mesh axes taken by another dimension (Flax's silent fallback)."""
        if rules is None:
            return ()
        entries = tuple(self.spec) + (None,) * (len(self.logical) - len(tuple(self.spec)))
        return tuple(n for n, e in zip(self.logical, entries) if n is not None and e is None and any(rules.targets(n)))


@dataclass(frozen=True)
class ImportedRules:
    """A foreign rule set read for one pytree: einshard path rules for it, and where each leaf's came from.

    ``einshard.einshard(params, imported.rules, mesh=mesh)`` places the pytree as the framework would.

    Attributes:
        format: where the rules came from: ``'keras'``, ``'flax'``, ``'maxtext'`` or ``'einshard'``.
        rules: ordered ``{path pattern: expression}``, one pattern per leaf (anchored), in mesh axes.
        leaves: each leaf's :class:`LeafMatch`, in flatten order.
        sources: the foreign rules, in their order (those that match nothing included).
        axis_rules: the logical-axis table the layouts were resolved through, if any.
    """

    format: Format
    rules: dict[str, str]
    leaves: tuple[LeafMatch, ...]
    sources: tuple[str, ...] = ()
    axis_rules: AxisRules | None = field(default=None)

    @property
    def unmatched(self) -> tuple[LeafMatch, ...]:
        """The leaves no rule matched (replicated), largest first."""
        return tuple(sorted((m for m in self.leaves if m.source is None), key=lambda m: -m.leaf.nbytes))

    def matched_by(self, source: str) -> tuple[LeafMatch, ...]:
        return tuple(m for m in self.leaves if m.source == source)


def imported(
    fmt: Format,
    leaves: Sequence[Leaf],
    layouts: Sequence[tuple[str | None, str]],
    mesh: Sequence[str] | None,
    sources: Sequence[str],
    rules: AxisRules | None = None,
) -> ImportedRules:
    """The record for ``leaves`` given each one's (source, expression — logical names allowed): every
    expression resolved through ``rules`` by einshard's one resolver, checked against the mesh."""
    matches = []
    for leaf, (source, text) in zip(leaves, layouts, strict=True):
        try:
            written = parse_placement(text)
            expr = resolve_expression(written, mesh, rules) if rules is not None else written
            names = expand_names(written, len(leaf.shape))
        except EinshardError as err:
            raise EinshardError(
                f"{leaf.name} (shape {leaf.shape}, from {source!r}): {err.reason}", err.expression, err.column, err.hint
            ) from None
        for item in expr.output.axes:
            for m in item.mesh_axes or ():
                if mesh is not None and m not in mesh:
                    raise EinshardError(
                        f"{leaf.name} (shape {leaf.shape}, from {source!r}): mesh axis {m!r} is not an axis of the "
                        f"mesh (mesh axes: {', '.join(map(repr, mesh))})",
                        text,
                        item.column,
                    )
        # per dimension ('...' expanded): its mesh axes as resolved, and its logical name as written
        dims = {item.name: item.mesh_axes for item in expr.output.axes}
        named = {item.name: item.mesh_axes for item in written.output.axes}
        entries = [_entry(dims.get(n)) for n in names]
        logical = tuple(
            g[0] if g is not None and len(g) == 1 and rules is not None and g[0] in rules else None
            for g in (named.get(n) for n in names)
        )
        matches.append(LeafMatch(leaf, source, str(expr), PartitionSpec(*entries), logical))
    return ImportedRules(
        fmt, {leaf_pattern(m.leaf): m.expression for m in matches}, tuple(matches), tuple(sources), rules
    )


def _entry(axes: tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def as_names(names: Any, tree: Any) -> dict[str, Any]:
    """Per-leaf annotations given as a pytree like ``tree`` or as a mapping from leaf names (``'up/kernel'``)
    or ``keystr`` paths: ``{leaf path: annotation}``."""
    leaves = leaves_of(tree)
    if isinstance(names, Mapping) and all(isinstance(k, str) for k in names) and not _same_structure(names, tree):
        out = {}
        for leaf in leaves:
            for key in (leaf.name, leaf.path):
                if key in names:
                    out[leaf.path] = names[key]
                    break
        return out
    flat = jax.tree_util.tree_leaves(names, is_leaf=lambda x: isinstance(x, tuple) or x is None)
    if len(flat) != len(leaves):
        raise EinshardError(
            f"the per-leaf names have {len(flat)} entries but the pytree has {len(leaves)} leaves; give a "
            "pytree like it, or a mapping from leaf names ('up/kernel') to names"
        )
    return {leaf.path: n for leaf, n in zip(leaves, flat)}


def _same_structure(names: Any, tree: Any) -> bool:
    try:
        a = jax.tree_util.tree_structure(names, is_leaf=lambda x: isinstance(x, tuple) or x is None)
        b = jax.tree_util.tree_structure(tree, is_leaf=_is_nnx_variable)
        return bool(a == b)  # type: ignore[operator]
    except (TypeError, ValueError):  # a structure JAX cannot compare is not the same structure
        return False
