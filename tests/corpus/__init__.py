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

__all__ = ["Case", "specs_for", "STRATEGIES"]

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
