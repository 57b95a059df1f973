"""A hand-written preset (``plan(presets=)``) as one of the search's assignments, where the candidates express it.

A preset the candidates can express is then what the built-in ``dp`` and ``fsdp`` are: a start of the search
(the descent begins from the hand layout as well as from its own starts) and a preset ``verify=`` compiles when
the model ranks it the best preset.  Without this a hand layout was only ever priced by the model: the compiler
never saw it, so ``verify=`` could not catch a plan that a hand layout beats in XLA's numbers.

A preset is expressible when every parameter group's leaves share one layout that is one of the group's
candidates (groups below 1 % of the parameter bytes have only the replicated one) and the data's layouts are one
of the batch's candidates.  Where one is not, it stays priced by the model alone (as before).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..core.layout import resolve_named
from ..errors import EinshardError
from ..parsing import parse_placement
from ..tree_rules import leaf_expressions
from .inputs import shape_of
from .scoring import Costs

__all__ = ["preset_assignment", "expressible_presets"]

Assign = tuple[int, ...]
# A PartitionSpec entry per tensor axis, each the tuple of mesh axes it is split over: ('data',) and 'data'
# and ('data', 'model') compare by what they split, not by how JAX spells them.
SplitAxes = tuple[tuple[str, ...], ...]


def _split_axes(spec: Any, rank: int) -> SplitAxes:
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _layouts(name: str, rules: Any, tree: Any, costs: Costs) -> list[SplitAxes]:
    """Each leaf of ``tree`` as the preset's rules lay it out, in ``tree_flatten`` order."""
    try:
        exprs = leaf_expressions(tree, rules)
    except EinshardError as err:
        raise EinshardError(f"preset {name!r}: {err}") from None
    out: list[SplitAxes] = []
    for expr, leaf in zip(exprs, jax.tree_util.tree_leaves(tree)):
        shape = shape_of(leaf)
        if expr is None:
            out.append(tuple(() for _ in shape))
            continue
        lay = resolve_named(parse_placement(expr), shape, costs.traced.mesh)
        out.append(_split_axes(lay.spec_entries(), len(shape)))
    return out


def preset_assignment(
    name: str,
    prules: Mapping[str, str] | str,
    pdata: Mapping[str, str] | str | Sequence[Mapping[str, str] | str],
    costs: Costs,
) -> Assign | None:
    """The assignment that lays everything out as the preset does, or None where no assignment does."""
    args, p_idx, d_idx = costs.args, costs.p_idx, costs.d_idx
    params = [lay for i in p_idx for lay in _layouts(name, prules, args[i], costs)]
    data_list = [pdata] * len(d_idx) if isinstance(pdata, (Mapping, str)) else list(pdata)
    data = [lay for k, i in enumerate(d_idx) for lay in _layouts(name, data_list[k], args[i], costs)]
    assign: list[int] = []
    for g in costs.groups:
        wanted = {params[i] for i in g.leaves}
        if len(wanted) != 1:
            return None
        (layout,) = wanted
        hit = next((c for c, cand in enumerate(g.candidates) if _split_axes(cand.dims, len(layout)) == layout), None)
        if hit is None:
            return None
        assign.append(hit)
    for b in range(len(costs.batch.candidates)):
        _, specs = costs.specs((*assign, b))
        ranks = [len(shape_of(x)) for i in d_idx for x in jax.tree_util.tree_leaves(args[i])]
        flat = jax.tree_util.tree_leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))
        if [_split_axes(s, r) for s, r in zip(flat, ranks)] == data:
            return (*assign, b)
    return None


def expressible_presets(
    presets: Mapping[str, tuple[Any, Any]], costs: Costs
) -> tuple[dict[str, Assign], tuple[str, ...]]:
    """(name -> assignment for each preset the candidates express, the names of those they do not)."""
    found: dict[str, Assign] = {}
    missed: list[str] = []
    for name, (prules, pdata) in presets.items():
        assign = preset_assignment(name, prules, pdata, costs)
        if assign is None:
            missed.append(name)
        else:
            found[name] = assign
    return found, tuple(missed)
