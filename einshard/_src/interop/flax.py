"""Flax NNX: read variables' logical sharding metadata (``nnx.with_partitioning``) with a logical rule list.

Flax 0.12 keeps each variable's logical names as its ``out_sharding`` metadata (``sharding_names`` and
``sharding`` in earlier releases) and resolves them through the rules current under
``flax.linen.logical_axis_rules`` (or a variable's own ``sharding_rules``).  :func:`from_nnx` reads the same
metadata and resolves it through einshard's one resolver (Flax's ``logical_to_mesh_axes`` precedence: for a
rule set with one rule per name, what ``nnx.get_named_sharding`` gives).  Writing goes through
:func:`einshard.interop.to_logical`: its ``flax_rules()`` and per-variable names are what
``nnx.with_partitioning`` and ``nn.logical_axis_rules`` take.
"""

from __future__ import annotations

from typing import Any

from ..core.logical import AxisRules, AxisRulesLike, current_axis_rules
from ..core.mesh import MeshLike
from ..errors import EinshardError
from ._leaves import ImportedRules, leaves_of
from .logical import from_logical

__all__ = ["from_nnx", "nnx_names"]

_METADATA_KEYS = ("out_sharding", "sharding_names", "sharding")


def _variables(model_or_state: Any) -> Any:
    from flax import nnx

    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    if not isinstance(model_or_state, nnx.State):
        raise EinshardError(
            f"model_or_state= takes an nnx.Module or an nnx.State (their variables carry the logical names), got "
            f"{type(model_or_state).__name__} {model_or_state!r:.60}"
        )
    return model_or_state


def nnx_names(model_or_state: Any) -> dict[str, tuple[str | None, ...] | None]:
    """Each variable's logical names from its metadata, keyed by variable name (``'up/kernel'``); None for
    a variable without any."""
    from flax import nnx

    state = _variables(model_or_state)
    out: dict[str, tuple[str | None, ...] | None] = {}
    import jax

    flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    for leaf, (_, var) in zip(leaves_of(state), flat):
        meta = var.get_metadata() if isinstance(var, nnx.Variable) else {}
        names = next((meta[k] for k in _METADATA_KEYS if meta.get(k)), None)
        out[leaf.name] = None if names is None else tuple(None if n is None else str(n) for n in names)
    return out


def from_nnx(
    model_or_state: Any, axis_rules: AxisRulesLike | None = None, *, mesh: MeshLike | None = None
) -> ImportedRules:
    """Read an NNX model's (or state's) sharding metadata, with a logical rule list, into einshard path rules.

    Args:
        model_or_state: an ``nnx.Module`` (its ``nnx.Param`` variables are read) or an ``nnx.State``.
        axis_rules: the logical rules (Flax's list of pairs or a dict); default the rules current under
            ``flax.linen.logical_axis_rules``, else einshard's current ``axis_rules``.
        mesh: the mesh or its sizes (axis names are checked).

    The rules returned match the state's paths and its pure dict's alike
    (``nnx.to_pure_dict(nnx.state(model))``).
    """
    state = _variables(model_or_state)
    table = _rules(axis_rules)
    names = nnx_names(state)
    return from_logical(table, {k: v for k, v in names.items() if v is not None}, state, mesh=mesh, fmt="flax")


def _rules(axis_rules: AxisRulesLike | None) -> AxisRules:
    if axis_rules is not None:
        return AxisRules.of(axis_rules)
    from flax.core import spmd

    current = spmd.get_logical_axis_rules()
    if current:
        return AxisRules.of(list(current))
    mine = current_axis_rules()
    if mine is None:
        raise EinshardError(
            "from_nnx needs the logical rules: pass axis_rules=, or call it inside flax.linen.logical_axis_rules(...) "
            "or einshard.axis_rules(...)"
        )
    return mine
