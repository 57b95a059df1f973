r"""Pipeline parallelism: stacked layers sharded over a stage mesh axis, micro-batches passed by ``ppermute``.

Pipeline parallelism *is* a layout: the layer axis of stacked weights split
over a mesh axis, ``einshard(params, 'layer d f -> layer@stage d f')``.
:func:`pipeline` runs ``layer_fn`` over those layers as S stages inside one
``jax.shard_map``: M micro-batches flow stage to stage, one ``ppermute`` per
iteration of one ``lax.scan``.

* ``schedule='gpipe'``: M + S − 1 iterations; stage s works in iterations
  ``[s, s + M)``; bubble (S − 1)/(M + S − 1).
* ``schedule='circular'`` with ``repeats=R`` (interleaved, MaxText/praxis
  "circular"): each micro-batch goes round the ring R times, each visit running
  1/R of the stage's layers; M·R + S − 1 iterations, bubble (S − 1)/(R·M + S − 1).
  Needs M ≥ S (the first stage parks each micro-batch in a buffer until its
  next round).  Global layer ``(r·S + s)·Lps + j`` runs on stage s in round r,
  so the layers are re-ordered once per call (a reshard of the params); store
  them with :func:`circular_layer_order` and pass ``layers_in_circular_order=True``
  to skip that.
* ``schedule='1f1b'`` (interleaved with ``repeats=R``, M a multiple of S): the
  same forward, and a backward that runs in the 1F1B order, so a stage keeps
  about S micro-batches of activations instead of M (:mod:`.pipeline_1f1b`,
  tick tables in :mod:`.schedules`).

The mesh is found as everywhere in einshard (:func:`einshard.core.mesh.resolve_mesh`):
``mesh=``, else ``jax.set_mesh``, else the mesh the params were placed on.
Operands are laid out with ``NamedSharding``\ s (``reshard`` under a trace) on
the mesh's Explicit axes; Auto axes reshard inside the shard_map.

Bubble iterations compute on garbage (SPMD: every stage runs every
iteration).  Their inputs are replaced by zeros with ``jnp.where`` (never a
multiplication by a mask: ``0 * nan`` is nan) and their outputs never written,
so NaN or Inf there reaches neither the result nor the gradients.
Gradients come from ``jax.grad`` through the scan (the transposed ``ppermute``
sends cotangents back a stage per iteration); data-parallel gradient sums come
from AD too.  Inside the pipeline ``layer_fn`` sees this device's blocks
(shard_map's local view): a tensor-parallel layer does its own collectives
(e.g. ``jax.lax.psum(h, 'model')``) on the weights' model-axis blocks.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> mesh = jax.make_mesh((4,), ('stage',), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    >>> w = np.full((8, 3, 3), 0.5, np.float32) * np.eye(3, dtype=np.float32)  # 8 layers
    >>> x = np.ones((6, 3), np.float32)
    >>> y = pipeline(lambda w, h: h @ w, w, x, microbatches=3, mesh=mesh)
    >>> float(y[0, 0]) == 0.5 ** 8
    True
    >>> pipeline_info(w, x, microbatches=3, mesh=mesh).bubble_fraction   # (4-1)/(3+4-1)
    0.5
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ..core.mesh import AnyMesh, resolve_mesh
from ..errors import EinshardError
from ..placement import spec as einshard_spec
from . import schedules
from .pipeline_1f1b import one_f_one_b_pipeline
from .steps import check_lowering_context
from .steps import vary as _vary
from .steps import varying_axes as _varying

__all__ = ["PipelineInfo", "pipeline", "pipeline_info", "circular_layer_order"]

ParamLayouts = str | Mapping[str, str] | None


def _save_all_but_slices(prim: Any, *_: Any, **__: Any) -> bool:
    """A checkpoint policy: save every residual except dynamic slices (a circular round's weights: re-sliced)."""
    return prim is not jax.lax.dynamic_slice_p


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


def _mesh_or_context(mesh: Any, operands: Any = (), *, sizes_only: bool = False) -> Any:
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


def _lay_out(x: Any, mesh: Any, spec: PartitionSpec) -> Any:
    """Lay an operand out as its in_spec says: Explicit axes need it (Auto axes reshard inside shard_map).

    A ``NamedSharding`` (not a bare spec) so no mesh context is needed; under a trace
    ``reshard`` (never ``device_put``, which cannot target an abstract mesh), and only
    over the Explicit axes, which are the ones ``reshard`` accepts.
    """
    kinds = dict(zip(mesh.axis_names, getattr(mesh, "axis_types", ()), strict=False))
    explicit = {name for name, kind in kinds.items() if kind == AxisType.Explicit}
    if not explicit:
        return x

    def keep(entry: Any) -> Any:
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(n for n in names if n in explicit)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    explicit_spec = PartitionSpec(*(keep(e) for e in spec))
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


def _leaf_specs(params: Any, layouts: ParamLayouts, stage_axis: str, mesh: Any) -> Any:
    """A PartitionSpec for every params leaf; the layer axis (dimension 0) must be split over exactly the stage axis."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = []
    for path, leaf in leaves:
        key = jax.tree_util.keystr(path)
        shape = tuple(np.shape(leaf))
        if not shape:
            raise EinshardError(f"pipeline params leaf {key} is a scalar; every leaf needs a leading layer axis")
        text: str | None
        if layouts is None:
            text = "layer ... -> layer@" + stage_axis + " ..."
        elif isinstance(layouts, str):
            text = layouts
        else:
            text = next((t for pattern, t in layouts.items() if re.search(pattern, key)), None)
            if text is None:
                raise EinshardError(f"no param_layouts pattern matches the leaf at {key}")
        try:
            s = tuple(einshard_spec(text, shape, mesh=mesh))
        except EinshardError as err:
            raise EinshardError(
                f"at {key} (shape {shape}): {err.reason}", err.expression, err.column, err.hint
            ) from None
        if not s or s[0] != stage_axis:
            raise EinshardError(
                f"the params leaf at {key} has its layer axis laid out as {s[0] if s else None!r}; "
                f"a pipeline needs it split over exactly the stage axis {stage_axis!r}",
                text,
                hint=f"'layer d f -> layer@{stage_axis} d f'",
            )
        specs.append(PartitionSpec(*s))
    return jax.tree_util.tree_unflatten(treedef, specs)


def circular_layer_order(params: Any, stages: int, repeats: int) -> Any:
    """Permute the layer axis so that contiguous stage sharding gives the circular assignment.

    After it, stage s's contiguous block holds, round by round, the layers it
    runs: position ``(s·R + r)·Lps + j`` holds global layer ``(r·S + s)·Lps + j``.
    Apply it once to stored weights and pass ``layers_in_circular_order=True``.
    Params already split over the stage axis (Explicit mesh axes) keep that
    layout: the reshape names its result's sharding (XLA moves the blocks with
    all-to-alls), which JAX's sharding-in-types requires.

    Example:
        >>> import numpy as np
        >>> circular_layer_order(np.arange(8), stages=2, repeats=2).tolist()
        [0, 1, 4, 5, 2, 3, 6, 7]
    """
    for name, value in (("stages", stages), ("repeats", repeats)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise EinshardError(f"circular_layer_order: {name} must be a positive int, got {value!r}")

    def one(path: Any, w: Any) -> Any:
        shape = _leaf_shape(path, w)
        length = shape[0]
        if length % (stages * repeats):
            raise EinshardError(
                f"circular_layer_order: the leaf at {jax.tree_util.keystr(path)} has {length} layers, "
                f"which do not split into stages={stages} x repeats={repeats}"
            )
        lps = length // (stages * repeats)
        blocks = (repeats, stages, lps, *shape[1:])
        if isinstance(w, np.ndarray | np.generic):
            return np.swapaxes(np.reshape(w, blocks), 0, 1).reshape(shape)
        placed = _explicit_sharding(w)
        mid = back = None
        if placed is not None:
            entries = (*placed.spec, *([None] * (len(shape) - len(placed.spec))))
            mid = NamedSharding(placed.mesh, PartitionSpec(None, entries[0], None, *entries[1:]))
            back = placed
        w = jnp.asarray(w)
        swapped = jnp.swapaxes(jax.lax.reshape(w, blocks, out_sharding=mid), 0, 1)
        return jax.lax.reshape(swapped, shape, out_sharding=back)

    return jax.tree_util.tree_map_with_path(one, params)


def _explicit_sharding(w: Any) -> Any:
    """The NamedSharding in ``w``'s type when it names Explicit mesh axes (sharding-in-types), else None."""
    typed = getattr(jax.typeof(w), "sharding", None) if isinstance(w, jax.Array | jax.core.Tracer) else None
    spec = getattr(typed, "spec", None)
    if typed is None or spec is None or all(entry is None for entry in spec):
        return None
    return typed


