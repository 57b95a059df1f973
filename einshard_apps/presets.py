"""Layout presets: a parallelism written as a handful of einshard expressions.

A :class:`Preset` maps parameter path patterns to placement expressions and
says how the batch is laid out; ``PRESETS`` is the registry ``einshard demo
--layout`` chooses from.  The demo's presets name two mesh axes, ``data`` and
``model``; each gives the mesh shape it wants for ``n`` devices (``--mesh``
overrides it).

A preset is trained by ``jax.jit`` with the layouts as in/out shardings (XLA's
SPMD partitioner inserts the collectives) unless it brings its own
``step_builder``: the seam where presets whose step is an explicit
``shard_map`` program (asynchronous tensor parallelism, pipelines) plug in.

Rules files (``--rules FILE``) write a preset by hand, as JSON::

    {"mesh": "data=4,model=2",
     "batch": "b s -> b@data s",
     "params": {"w[qkv]": "l d h k -> l d h@model k", ".*": "... -> ..."}}

or as ``pattern: expression`` lines (``#`` starts a comment; ``mesh`` and
``batch`` are reserved names; every other line is a parameter rule, tried in
order, the first whose regular expression is found in the parameter's path
wins)::

    mesh: data=4,model=2
    batch: b s -> b@data s
    w[qkv]: l d h k -> l d h@model k
    .*: ... -> ...

Example:
    >>> from einshard_apps.presets import PRESETS, expressions_for
    >>> PRESETS['hybrid'].default_mesh(8)
    {'data': 4, 'model': 2}
    >>> expressions_for({'attn': {'wo': 0}}, PRESETS['tp'].params)
    {'attn': {'wo': 'l h k d -> l h@model k d'}}
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax

from einshard._src.tree_rules import leaf_expressions, read_rules_file
from einshard.errors import EinshardError

__all__ = [
    "Preset",
    "PRESETS",
    "register",
    "load_rules",
    "parse_mesh",
    "expressions_for",
    "StepBuilder",
]

# How a preset's training step is built:
#   step_builder(loss_fn, optimizer, state_shardings, batch_sharding, mesh) -> step
# where step(state, batch) -> (new_state, loss), state = {'params': ..., 'opt': optax state}, and
# loss_fn(params, batch) is einshard_apps.models.transformer.loss_fn.  A step built from the model's parts
# (embed / block / head, e.g. a pipeline over the stacked layers) imports them from that module.
# The step may be jitted already (it then needs .lower()); a plain function is jitted by the demo.
StepBuilder = Callable[..., Callable[[Any, Any], tuple[Any, Any]]]


def _data_only(n: int) -> dict[str, int]:
    return {"data": n, "model": 1}


def _model_only(n: int) -> dict[str, int]:
    return {"data": 1, "model": n}


def _data_by_model(n: int) -> dict[str, int]:
    model = 2 if n % 2 == 0 and n > 1 else 1
    return {"data": n // model, "model": model}


@dataclass(frozen=True)
class Preset:
    """A named layout: parameter rules (path pattern -> expression), the batch's expression, a default mesh.

    Attributes:
        name: what ``--layout`` calls it.
        what: one line for a person: which parallelism this is.
        params: ordered path pattern -> placement expression; the first pattern
            found in a parameter's ``jax.tree_util.keystr`` path wins.
        batch: the placement of the token batch ``[b, s]``.
        default_mesh: mesh axis sizes for ``n`` devices (``--mesh`` overrides).
        step_builder: builds the training step; None means ``jax.jit`` with the
            layouts as shardings.  Presets lowered to explicit ``shard_map``
            programs supply their own.
        step_options: the keyword options the step builder takes from the
            command line (``einshard demo --microbatches 4`` gives
            ``microbatches=4``); others are refused.
    """

    name: str
    what: str
    params: Mapping[str, str | None]
    batch: str
    default_mesh: Callable[[int], dict[str, int]] = field(default=_data_by_model, compare=False)
    step_builder: StepBuilder | None = field(default=None, compare=False)
    step_options: tuple[str, ...] = ()


# Megatron tensor parallelism: attention split by heads, the MLP by its hidden axis,
# embeddings by the vocabulary.  Each column-split matmul is followed by a row-split one,
# so a block needs one all-reduce after attention and one after the MLP.
_TENSOR_PARALLEL = {
    "w[qkv]": "l d h k -> l d h@model k",
    "wo": "l h k d -> l h@model k d",
    "w_in": "l d f -> l d f@model",
    "w_out": "l f d -> l f@model d",
    "tokens": "v d -> v@model d",
    "unembed": "d v -> d v@model",
    ".*": "... -> ...",
}

PRESETS: dict[str, Preset] = {}


def register(preset: Preset) -> Preset:
    """Add a preset to the registry (``einshard demo --layout NAME`` can then pick it)."""
    PRESETS[preset.name] = preset
    return preset


register(
    Preset(
        "dp",
        "data parallel: the batch split over 'data', every weight copied; gradients all-reduced",
        {".*": "... -> ..."},
        "b s -> b@data s",
        _data_only,
    )
)
register(
    Preset(
        "fsdp",
        "fully sharded data parallel: batch and weights split over 'data'; weights all-gathered per use",
        {
            "w[qkv]": "l d h k -> l d@data h k",
            "wo": "l h k d -> l h k d@data",
            "w_in": "l d f -> l d f@data",
            "w_out": "l f d -> l f@data d",
            "tokens": "v d -> v@data d",
            "positions": "s d -> s d@data",
            "unembed": "d v -> d v@data",
            ".*": "... -> ...",
        },
        "b s -> b@data s",
        _data_only,
    )
)
register(
    Preset(
        "tp",
        "tensor parallel (Megatron): heads, MLP hidden and vocabulary split over 'model'; batch copied",
        _TENSOR_PARALLEL,
        "b s -> b s",
        _model_only,
    )
)
register(
    Preset(
        "hybrid",
        "data x tensor parallel: the batch over 'data', Megatron tensor parallel over 'model'",
        _TENSOR_PARALLEL,
        "b s -> b@data s",
        _data_by_model,
    )
)
register(
    Preset(
        "fsdp-tp",
        "2-D: Megatron over 'model', and each weight's other axis sharded FSDP-style over 'data'",
        {
            "w[qkv]": "l d h k -> l d@data h@model k",
            "wo": "l h k d -> l h@model k d@data",
            "w_in": "l d f -> l d@data f@model",
            "w_out": "l f d -> l f@model d@data",
            "tokens": "v d -> v@model d@data",
            "positions": "s d -> s d@data",
            "unembed": "d v -> d@data v@model",
            ".*": "... -> ...",
        },
        "b s -> b@data s",
        _data_by_model,
    )
)


def _tp_async_step(*args: Any, **options: Any) -> Any:
    from .explicit_steps import make_tp_async_step

    return make_tp_async_step(*args, **options)


# Pipeline parallelism is a layout: every stacked per-layer weight has its layer axis over 'stage'.
_PIPELINE = {
    "w[qkv]": "l d h k -> l@stage d h k",
    "wo": "l h k d -> l@stage h k d",
    "w_in": "l d f -> l@stage d f",
    "w_out": "l f d -> l@stage f d",
    "ln[12]": "l d -> l@stage d",
    # The ends: the first stage's embedding and the last stage's head hold 1/S of the vocabulary each.
    "tokens": "v d -> v@stage d",
    "unembed": "d v -> d v@stage",
    ".*": "... -> ...",
}


def _pipeline_step(*args: Any, **options: Any) -> Any:
    from .explicit_steps import make_pipeline_step

    return make_pipeline_step(*args, param_layouts=_PIPELINE, **options)


def _stage_by_data(n: int) -> dict[str, int]:
    stage = 2 if n % 2 == 0 and n > 1 else 1
    return {"stage": stage, "data": n // stage}


def _data_by_4_model(n: int) -> dict[str, int]:
    model = 4 if n % 4 == 0 else (2 if n % 2 == 0 else 1)
    return {"data": n // model, "model": model}


register(
    Preset(
        "tp-async",
        "asynchronous tensor parallel: Megatron + sequence parallel in one shard_map, the matmuls as "
        "collective-matmul rings over 'model'",
        _TENSOR_PARALLEL,
        "b s -> b@data s",
        _data_by_4_model,
        _tp_async_step,
        ("ring",),
    )
)
register(
    Preset(
        "pipeline",
        "pipeline parallel: the stacked layer axis over 'stage' (GPipe micro-batches), the batch over 'data'",
        _PIPELINE,
        "b s -> b@data s",
        _stage_by_data,
        _pipeline_step,
        ("microbatches", "schedule"),
    )
)


def parse_mesh(text: str) -> dict[str, int]:
    """``'data=4,model=2'`` -> ``{'data': 4, 'model': 2}``.

    Example:
        >>> parse_mesh('data=4, model=2')
        {'data': 4, 'model': 2}
    """
    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        name, size = name.strip(), size.strip()
        if not name.isidentifier() or not (size.isascii() and size.isdigit() and len(size) <= 18) or int(size) < 1:
            raise EinshardError(f"--mesh takes name=size pairs like data=4,model=2; got {text!r}")
        if name in out:
            raise EinshardError(f"--mesh names the axis {name!r} twice: {text!r}")
        out[name] = int(size)
    return out


def load_rules(path: str | pathlib.Path) -> tuple[Preset, dict[str, int] | None]:
    """Read a rules file (:func:`einshard._src.tree_rules.read_rules_file`: the one format ``save_rules`` and
    ``einshard plan --rules-out`` write) into a preset and its mesh, if it gives one."""
    p = pathlib.Path(path)
    read = read_rules_file(p)
    return Preset(p.name, f"your rules from {p}", read.params, read.batch or "b s -> b s"), read.mesh


def expressions_for(tree: Any, rules: Mapping[str, str | None]) -> Any:
    """The expression each leaf of ``tree`` gets: the first pattern found in its keystr path.

    The same matching as ``einshard(tree, rules)`` (:mod:`einshard._src.tree_rules`), returned as a tree of strings
    so the demo can print it, build shardings and save it with a checkpoint.  A rule of None (leave the leaf
    as it is: a host array placed whole on every device) is written ``'... -> ...'``.
    """
    texts = ["... -> ..." if t is None else t for t in leaf_expressions(tree, rules)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), list(texts))
