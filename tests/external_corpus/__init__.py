"""An external corpus: models published by libraries nobody on einshard wrote, for checking explain and plan.

Each family module builds a tiny model with its library's own layers, random init, nothing downloaded, and
exposes ``build() -> Family``: a loss ``loss(params, batch)``, concrete parameters and batch, and hand layouts
(einshard path rules) per strategy.  :mod:`.cases` is the registry of (family, strategy, mode, mesh kind) cases;
:mod:`.compare` measures one case against XLA's compiled HLO; :mod:`.table` writes the match table.

Libraries (none of them used by tests/corpus): keras-hub (Llama, Mixtral, T5, ResNet backbones), Keras 3's own
layers (a ViT), dm-haiku (``hk.layer_stack`` + ``hk.remat``), Equinox (rotary attention, a GRU over time) and Flax
linen (``nn.scan`` of ``nn.remat`` blocks, a convolutional net), Flax NNX (a GPT-style decoder, an ``nnx.scan``
stack, and their AdamW training steps), keras-hub's GPT-2 and Gemma, Equinox's BERT-like encoder and MLP-Mixer;
session 16's probe of unseen models (unseen_models.py): an Equinox depthwise conv, Flax BatchNorm (clip + masked
AdamW step), LSTM and encoder-decoder (Adafactor step), keras-hub BERT and Mistral.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402

__all__ = ["Family", "specs_for", "unique_keys"]

# The mesh every case runs on: (data=4, model=2), as tests/corpus.
MESH_SHAPE = (4, 2)
MESH_AXES = ("data", "model")


@dataclass(frozen=True)
class Family:
    """One model: its loss, concrete inputs and per-strategy hand layouts."""

    name: str
    library: str  # who published the layers: 'keras-hub', 'keras', 'dm-haiku'
    kind: str  # what the issue asks for: 'conv', 'moe', 'rotary-gqa', 'enc-dec', 'scan-remat', 'vit'
    loss: Callable[[Any, Any], Any]
    params: Any  # a pytree of concrete arrays (random init)
    batch: Any  # a pytree of concrete arrays
    rules: dict[str, tuple[tuple[str, str], ...]]  # strategy -> ((param path regex, expression), ...)
    batch_rules: dict[str, Any]  # strategy -> expression(s) for the batch, the batch's tree structure
    # A whole training step ``step((params, opt_state), batch) -> (params, opt_state)`` (an optimizer update),
    # for the families that have one: the 'step' mode plans it, the optimizer state laid out by the same rules.
    step: Callable[[Any, Any], Any] | None = None
    opt_state: Any = None


def specs_for(family: Family, strategy: str, tree: Any = None) -> tuple[Any, Any]:
    """(param expressions, batch expressions): the first rule whose regex and rank match wins, else replicated.

    ``tree`` (default the family's parameters) is what the rules lay out: ``(params, opt_state)`` for a training
    step, whose moments carry the parameters' names in their paths and so take the parameters' layouts.
    """
    rules = family.rules[strategy]

    def pick(path: Any, leaf: Any) -> str:
        key = jax.tree_util.keystr(path)
        rank = len(leaf.shape)
        for pattern, expr in rules:
            if re.search(pattern, key) and len(expr.split("->")[0].split()) == rank:
                return expr
        letters = " ".join("abcdefgh"[:rank])
        return f"{letters} -> {letters}"

    laid_out = family.params if tree is None else tree
    return jax.tree_util.tree_map_with_path(pick, laid_out), family.batch_rules[strategy]


def unique_keys(paths: list[str]) -> list[str]:
    """Keras variable paths made unique (keras-hub's T5 names both relative-position tables alike)."""
    seen: dict[str, int] = {}
    out = []
    for p in paths:
        n = seen.get(p, 0)
        seen[p] = n + 1
        out.append(p if n == 0 else f"{p}#{n}")
    return out
