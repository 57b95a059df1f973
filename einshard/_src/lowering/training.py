"""Explicit data parallelism and FSDP (ZeRO-3) for a loss function, as one ``jax.shard_map``.

One convention, and AD does the rest: the loss is the *mean over the whole
batch*, taken inside the shard_map (``pmean`` of the per-device means over the
batch axis), and ``jax.grad`` of the returned function produces every gradient
collective (``check_vma=True``):

* :func:`data_parallel` — params replicated over the batch axis; their
  gradients are all-reduced by the transpose of the implicit broadcast.
* :func:`fsdp` — each weight stored split over the FSDP axis along a dimension
  that divides (einshard expressions, path-pattern rules, or :func:`fsdp_layouts`
  to choose), all-gathered inside the loss just before it runs; AD turns each
  all-gather into a reduce-scatter, so every gradient arrives already split like
  its weight.  ``remat=True`` re-gathers in the backward pass instead of keeping
  the gathered weights alive (``jax.checkpoint`` with a policy that saves
  everything except the gathered weights).
* Tensor parallelism composes: lay weights out over a model axis as well
  (``'d f -> d@data f@model'``); ``loss_fn`` then sees the model-axis blocks
  (shard_map's local view) and does its own model-axis collectives.

No hand-written gradient sync (DistJax's ``pmean`` of already-sharded FSDP
gradients is exactly the bug this convention cannot have).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> mesh = jax.make_mesh((4,), ('data',), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])
    >>> def loss_fn(p, batch):
    ...     return jnp.mean((batch['x'] @ p['w'] - batch['y']) ** 2)
    >>> params = {'w': np.ones((4, 2), np.float32)}
    >>> batch = {'x': np.ones((8, 4), np.float32), 'y': np.zeros((8, 2), np.float32)}
    >>> loss = fsdp(loss_fn, {'w': 'd f -> d@data f'}, mesh=mesh)
    >>> value, grads = jax.value_and_grad(loss)(params, batch)
    >>> float(value), grads['w'].sharding.shard_shape(grads['w'].shape)  # the gradient is laid out like w
    (16.0, (1, 2))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec

from .._checks import check_bool, check_callable, check_str_or_strs, naming
from ..core.logical import AxisRulesLike, takes_axis_rules
from ..core.mesh import AnyMesh, MeshLike, mesh_axes
from ..errors import EinshardError
from ..placement import spec as einshard_spec
from ..tree_rules import leaf_expressions
from .steps import check_lowering_context, lowering_mesh, place

__all__ = ["data_parallel", "fsdp", "fsdp_layouts", "gather_params"]

Layouts = str | Mapping[str, "str | None"] | Any  # one expression, path rules, or a pytree of expressions

GATHERED = "einshard_fsdp_gathered"  # the checkpoint name of gathered weights (remat re-gathers them)


def _axes(axis: str | tuple[str, ...]) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _entry(axes: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _check_leaves(tree: Any, what: str) -> None:
    """Every leaf is an array of numbers (or bools); else an error naming the leaf's path."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            try:
                dtype = np.asarray(leaf).dtype
            except Exception:  # noqa: BLE001 - whatever it is, it is not an array
                dtype = np.dtype(object)
        if not (jax.numpy.issubdtype(dtype, np.number) or jax.numpy.issubdtype(dtype, np.bool_)):
            shown = repr(leaf)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise EinshardError(
                f"the {what} leaf at {jax.tree_util.keystr(path) or '(the root)'} is a {type(leaf).__name__} "
                f"({shown}), not an array of numbers",
                hint=f"Keep only arrays in the {what} pytree (static settings belong in loss_fn's closure).",
            )


def _check_axes(axes: tuple[str, ...], mesh: AnyMesh, what: str) -> None:
    names = [m.name for m in mesh_axes(mesh)]
    for a in axes:
        if not isinstance(a, str) or a not in names:
            raise EinshardError(f"{what}={a!r} is not an axis of the mesh (its axes: {', '.join(names)})")


