r"""Laying pipeline operands out, and the pipeline's two ends: an input function before the first stage and an
output function after the last, whose parameters are split over the stage axis instead of copied to every stage.

A transformer pipeline has an embedding before its layers and a head (and loss) after them.  Replicated,
every stage holds both.  In one SPMD program every device holds same-shaped blocks, so "held only by the
first stage" would still cost every device the same bytes (the other stages would hold unused blocks of
the same size).  What lowers the bytes per device is splitting: :class:`PipelineEnd` parameters are laid
out by einshard expressions, by default their first axis over the stage axis
(``'v d -> v@stage d'``: 1/S of an embedding's rows per device), and ``fn`` sees this device's blocks
(shard_map's local view, as ``layer_fn`` does) and combines over the stage axis itself: a vocabulary-split
embedding looks up its own rows and ``psum``\ s; a vocabulary-split head computes its logits' slice and a
log-sum-exp with ``psum``/``pmax`` (Megatron's vocabulary-parallel cross entropy, over the stage axis).
Every stage then does 1/S of the end's work instead of one stage doing all of it while the others idle.

Each end is one ``jax.shard_map`` of its own around the pipeline's (``jax.grad`` differentiates through it
as through the pipeline), so it composes with every schedule, 1F1B's ``custom_vjp`` included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ..core.mesh import AnyMesh
from ..errors import EinshardError
from ..placement import spec as einshard_spec
from ..tree_rules import leaf_expressions
from .placing import restrict_spec
from .staging import staged
from .steps import varying_axes

__all__ = [
    "PipelineEnd",
    "ParamLayouts",
    "lay_out",
    "layer_specs",
    "run_end",
    "vocab_parallel_embed",
    "vocab_parallel_cross_entropy",
]

ParamLayouts = str | Mapping[str, "str | None"] | None


@dataclass(frozen=True)
class PipelineEnd:
    """A function run before the first stage (``first=``) or after the last (``last=``) of :func:`einshard.pipeline`.

    Attributes:
        fn: ``fn(params, h, *args) -> out``, written for this device's blocks of ``params``; ``h`` and
            ``out`` have the batch first (``first``: ``h`` is the pipeline's ``x``, ``out`` the first
            layer's input; ``last``: ``h`` is the last layer's output, ``out`` what ``pipeline`` returns,
            e.g. per-example losses).  ``out`` must not vary over the stage axis: combine with
            ``jax.lax.psum(..., stage_axis)`` where ``params`` are split over it.
        params: a pytree of arrays (differentiate through it like the layer params).
        layouts: einshard expression(s) for ``params``, one for all leaves or ordered path-pattern rules
            (:mod:`einshard.tree_rules`; ``None`` as a rule: replicated).  Default: every leaf's first
            axis split over the stage axis, ``'a ... -> a@stage ...'``.
        args: more batch-first arrays ``fn`` takes (e.g. the targets of a loss), split over the data axis like ``x``.
    """

    fn: Callable[..., Any]
    params: Any = None
    layouts: ParamLayouts = None
    args: tuple[Any, ...] = field(default=())

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise EinshardError(f"PipelineEnd: fn must be callable, got {type(self.fn).__name__}")
        if not isinstance(self.args, tuple):
            raise EinshardError(f"PipelineEnd: args must be a tuple of arrays, got {type(self.args).__name__}")
        if self.layouts is not None and not isinstance(self.layouts, str | Mapping):
            raise EinshardError(
                f"PipelineEnd: layouts must be an expression, a mapping of path patterns, or None; "
                f"got {type(self.layouts).__name__}"
            )
        if isinstance(self.layouts, Mapping):
            from ..tree_rules import compile_rules

            try:
                compile_rules(self.layouts)  # a bad pattern or rule now, not when the pipeline first runs
            except EinshardError as err:
                raise EinshardError(f"PipelineEnd: layouts= {err.reason}", hint=err.hint) from None


def lay_out(x: Any, mesh: AnyMesh, spec: PartitionSpec) -> Any:
    """Lay an operand out as its in_spec says: Explicit axes need it (Auto axes reshard inside shard_map).

    A ``NamedSharding`` (not a bare spec) so no mesh context is needed; under a trace
    ``reshard`` (never ``device_put``, which cannot target an abstract mesh), and only
    over the Explicit axes, which are the ones ``reshard`` accepts.
    """
    kinds = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    explicit = {name for name, kind in kinds.items() if kind == AxisType.Explicit}
    if not explicit:
        return x

    explicit_spec = restrict_spec(spec, explicit)
    if isinstance(x, jax.core.Tracer) or not isinstance(mesh, jax.sharding.Mesh):
        try:
            return jax.sharding.reshard(x, NamedSharding(mesh, explicit_spec))
        except ValueError as err:  # e.g. an abstract mesh given as mesh= to eager code
            raise EinshardError(
                f"cannot lay a pipeline operand out as {explicit_spec} on this mesh: {err}",
                hint="Pass a concrete jax Mesh as mesh=, or call inside `with jax.set_mesh(mesh):`.",
            ) from None
    target = NamedSharding(mesh, spec)
    if getattr(x, "sharding", None) == target:
        return x
    return jax.device_put(x, target)


def _specs(
    params: Any, layouts: ParamLayouts, default: str, mesh: AnyMesh, where: str
) -> tuple[tuple[Any, ...], list[PartitionSpec]]:
    """Each leaf's layout rule (einshard.tree_rules: one matcher everywhere) and the PartitionSpec it gives."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    texts = leaf_expressions(params, default if layouts is None else layouts)
    specs = []
    for (path, leaf), text in zip(leaves, texts, strict=True):
        key = jax.tree_util.keystr(path)
        shape = tuple(np.shape(leaf))
        if text is None:
            specs.append(PartitionSpec())
            continue
        try:
            specs.append(PartitionSpec(*einshard_spec(text, shape, mesh=mesh)))
        except EinshardError as err:
            raise EinshardError(
                f"{where} leaf at {key} (shape {shape}): {err.reason}", err.expression, err.column, err.hint
            ) from None
    return texts, specs