def _leaf_shape(path: Any, leaf: Any) -> tuple[int, ...]:
    """A params leaf's shape; non-numeric leaves and scalars are an error naming the leaf."""
    key = jax.tree_util.keystr(path)
    dtype = getattr(leaf, "dtype", None)
    if dtype is None or not hasattr(leaf, "shape"):
        raise EinshardError(
            f"pipeline params leaf {key or '<root>'} is a {type(leaf).__name__}, not an array",
            hint="Every params leaf must be an array with the layer axis first.",
        )
    if not (jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_)):
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
    counts = {_leaf_shape(path, leaf)[0] for path, leaf in leaves}
    if len(counts) != 1:
        raise EinshardError(f"every params leaf needs the same leading layer count, got {sorted(counts)}")
    return counts.pop()


def _axis_sizes(mesh: Any) -> dict[str, int]:
    items = mesh.items() if isinstance(mesh, Mapping) else mesh.shape.items()
    return {str(name): int(size) for name, size in items}


def _data_axes(data_axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if data_axis is None:
        return ()
    axes = (data_axis,) if isinstance(data_axis, str) else tuple(data_axis)
    if not all(isinstance(a, str) for a in axes):
        raise EinshardError(f"data_axis must be a mesh axis name or a tuple of them, got {data_axis!r}")
    return axes


def pipeline_info(
    params: Any,
    x: Any,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    repeats: int = 1,
    mesh: Any = None,
    stage_axis: str = "stage",
    data_axis: str | tuple[str, ...] | None = None,
    remat: bool = False,
) -> PipelineInfo:
    """The schedule's numbers (bubble, iterations, activation memory) without running anything.

    ``mesh`` may also be a dict of axis sizes (only sizes matter here).
    """
    mesh = _mesh_or_context(mesh, (params, x), sizes_only=True)
    sizes = _axis_sizes(mesh)
    if not isinstance(stage_axis, str) or stage_axis not in sizes:
        raise EinshardError(f"the mesh has no stage_axis {stage_axis!r} (axes: {', '.join(sizes)})")
    stages = sizes[stage_axis]
    layers = _layer_count(params)
    data = _data_axes(data_axis)
    for axis in data:
        if axis not in sizes or axis == stage_axis:
            raise EinshardError(
                f"data_axis {axis!r} is not a mesh axis other than the stage axis (axes: {', '.join(sizes)})"
            )
    data_size = math.prod(sizes[a] for a in data)
    if not hasattr(x, "shape") or not hasattr(x, "dtype") or len(x.shape) < 1:
        raise EinshardError(f"pipeline x must be an array with a leading batch axis, got {type(x).__name__}")
    batch = int(x.shape[0])
    if batch % data_size:
        raise EinshardError(f"the batch ({batch}) does not split over data_axis {data_axis!r} ({data_size} devices)")
    local_batch = batch // data_size
    _check_counts(layers, local_batch, stages, microbatches, repeats, schedule)
    iterations = microbatches * repeats + stages - 1
    lps = layers // (stages * repeats)
    mb_shape = (local_batch // microbatches, *x.shape[1:])
    mb_bytes = math.prod(mb_shape) * np.dtype(x.dtype).itemsize
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


def pipeline(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: Any,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    repeats: int = 1,
    mesh: Any = None,
    stage_axis: str = "stage",
    data_axis: str | tuple[str, ...] | None = None,
    param_layouts: ParamLayouts = None,
    layers_in_circular_order: bool = False,
    remat: bool = False,
    sanitize: bool = True,
    bubble_value: float = 0.0,
) -> jax.Array:
    """Run ``h = layer_fn(params[l], h)`` for every stacked layer l as a pipeline over ``stage_axis``.

    Args:
        layer_fn: ``layer_fn(layer_params, h) -> h`` for one layer (``h`` keeps its shape),
            written for this device's blocks (see the module docstring).
        params: a pytree whose leaves all have the layer axis first.
        x: the batch ``[B, ...]``; split over ``data_axis`` (if given) and into M micro-batches.
        microbatches: M, micro-batches per device.
        schedule: ``'gpipe'``, ``'circular'`` or ``'1f1b'``; ``repeats``: R rounds (circular) or
            virtual stages per device (interleaved 1F1B).
        mesh: the mesh; default the one from ``jax.set_mesh``, else the params' own mesh.
        stage_axis: the mesh axis the layer axis is split over.
        data_axis: mesh axis (or axes) the batch is split over (data parallelism), or None.
        param_layouts: einshard expression(s) for the params (one for all leaves, or
            path-pattern rules); default ``'layer ... -> layer@stage ...'``.  Use it for
            tensor-parallel layers: ``'layer d f -> layer@stage d f@model'``.
        layers_in_circular_order: the params are already in :func:`circular_layer_order`.
        remat: keep only each iteration's stage input for the backward pass (``jax.checkpoint``;
            GPipe/circular: 1F1B's backward always recomputes from its stash).
        sanitize: replace bubble inputs by zeros (leave on; off only to show why it is needed;
            1F1B's backward idles in bubbles and reads only written slots, so it needs none).
        bubble_value: what unused buffers start as (tests pollute bubbles with ``nan``).

    Returns:
        ``[B, ...]``, the last layer's output, laid out like ``x``.
    """
    mesh = _mesh_or_context(mesh, (params, x))
    if not callable(layer_fn):
        raise EinshardError(f"layer_fn must be callable, got {type(layer_fn).__name__}")
    info = pipeline_info(
        params,
        x,
        microbatches=microbatches,
        schedule=schedule,
        repeats=repeats,
        mesh=mesh,
        stage_axis=stage_axis,
        data_axis=data_axis,
        remat=remat,
    )
    S, M, R, lps = info.stages, microbatches, repeats, info.layers_per_visit
    if R > 1 and not layers_in_circular_order:
        params = circular_layer_order(params, S, R)
    param_specs = _leaf_specs(params, param_layouts, stage_axis, mesh)
    data = _data_axes(data_axis)
    x_spec = PartitionSpec(data[0] if len(data) == 1 else (data or None), *([None] * (np.ndim(x) - 1)))
    T = info.iterations

    def visit(p: Any, h: jax.Array) -> jax.Array:
        def one(h: jax.Array, layer_params: Any) -> tuple[jax.Array, None]:
            return layer_fn(layer_params, h), None

        return jax.lax.scan(one, h, p)[0]

    if remat:
        visit = jax.checkpoint(visit)

    def body(p: Any, xb: jax.Array) -> jax.Array:
        s = jax.lax.axis_index(stage_axis)
        xs = xb.reshape(M, xb.shape[0] // M, *xb.shape[1:])

        def params_of_round(r: jax.Array) -> Any:
            if R == 1:  # every visit runs all local layers: no slice (its transpose would add a zero buffer per step)
                return p
            return jax.tree_util.tree_map(lambda w: jax.lax.dynamic_slice_in_dim(w, r * lps, lps, 0), p)

        def run_round(r: jax.Array, h: jax.Array) -> jax.Array:
            return visit(params_of_round(r), h)

        if R > 1:
            # AD of the scan would save each iteration's slice of the params (its layers' weights) as a residual:
            # memory growing with M·R.  Re-slicing in the backward costs a copy; the full params stay loop-invariant.
            run_round = jax.checkpoint(run_round, policy=_save_all_but_slices)

        # The carries must vary over the same mesh axes in every iteration: find
        # the axes a visit's output varies over (a fixed point, usually one step).
        axes = _varying(xs) | {stage_axis}
        while True:
            probe = jax.eval_shape(visit, params_of_round(jnp.int32(0)), _vary(xs[0], axes))
            grown = axes | _varying(probe)
            if grown == axes:
                break
            axes = grown
        fill = jnp.full(xs.shape[1:], bubble_value, xs.dtype)
        state = _vary(fill, axes)
        parked = _vary(jnp.broadcast_to(fill, xs.shape), axes)  # stage 0's buffer of returning micro-batches
        outs = _vary(jnp.broadcast_to(fill, xs.shape), axes)
        cyclic = R > 1
        perm = [(j, (j + 1) % S) for j in range(S if cyclic else S - 1)]

        Carry = tuple[jax.Array, jax.Array, jax.Array]

        def step(carry: Carry, t: jax.Array) -> tuple[Carry, None]:
            state, parked, outs = carry
            if cyclic:
                # What stage 0 just received from the last stage: item t - S, parked by micro-batch.
                back = t - S
                slot = jnp.mod(back, M)
                keep = (s == 0) & (back >= 0) & (back < M * R)
                old = jax.lax.dynamic_index_in_dim(parked, slot, 0, keepdims=False)
                parked = jax.lax.dynamic_update_index_in_dim(parked, jnp.where(keep, state, old), slot, 0)
            u = t - s  # the work item: micro-batch u mod M, round u // M
            valid = (u >= 0) & (u < M * R)
            fresh = jax.lax.dynamic_index_in_dim(xs, jnp.clip(t, 0, M - 1), 0, keepdims=False)
            if cyclic:
                again = jax.lax.dynamic_index_in_dim(parked, jnp.mod(t, M), 0, keepdims=False)
                first = jnp.where(t < M, fresh, again)
            else:
                first = fresh
            inp = jnp.where(s == 0, first, state)
            if sanitize:
                inp = jnp.where(valid, inp, jnp.zeros_like(inp))
            r = jnp.clip(u // M, 0, R - 1)
            y = _vary(run_round(r, inp), axes)
            done = valid & (s == S - 1) & (u >= (R - 1) * M)
            slot_out = jnp.clip(u - (R - 1) * M, 0, M - 1)
            old_out = jax.lax.dynamic_index_in_dim(outs, slot_out, 0, keepdims=False)
            outs = jax.lax.dynamic_update_index_in_dim(outs, jnp.where(done, y, old_out), slot_out, 0)
            state = jax.lax.ppermute(y, stage_axis, perm) if S > 1 else y
            return (state, parked, outs), None

        (_, _, outs), _ = jax.lax.scan(step, (state, parked, outs), jnp.arange(T))
        # Only the last stage holds results: share them with every stage (the out_spec replicates over stages).
        result = jax.lax.psum(jnp.where(s == S - 1, outs, jnp.zeros_like(outs)), stage_axis)
        return result.reshape(xb.shape)

    mapped: Callable[[Any, Any], jax.Array] = jax.shard_map(
        body, mesh=mesh, in_specs=(param_specs, x_spec), out_specs=x_spec, check_vma=True
    )
    if schedule == "1f1b":
        mapped = one_f_one_b_pipeline(
            mapped,
            visit,
            schedules.one_f_one_b(S, M, R),
            mesh=mesh,
            param_specs=param_specs,
            x_spec=x_spec,
            stage_axis=stage_axis,
            stages=S,
            microbatches=M,
            repeats=R,
            layers_per_visit=lps,
            bubble_value=bubble_value,
        )
    # Explicit mesh axes need the inputs laid out as the in_specs say (Auto axes reshard in shard_map).
    params = jax.tree_util.tree_map(lambda w, sp: _lay_out(w, mesh, sp), params, param_specs)
    return mapped(params, _lay_out(x, mesh, x_spec))
