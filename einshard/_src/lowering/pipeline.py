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

``first=`` / ``last=`` (:class:`~.pipeline_stages.PipelineEnd`) run an input function (an embedding) before
the first stage and an output function (head and per-example loss) after the last, their params split over
the stage axis rather than copied to every stage (:mod:`.pipeline_stages`).  Schedule numbers and argument
checks live in :mod:`.pipeline_info`.  A stage axis of size 1 runs every schedule as the sequential model.

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

import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .._checks import check_bool, describe_value, naming
from ..core.logical import AxisRulesLike, takes_axis_rules
from ..core.mesh import AnyMesh, MeshLike
from ..errors import EinshardError
from . import schedules
from .pipeline_1f1b import one_f_one_b_pipeline
from .pipeline_info import PipelineInfo, data_axes, leaf_shape, mesh_or_context, pipeline_info
from .pipeline_stages import ParamLayouts, PipelineEnd, lay_out, layer_specs, run_end
from .staging import staged
from .steps import vary as _vary
from .steps import varying_axes as _varying

__all__ = ["PipelineInfo", "PipelineEnd", "pipeline", "pipeline_info", "circular_layer_order"]


def _save_all_but_slices(prim: Any, *_: Any, **__: Any) -> bool:
    """A checkpoint policy: save every residual except dynamic slices (a circular round's weights: re-sliced)."""
    return prim is not jax.lax.dynamic_slice_p


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
        shape = leaf_shape(path, w)
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


@takes_axis_rules()
def pipeline(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: Any,
    *,
    microbatches: int,
    schedule: str = "gpipe",
    repeats: int = 1,
    mesh: MeshLike | None = None,
    stage_axis: str = "stage",
    data_axis: str | tuple[str, ...] | None = None,
    param_layouts: ParamLayouts = None,
    layers_in_circular_order: bool = False,
    remat: bool = False,
    sanitize: bool = True,
    bubble_value: float = 0.0,
    first: PipelineEnd | None = None,
    last: PipelineEnd | None = None,
    axis_rules: AxisRulesLike | None = None,
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
        first: a :class:`PipelineEnd` run on ``x`` before the first layer (e.g. an embedding),
            its params split over the stage axis (:mod:`.pipeline_stages`); ``x`` is then its input.
        last: a :class:`PipelineEnd` run on the last layer's output (e.g. the head and per-example loss).

    Returns:
        ``[B, ...]``, the last layer's output (or ``last``'s), laid out like ``x``.
    """
    mesh = mesh_or_context(mesh, (params, x))
    if not callable(layer_fn):
        raise EinshardError(f"layer_fn must be callable, got {type(layer_fn).__name__}")
    for name, flag in (("layers_in_circular_order", layers_in_circular_order), ("sanitize", sanitize)):
        check_bool(flag, "einshard.pipeline", name)
    # NaN and infinities are fine here: tests fill the bubbles with NaN to show none leaks into the result.
    if isinstance(bubble_value, (bool, np.bool_)) or not isinstance(bubble_value, numbers.Real):
        raise EinshardError(f"einshard.pipeline: bubble_value= takes a number, got {describe_value(bubble_value)}")
    counts = dict(microbatches=microbatches, schedule=schedule, repeats=repeats, stage_axis=stage_axis)
    info = pipeline_info(params, x, mesh=mesh, data_axis=data_axis, remat=remat, **counts)  # type: ignore[arg-type]
    data = data_axes(data_axis)
    batch_entry = data[0] if len(data) == 1 else (data or None)
    ends = dict(mesh=mesh, stage_axis=stage_axis, batch_entry=batch_entry)
    if first is not None:
        x = run_end(first, x, "first", **ends)
        info = pipeline_info(params, x, mesh=mesh, data_axis=data_axis, remat=remat, **counts)  # type: ignore[arg-type]
    y = _layers(
        layer_fn,
        params,
        x,
        info,
        mesh=mesh,
        data=data,
        param_layouts=param_layouts,
        layers_in_circular_order=layers_in_circular_order,
        remat=remat,
        sanitize=sanitize,
        bubble_value=bubble_value,
        stage_axis=stage_axis,
    )
    return y if last is None else run_end(last, y, "last", **ends)


def _layers(
    layer_fn: Callable[[Any, jax.Array], jax.Array],
    params: Any,
    x: Any,
    info: PipelineInfo,
    *,
    mesh: AnyMesh,
    data: tuple[str, ...],
    param_layouts: ParamLayouts,
    layers_in_circular_order: bool,
    remat: bool,
    sanitize: bool,
    bubble_value: float,
    stage_axis: str,
) -> jax.Array:
    """The pipeline over the stacked layers (the schedule in ``info``), one shard_map."""
    schedule, microbatches, repeats = info.schedule, info.microbatches, info.repeats
    S, M, R, lps = info.stages, microbatches, repeats, info.layers_per_visit
    if R > 1 and not layers_in_circular_order:
        params = circular_layer_order(params, S, R)
    with naming("einshard.pipeline", "param_layouts"):
        param_specs = layer_specs(params, param_layouts, stage_axis, mesh)
    x_spec = PartitionSpec(data[0] if len(data) == 1 else (data or None), *([None] * (np.ndim(x) - 1)))
    T = info.iterations

    # The program depends only on this static description (shapes and dtypes are jit's to key on): an eager
    # call with the same layer function, schedule, mesh and specs reuses the jitted program (no recompiling).
    flat_specs, spec_tree = jax.tree_util.tree_flatten(param_specs, is_leaf=lambda s: isinstance(s, PartitionSpec))
    key = (
        "pipeline",
        layer_fn,
        info,
        mesh,
        data,
        tuple(flat_specs),
        spec_tree,
        x_spec,
        remat,
        sanitize,
        bubble_value,
        stage_axis,
    )

    def build() -> Callable[[Any, Any], jax.Array]:
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
                if (
                    R == 1
                ):  # every visit runs all local layers: no slice (its transpose would add a zero buffer per step)
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

        # Staged with jax.jit (as every einshard shard_map): an eager shard_map runs its body one primitive at a
        # time; under an outer jit, grad or vmap the inner jit is inlined.
        mapped: Callable[[Any, Any], jax.Array] = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=(param_specs, x_spec), out_specs=x_spec, check_vma=True)
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
        return mapped

    mapped = staged(key, build)
    # Explicit mesh axes need the inputs laid out as the in_specs say (Auto axes reshard in shard_map).
    params = jax.tree_util.tree_map(lambda w, sp: lay_out(w, mesh, sp), params, param_specs)
    return mapped(params, lay_out(x, mesh, x_spec))
