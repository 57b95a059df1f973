"""Models einshard's authors did not design, for checking ``einshard.explain`` against XLA.

Each module builds a tiny model the way its library's users write one (Flax
NNX, Flax Linen, Equinox, plain ``jax.numpy``) and exposes a :class:`Case`:
the loss ``loss(params, batch)``, abstract parameters and batch, and the
layout rules (einshard path rules) of each strategy it supports.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax

__all__ = ["Case", "specs_for", "STRATEGIES", "transformer_case"]

# The strategies every model is laid out under, on a (data=4, model=2) mesh.
STRATEGIES = ("dp", "tp", "dp_tp", "fsdp", "vocab", "seq")


@dataclass(frozen=True)
class Case:
    """One model: its loss, abstract inputs and per-strategy rules (regex on the param path -> expression)."""

    name: str
    loss: Callable[[Any, Any], Any]
    params: Any  # a pytree of jax.ShapeDtypeStruct
    batch: Any  # a pytree of jax.ShapeDtypeStruct
    rules: dict[str, tuple[tuple[str, str], ...]]  # strategy -> ((path regex, expression), ...)
    batch_rules: dict[str, Any] = field(default_factory=dict)  # strategy -> expression(s) for the batch


_DATA = ("b s -> b@data s", "b s -> b@data s")  # (tokens, labels) split over the batch
_BATCH_RULES = {
    "dp": _DATA,
    "tp": ("b s -> b s", "b s -> b s"),
    "dp_tp": _DATA,
    "fsdp": _DATA,
    "vocab": _DATA,
    "seq": ("b s -> b@data s@model", "b s -> b@data s@model"),
}


def transformer_case(
    name: str,
    loss: Callable[[Any, Any], Any],
    params: Any,
    batch: Any,
    megatron: tuple[tuple[str, str], ...],
    vocab: tuple[tuple[str, str], ...],
    fsdp: tuple[tuple[str, str], ...] | None = None,
) -> Case:
    """A transformer's Case under DP, Megatron TP, DP×TP, a vocab-parallel head, sequence parallel (and FSDP).

    Only the path patterns differ between libraries (``'query'`` in Flax, ``.q.weight`` in Equinox...): each
    model gives its Megatron rules, its embedding/head rules, and FSDP rules where explain matches XLA.
    """
    rules = {"dp": (), "tp": megatron, "dp_tp": megatron, "vocab": (*megatron, *vocab), "seq": ()}
    if fsdp is not None:
        rules["fsdp"] = fsdp
    return Case(name, loss, params, batch, rules, {k: v for k, v in _BATCH_RULES.items() if k in rules})


def specs_for(case: Case, strategy: str) -> tuple[Any, Any]:
    """(param expressions, batch expressions) for one strategy: the first matching rule wins, else replicated."""
    rules = case.rules[strategy]

    def pick(path: Any, leaf: Any) -> str:
        key = jax.tree_util.keystr(path)
        rank = len(leaf.shape)
        for pattern, expr in rules:
            if re.search(pattern, key) and _rank_of(expr) == rank:
                return expr
        letters = " ".join("abcdefgh"[:rank])
        return f"{letters} -> {letters}"

    params = jax.tree_util.tree_map_with_path(pick, case.params)
    return params, case.batch_rules[strategy]


def _rank_of(expr: str) -> int:
    return len(expr.split("->")[0].split())