def _batch_specs(batch: Any, batch_axes: tuple[str, ...], mesh: AnyMesh) -> list[PartitionSpec]:
    """Each batch leaf split along its first dimension over the batch axes (which must divide it)."""
    n = math.prod(dict(mesh.shape)[a] for a in batch_axes)
    specs = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = np.shape(leaf)
        where = jax.tree_util.keystr(path) or "(the root)"
        if not shape:
            raise EinshardError(
                f"the batch leaf at {where} is a scalar: it has no batch dimension to split over {batch_axes}",
                hint="Give it a leading batch dimension, or pass batch_layouts= (None: replicated).",
            )
        if shape[0] % n or shape[0] == 0:
            raise EinshardError(
                f"the batch leaf at {where} has {shape[0]} rows, which do not split evenly over "
                f"{'x'.join(batch_axes)} ({n} devices)",
                hint=f"Use a batch size that is a positive multiple of {n}.",
            )
        specs.append(PartitionSpec(_entry(batch_axes), *([None] * (len(shape) - 1))))
    return specs


def _is_layout(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _expressions(tree: Any, layouts: Layouts) -> list[str | None]:
    """One expression (or None: replicated) per leaf of ``tree``.

    Path-pattern rules go through einshard's one matcher (:mod:`einshard.tree_rules`): the first pattern
    found in a leaf's path wins, a leaf no pattern matches or a pattern that is not a regular expression is
    an EinshardError naming it, None leaves the leaf replicated.
    """
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    if layouts is None or isinstance(layouts, str):
        return [layouts] * len(leaves)
    if isinstance(layouts, Mapping):
        # A dict with the same structure as the params is a pytree of expressions, not rules.
        same = bool(jax.tree_util.tree_structure(layouts, is_leaf=_is_layout) == jax.tree_util.tree_structure(tree))  # type: ignore[operator]
        if not same:
            # Rules: string patterns (leaf_expressions refuses any other key, bytes included, by name).
            return list(leaf_expressions(tree, layouts))
    flat = jax.tree_util.tree_leaves(layouts, is_leaf=_is_layout)
    if len(flat) != len(leaves):
        raise EinshardError(f"{len(flat)} layouts given for a params tree of {len(leaves)} leaves")
    return list(flat)


def _specs(tree: Any, layouts: Layouts, mesh: AnyMesh) -> list[PartitionSpec]:
    specs = []
    for (path, leaf), text in zip(jax.tree_util.tree_leaves_with_path(tree), _expressions(tree, layouts), strict=True):
        if text is None:
            specs.append(PartitionSpec())
            continue
        try:
            specs.append(einshard_spec(text, tuple(np.shape(leaf)), mesh=mesh))
        except EinshardError as err:
            key = jax.tree_util.keystr(path)
            raise EinshardError(f"at {key}: {err.reason}", err.expression, err.column, err.hint) from None
    return specs


def fsdp_layouts(params: Any, *, axis: str = "data", size: int, min_elements: int = 0) -> Any:
    """Choose an FSDP layout per leaf: its largest dimension that ``size`` divides, split over ``axis``.

    Leaves with fewer than ``min_elements`` elements, or with no dimension that
    divides, stay replicated (``None``).  Returns a pytree of expressions for
    :func:`fsdp` (or :func:`einshard.einshard`).

    Example:
        >>> import numpy as np
        >>> fsdp_layouts({'w': np.zeros((3, 8)), 'b': np.zeros(3)}, size=4)
        {'b': None, 'w': 'a b -> a b@data'}
    """

    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise EinshardError(
            f"fsdp_layouts: size= is the number of devices on {axis!r}, a positive integer; got {size!r}"
        )
    if not isinstance(axis, str) or not axis:
        raise EinshardError(f"fsdp_layouts: axis= is one mesh axis name, got {axis!r}")
    if isinstance(min_elements, bool) or not isinstance(min_elements, int) or min_elements < 0:
        raise EinshardError(f"fsdp_layouts: min_elements= is a non-negative integer, got {min_elements!r}")
    _check_leaves(params, "params")

    def one(leaf: Any) -> str | None:
        shape = np.shape(leaf)
        if math.prod(shape) < min_elements:
            return None
        fits = [d for d in range(len(shape)) if shape[d] >= size and shape[d] % size == 0]
        if not fits:
            return None
        best = max(fits, key=lambda d: (shape[d], -d))
        names = [chr(ord("a") + i) for i in range(len(shape))]
        right = [n + (f"@{axis}" if i == best else "") for i, n in enumerate(names)]
        return f"{' '.join(names)} -> {' '.join(right)}"

    return jax.tree_util.tree_map(one, params)


def gather_params(blocks: Any, specs: Any, axis: str | tuple[str, ...], *, name: str | None = GATHERED) -> Any:
    """Inside a shard_map body: all-gather every leaf over the FSDP ``axis`` along the dimension it splits.

    Use it per layer (inside a scan over layers) to gather each layer's weights
    just before that layer runs.  The gather is typed *varying*, so its
    transpose is a reduce-scatter of the gradient.  Leaves ``axis`` does not
    split are returned as they are; ``axis`` must be the minor-most mesh axis of
    the dimension it splits.
    """
    gather_axes = _axes(axis)

    def one(block: Any, spec: PartitionSpec) -> Any:
        for dim, entry in enumerate(spec):
            entry_axes = () if entry is None else _axes(entry)
            hit = [a for a in gather_axes if a in entry_axes]
            if not hit:
                continue
            if entry_axes[len(entry_axes) - len(hit) :] != tuple(hit):
                raise EinshardError(
                    f"FSDP axes {hit} must be the minor mesh axes of dimension {dim} (laid out over {entry_axes})"
                )
            full = jax.lax.all_gather(block, _entry(tuple(hit)), axis=dim, tiled=True)
            return checkpoint_name(full, name) if name else full
        return block

    return jax.tree_util.tree_map(one, blocks, specs, is_leaf=lambda v: isinstance(v, PartitionSpec))


def _not_gathered(prim: Any, *_: Any, **params: Any) -> bool:
    """Remat policy: save every residual except gathered weights.

    Both the all-gather's output and its named alias must be refused: saving
    either would keep the whole weight alive.  (All-gathers inside ``loss_fn``
    are recomputed too.)
    """
    name = str(prim)
    return name != "all_gather" and not (name == "name" and params.get("name") == GATHERED)


def _sharded_loss(
    loss_fn: Callable[[Any, Any], jax.Array],
    param_layouts: Layouts,
    *,
    mesh: MeshLike | None,
    batch_axis: str | tuple[str, ...],
    batch_layouts: Layouts,
    gather_axis: tuple[str, ...] | None,
    remat: bool,
) -> Callable[[Any, Any], jax.Array]:
    what = "einshard.fsdp" if gather_axis is not None else "einshard.data_parallel"
    check_callable(loss_fn, what, "loss_fn")
    check_bool(remat, what, "remat")
    batch_axes = check_str_or_strs(batch_axis, what, "batch_axis")

    def run(params: Any, batch: Any) -> jax.Array:
        _check_leaves(params, "params")
        _check_leaves(batch, "batch")
        the_mesh = lowering_mesh(mesh, (params, batch), what=what)
        _check_axes(batch_axes, the_mesh, "batch_axis")
        if gather_axis:
            _check_axes(gather_axis, the_mesh, "fsdp_axis")
        check_lowering_context(the_mesh, (params, batch), what=what)
        p_leaves, p_def = jax.tree_util.tree_flatten(params)
        with naming(what, "param_layouts"):
            p_specs = _specs(params, param_layouts, the_mesh)
        if batch_layouts is None:
            b_specs = _batch_specs(batch, batch_axes, the_mesh)
        else:
            with naming(what, "batch_layouts"):
                b_specs = _specs(batch, batch_layouts, the_mesh)
        b_leaves, b_def = jax.tree_util.tree_flatten(batch)
        p_spec_tree = jax.tree_util.tree_unflatten(p_def, p_specs)

        def use(blocks: Any, local_batch: Any) -> jax.Array:
            if gather_axis:
                blocks = gather_params(blocks, p_spec_tree, gather_axis)
            loss = loss_fn(blocks, local_batch)
            if not hasattr(loss, "shape") or tuple(loss.shape) != ():
                shape = getattr(loss, "shape", None)
                raise EinshardError(
                    f"{what}: loss_fn must return one number (the mean loss of its batch block), "
                    + (
                        f"got an array of shape {tuple(shape)}" if shape is not None else f"got a {type(loss).__name__}"
                    ),
                    hint="Reduce it inside loss_fn, e.g. `return jnp.mean(per_example_losses)`.",
                )
            return loss

        if remat:
            use = jax.checkpoint(use, policy=_not_gathered)

        def body(blocks: Any, local_batch: Any) -> jax.Array:
            # The mean over the whole batch: equal per-device batches, so the mean of means.
            return jax.lax.pmean(use(blocks, local_batch), _entry(batch_axes))

        mapped = jax.jit(  # staged: an eager shard_map runs one primitive at a time
            jax.shard_map(
                body,
                mesh=the_mesh,
                in_specs=(p_spec_tree, jax.tree_util.tree_unflatten(b_def, b_specs)),
                out_specs=PartitionSpec(),
                check_vma=True,
            )
        )
        placed_p = [place(x, the_mesh, s) for x, s in zip(p_leaves, p_specs, strict=True)]
        placed_b = [place(x, the_mesh, s) for x, s in zip(b_leaves, b_specs, strict=True)]
        return mapped(jax.tree_util.tree_unflatten(p_def, placed_p), jax.tree_util.tree_unflatten(b_def, placed_b))

    return run


@takes_axis_rules(binds_result=True)
def data_parallel(
    loss_fn: Callable[[Any, Any], jax.Array],
    *,
    mesh: MeshLike | None = None,
    batch_axis: str | tuple[str, ...] = "data",
    param_layouts: Layouts = None,
    batch_layouts: Layouts = None,
    axis_rules: AxisRulesLike | None = None,
) -> Callable[[Any, Any], jax.Array]:
    """The global-mean loss of ``loss_fn(params, local_batch)`` with the batch split over ``batch_axis``.

    ``loss_fn`` returns the mean loss of the batch block it is given.  Params are
    replicated (or laid out by ``param_layouts``, e.g. over a model axis for
    DP x TP).  Batch leaves are split along their first dimension unless
    ``batch_layouts`` says otherwise.  Differentiate the result with ``jax.grad``:
    the gradient all-reduce over ``batch_axis`` comes from AD.

    Example:
        >>> import jax, jax.numpy as jnp, numpy as np
        >>> mesh = jax.make_mesh((2,), ('data',), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
        >>> loss = data_parallel(lambda p, x: jnp.mean(x * p), mesh=mesh)
        >>> float(jax.grad(loss)(np.float32(3.0), np.arange(4.0, dtype=np.float32)))
        1.5
    """
    return _sharded_loss(
        loss_fn,
        param_layouts,
        mesh=mesh,
        batch_axis=batch_axis,
        batch_layouts=batch_layouts,
        gather_axis=None,
        remat=False,
    )


@takes_axis_rules(binds_result=True)
def fsdp(
    loss_fn: Callable[[Any, Any], jax.Array],
    param_layouts: Layouts,
    *,
    mesh: MeshLike | None = None,
    batch_axis: str | tuple[str, ...] = "data",
    fsdp_axis: str | tuple[str, ...] | None = None,
    batch_layouts: Layouts = None,
    remat: bool = False,
    axis_rules: AxisRulesLike | None = None,
) -> Callable[[Any, Any], jax.Array]:
    """Like :func:`data_parallel`, with weights stored split over the FSDP axis and gathered for use.

    Args:
        loss_fn: ``loss_fn(params, local_batch) -> mean loss`` on whole (gathered) weights;
            with tensor parallelism, on their model-axis blocks.
        param_layouts: how params are stored: one expression, path-pattern rules
            (``{'kernel': 'd f -> d@data f', '.*': None}``; None = replicated), or a
            pytree of expressions such as :func:`fsdp_layouts` returns.
        fsdp_axis: the mesh axis (axes) weights are split over; default ``batch_axis``.
        remat: re-gather weights in the backward pass instead of keeping them.
        axis_rules: a table from logical axis names to mesh axes for ``param_layouts``/``batch_layouts``;
            it is made current again whenever the returned loss is called (docs/logical-axes.md).

    Gradients come back laid out like the stored weights (reduce-scattered by AD).
    """
    batch_axes = check_str_or_strs(batch_axis, "einshard.fsdp", "batch_axis")
    gather = batch_axes if fsdp_axis is None else check_str_or_strs(fsdp_axis, "einshard.fsdp", "fsdp_axis")
    return _sharded_loss(
        loss_fn,
        param_layouts,
        mesh=mesh,
        batch_axis=batch_axis,
        batch_layouts=batch_layouts,
        gather_axis=gather,
        remat=remat,
    )
