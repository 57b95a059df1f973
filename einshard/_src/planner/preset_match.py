"""A hand-written preset (``plan(presets=)``) as one of the search's assignments, where the candidates express it.

A preset the candidates can express is then what the built-in ``dp`` and ``fsdp`` are: a start of the search
(the descent begins from the hand layout as well as from its own starts) and a preset ``verify=`` compiles when
the model ranks it the best preset.  Without this a hand layout was only ever priced by the model: the compiler
never saw it, so ``verify=`` could not catch a plan that a hand layout beats in XLA's numbers.

A preset is expressible when every parameter group's leaves share one layout that is one of the group's
candidates and the data's layouts are one of the batch's candidates.  A layout a preset gives all of a group's
leaves becomes one of its candidates first (:func:`admit_preset_layouts`): groups below 1 % of the parameter
bytes have only the replicated candidate, and a Megatron hand layout splits the biases with their kernels.
Where a preset still is not expressible, it stays priced by the model alone (as before).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from ..core.layout import resolve_named
from ..errors import EinshardError
from ..parsing import parse_placement
from ..tree_rules import leaf_expressions
from .groups import Candidate
from .inputs import shape_of
from .scoring import Costs

__all__ = ["preset_assignment", "expressible_presets", "admit_preset_layouts"]

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


def _param_layouts(name: str, prules: Any, costs: Costs) -> list[SplitAxes]:
    return [lay for i in costs.p_idx for lay in _layouts(name, prules, costs.args[i], costs)]


def admit_preset_layouts(presets: Mapping[str, tuple[Any, Any]], costs: Costs) -> None:
    """Each layout a preset gives every leaf of a group becomes one of the group's candidates (in place: the
    search's groups are ``costs.groups``), so the preset is an assignment and the search can move from it."""
    for name, (prules, _) in presets.items():
        params = _param_layouts(name, prules, costs)
        for k, g in enumerate(costs.groups):
            wanted = {params[i] for i in g.leaves}
            if len(wanted) != 1:
                continue
            (layout,) = wanted
            if not any(_split_axes(c.dims, len(layout)) == layout for c in g.candidates):
                costs.groups[k] = dataclasses.replace(g, candidates=(*g.candidates, Candidate(layout)))


def preset_assignment(
    name: str,
    prules: Mapping[str, str] | str,
    pdata: Mapping[str, str] | str | Sequence[Mapping[str, str] | str],
    costs: Costs,
) -> Assign | None:
    """The assignment that lays everything out as the preset does, or None where no assignment does."""
    args, d_idx = costs.args, costs.d_idx
    params = _param_layouts(name, prules, costs)
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