def layer_specs(params: Any, layouts: ParamLayouts, stage_axis: str, mesh: AnyMesh) -> Any:
    """A PartitionSpec for every layer-params leaf; the layer axis (dimension 0) must be split over exactly the stage axis."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    texts, specs = _specs(params, layouts, f"layer ... -> layer@{stage_axis} ...", mesh, "the pipeline params")
    for (path, _), spec, text in zip(leaves, specs, texts, strict=True):
        if not spec or spec[0] != stage_axis:
            raise EinshardError(
                f"the params leaf at {jax.tree_util.keystr(path)} has its layer axis laid out as "
                f"{spec[0] if spec else None!r}; a pipeline needs it split over exactly the stage axis {stage_axis!r}",
                text,
                hint=f"'layer d f -> layer@{stage_axis} d f'",
            )
    return jax.tree_util.tree_unflatten(treedef, specs)


def run_end(
    end: PipelineEnd, h: Any, which: Literal["first", "last"], *, mesh: AnyMesh, stage_axis: str, batch_entry: Any
) -> Any:
    """``end.fn(params, h, *args)`` in a shard_map: params as ``end.layouts`` say, batch-first arrays over the data axes."""
    if not isinstance(end, PipelineEnd):
        raise EinshardError(
            f"{which}= must be an einshard.lowering.PipelineEnd(fn, params, layouts), got {type(end).__name__}"
        )
    where = f"the {which}= PipelineEnd's params"
    if not callable(end.fn):
        raise EinshardError(f"{which}=: a PipelineEnd's fn is a function, got {type(end.fn).__name__}")
    leaves, treedef = jax.tree_util.tree_flatten(end.params)
    for leaf in leaves:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise EinshardError(f"{where} must be arrays, got a {type(leaf).__name__}")
    _, flat_specs = _specs(end.params, end.layouts, f"a ... -> a@{stage_axis} ...", mesh, where)
    specs = jax.tree_util.tree_unflatten(treedef, flat_specs)
    batch = PartitionSpec(batch_entry)
    for i, a in enumerate((h, *end.args)):
        if np.ndim(a) < 1:
            what = "its input" if i == 0 else f"args[{i - 1}]"
            raise EinshardError(f"the {which}= PipelineEnd's {what} has no batch axis (shape {np.shape(a)})")

    # The same end (fn, layouts, mesh) reuses its jitted program on every eager call (see staging.py).
    key = ("pipeline end", which, end.fn, tuple(flat_specs), treedef, batch, len(end.args), mesh, stage_axis)

    def build() -> Callable[..., Any]:
        def body(p: Any, h: Any, *args: Any) -> Any:
            out = end.fn(p, h, *args)
            if np.ndim(out) < 1:
                raise EinshardError(
                    f"the {which}= PipelineEnd's fn returned shape {np.shape(out)}; it must keep the batch axis first "
                    "(e.g. per-example losses; take their mean outside the pipeline)"
                )
            if stage_axis in varying_axes(out):
                raise EinshardError(
                    f"the {which}= PipelineEnd's fn returns a value that still varies over the stage axis "
                    f"{stage_axis!r} (its params are split over it)",
                    hint=f"Combine the stages' parts inside fn, e.g. jax.lax.psum(part, {stage_axis!r}).",
                )
            return out

        mapped = jax.jit(  # staged: an eager shard_map runs one primitive at a time
            jax.shard_map(
                body, mesh=mesh, in_specs=(specs, batch, *(batch for _ in end.args)), out_specs=batch, check_vma=True
            )
        )
        return mapped

    mapped = staged(key, build)
    params = jax.tree_util.tree_map(lambda w, s: lay_out(w, mesh, s), end.params, specs)
    return mapped(params, lay_out(h, mesh, batch), *(lay_out(a, mesh, batch) for a in end.args))


def vocab_parallel_embed(table: jax.Array, tokens: jax.Array, axis: str | tuple[str, ...]) -> jax.Array:
    """Embedding lookup with the table's rows (the vocabulary) split over ``axis``, inside a shard_map.

    Each device looks up the tokens whose rows it holds (zeros for the others) and one ``psum``
    gives every token its row on every device: ``[..., ] -> [..., D]``, invariant over ``axis``.
    """
    rows = table.shape[0]
    local = tokens - jax.lax.axis_index(axis) * rows
    hit = (local >= 0) & (local < rows)
    found = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)
    return jax.lax.psum(jnp.where(hit[..., None], found, jnp.zeros((), found.dtype)), axis)


def vocab_parallel_cross_entropy(logits: jax.Array, targets: jax.Array, axis: str | tuple[str, ...]) -> jax.Array:
    r"""Per-example cross entropy with the logits' last axis (the vocabulary) split over ``axis`` (Megatron's).

    ``logits [..., V/n]`` (this device's slice), ``targets [...]`` (global ids) -> ``[...]``, invariant
    over ``axis``: a ``pmax`` for stability (no gradient flows through it) and two ``psum``\ s.
    """
    cols = logits.shape[-1]
    top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis)
    lse = jnp.log(jax.lax.psum(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1), axis)) + top
    local = targets - jax.lax.axis_index(axis) * cols
    hit = (local >= 0) & (local < cols)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, cols - 1)[..., None], axis=-1)[..., 0]
    return lse - jax.lax.psum(jnp.where(hit, picked, jnp.zeros((), picked.dtype)), axis)
