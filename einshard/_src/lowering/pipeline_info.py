"""What a pipeline does and keeps, without running it: :class:`PipelineInfo`, :func:`pipeline_info`, and the checks.

Everything here is validated once, at the entry of :func:`einshard.pipeline` (which calls
:func:`pipeline_info`), so a bad count or mesh is an :class:`~einshard.errors.EinshardError`
naming the argument before anything is traced.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np

from .._checks import check_bool, check_dtype, check_str_or_strs
from .._compat import dtype_itemsize, is_array_dtype
from ..core.mesh import AnyMesh, MeshLike, resolve_mesh
from ..errors import EinshardError
from . import schedules
from .steps import check_lowering_context

__all__ = ["PipelineInfo", "pipeline_info", "SCHEDULES"]


@dataclass(frozen=True)
class PipelineInfo:
    """What a pipeline run does and keeps.

    Attributes:
        schedule: ``'gpipe'``, ``'circular'`` or ``'1f1b'`` (interleaved when ``repeats > 1``).
        stages, microbatches, repeats: S, M, R.
        layers: L, the stacked layer count; ``layers_per_visit`` = L/(S·R) run per iteration.
        iterations: M·R + S − 1 iterations of the forward scan (each a stage visit and one ppermute).
        tick_table: the whole training step, ``[tick][stage]``: ``'F3'`` / ``'B3'`` (micro-batch 3;
            ``'F3.1'``: its chunk 1 with repeats), ``'.'`` idle.  GPipe/circular: the forward scan,
            then its AD transpose.  1F1B: the forward-only scan, then the 1F1B-ordered backward scan
            (whose F ticks recompute).  :meth:`render` draws it.
        bubble_fraction: the idle share of ``tick_table``; (S − 1)/(M·R + S − 1) for every schedule.
        activation_slots: micro-batch activations one device keeps for the backward pass
            (GPipe/circular: every layer visit of every iteration, or one per iteration with
            ``remat=True``; 1F1B: its stash and gradient buffers, about S, plus one visit's layers).
        microbatch_shape: the shape of one micro-batch on one device.
        activation_bytes: ``activation_slots`` micro-batches plus the M-row result buffer, in bytes;
            residuals inside ``layer_fn`` come on top.
    """

    schedule: str
    stages: int
    microbatches: int
    repeats: int
    layers: int
    layers_per_visit: int
    iterations: int
    tick_table: tuple[tuple[str, ...], ...]
    bubble_fraction: float
    activation_slots: int
    microbatch_shape: tuple[int, ...]
    activation_bytes: int

    def render(self) -> str:
        """The tick table as text: one line per stage, one column per tick."""
        width = max(len(label) for row in self.tick_table for label in row)
        return "\n".join(
            f"stage {s}: " + " ".join(row[s].rjust(width) for row in self.tick_table) for s in range(self.stages)
        )


def mesh_or_context(mesh: MeshLike | None, operands: Any = (), *, sizes_only: bool = False) -> Any:
    """The mesh by einshard's one precedence (:func:`einshard.core.mesh.resolve_mesh`): ``mesh=``, ``jax.set_mesh``, operands.

    ``pipeline`` runs a shard_map, so a dict of sizes (fine for :func:`pipeline_info`) is refused there.
    """
    if isinstance(mesh, Mapping) and not sizes_only:
        raise EinshardError(
            f"mesh= is a dict of sizes ({dict(mesh)}); pipeline() runs a shard_map and needs a jax Mesh",
            hint="e.g. mesh=jax.make_mesh((4,), ('stage',)); pipeline_info() takes a dict of sizes",
        )
    what = "pipeline_info()" if sizes_only else "pipeline()"
    found = resolve_mesh(mesh, (operands,), what=what)
    if not sizes_only:
        # The same refusal as every lowering where plain JAX cannot run (eager jax.grad on Explicit axes
        # outside a mesh context), with what to write instead.
        check_lowering_context(cast(AnyMesh, found), (operands,), what=what)  # required=True: never None
    return found


def leaf_shape(path: Any, leaf: Any) -> tuple[int, ...]:
    """A params leaf's shape; non-numeric leaves and scalars are an error naming the leaf."""
    key = jax.tree_util.keystr(path)
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
        raise EinshardError(
            f"pipeline params leaf {key or '<root>'} is a {type(leaf).__name__}, not an array",
            hint="Every params leaf must be an array with the layer axis first.",
        )
    if not is_array_dtype(dtype):  # a typed PRNG key batch (one key per layer, for dropout) is a fine leaf
        raise EinshardError(f"pipeline params leaf {key or '<root>'} has non-numeric dtype {dtype}")
    shape = tuple(int(n) for n in leaf.shape)
    if not shape:
        raise EinshardError(
            f"pipeline params leaf {key or '<root>'} is a scalar; every leaf needs a leading layer axis"
        )
    return shape


SCHEDULES = ("gpipe", "circular", "1f1b")


def _check_counts(layers: int, batch: int, stages: int, microbatches: int, repeats: int, schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise EinshardError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {schedule!r}")
    for name, value in (("microbatches", microbatches), ("repeats", repeats)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise EinshardError(f"{name} must be a positive int, got {value!r}")
    if schedule == "gpipe" and repeats != 1:
        raise EinshardError(f"repeats={repeats} belongs to schedule='circular' or '1f1b'; GPipe visits each stage once")
    if layers % (stages * repeats):
        raise EinshardError(
            f"{layers} layers do not split into {stages} stages x {repeats} repeats",
            hint=f"Use a layer count that is a multiple of {stages * repeats}.",
        )
    if batch % microbatches:
        raise EinshardError(
            f"the batch on each device ({batch}) does not split into microbatches={microbatches}",
            hint="Use a micro-batch count that divides the per-device batch.",
        )
    if repeats > 1 and microbatches < stages:
        raise EinshardError(
            f"repeats > 1 needs at least as many micro-batches as stages (microbatches={microbatches} < {stages}): "
            "a micro-batch must leave the last stage before the first stage needs it again"
        )
    if schedule == "1f1b" and repeats > 1 and microbatches % stages:
        raise EinshardError(
            f"interleaved 1F1B (repeats={repeats}) runs micro-batches in groups of the {stages} stages: "
            f"microbatches={microbatches} must be a multiple of {stages}"
        )


def _layer_count(params: Any) -> int:
    leaves = jax.tree_util.tree_leaves_with_path(params)
    if not leaves:
        raise EinshardError("pipeline params have no array leaves")
    counts = {leaf_shape(path, leaf)[0] for path, leaf in leaves}
    if len(counts) != 1:
        raise EinshardError(f"every params leaf needs the same leading layer count, got {sorted(counts)}")
    return counts.pop()


def _axis_sizes(mesh: MeshLike) -> dict[str, int]:
    items = mesh.items() if isinstance(mesh, Mapping) else mesh.shape.items()
    return {str(name): int(size) for name, size in items}


def data_axes(data_axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if data_axis is None:
        return ()
    return check_str_or_strs(data_axis, "einshard.pipeline", "data_axis")


def pipeline_info(
    params: Any,
    x: Any,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    repeats: int = 1,
    mesh: MeshLike | None = None,
    stage_axis: str = "stage",
    data_axis: str | tuple[str, ...] | None = None,
    remat: bool = False,
) -> PipelineInfo:
    """The schedule's numbers (bubble, iterations, activation memory) without running anything.

    ``mesh`` may also be a dict of axis sizes (only sizes matter here).
    """
    check_bool(remat, "einshard.pipeline", "remat")
    mesh = mesh_or_context(mesh, (params, x), sizes_only=True)
    sizes = _axis_sizes(mesh)
    if not isinstance(stage_axis, str) or stage_axis not in sizes:
        raise EinshardError(f"the mesh has no stage_axis {stage_axis!r} (axes: {', '.join(sizes)})")
    stages = sizes[stage_axis]
    # A stage axis of size 1 is accepted on purpose: one stage runs every layer, micro-batch by micro-batch
    # (no bubble, no ppermute), so a program written for a pipeline mesh also runs on one device (the demo's
    # pipeline preset does); tests/test_pipeline_stages.py checks every schedule there against the sequential model.
    layers = _layer_count(params)
    data = data_axes(data_axis)
    for axis in data:
        if axis not in sizes or axis == stage_axis:
            raise EinshardError(
                f"data_axis {axis!r} is not a mesh axis other than the stage axis (axes: {', '.join(sizes)})"
            )
    data_size = math.prod(sizes[a] for a in data)
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or len(x.shape) < 1:
        raise EinshardError(f"pipeline x must be an array with a leading batch axis, got {type(x).__name__}")
    check_dtype(x.dtype, "einshard.pipeline", "x", optional=False)
    batch = int(x.shape[0])
    if batch % data_size:
        raise EinshardError(f"the batch ({batch}) does not split over data_axis {data_axis!r} ({data_size} devices)")
    local_batch = batch // data_size
    _check_counts(layers, local_batch, stages, microbatches, repeats, schedule)
    iterations = microbatches * repeats + stages - 1
    lps = layers // (stages * repeats)
    mb_shape = (local_batch // microbatches, *x.shape[1:])
    mb_bytes = math.prod(mb_shape) * dtype_itemsize(x.dtype)
    forward = schedules.forward_ticks(stages, microbatches, repeats)
    if schedule == "1f1b":
        plan = schedules.one_f_one_b(stages, microbatches, repeats)
        table = forward + plan.table
        slots = plan.act_slots + plan.grad_slots + lps
    else:
        table = forward + schedules.backward_of(forward)
        slots = iterations * (1 if remat else lps)
    labels = tuple(tuple(op.label(repeats) if op else "." for op in row) for row in table)
    return PipelineInfo(
        schedule=schedule,
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        layers=layers,
        layers_per_visit=lps,
        iterations=iterations,
        tick_table=labels,
        bubble_fraction=schedules.idle_fraction(table),
        activation_slots=slots,
        microbatch_shape=mb_shape,
        activation_bytes=(slots + microbatches) * mb_bytes,
    )
