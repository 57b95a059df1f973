"""Placement: lay arrays and pytrees out on devices with one einshard expression.

``einshard(x, 'a b -> a@data b')`` places ``x`` (a numpy array, a jax.Array,
a tracer under ``jax.jit``, or a pytree of them); ``sharding`` and ``spec``
give the layout without moving data; ``describe`` reads a layout back.

Meshes come from ``mesh=``, else the mesh made current by ``jax.set_mesh``,
else (for ``einshard``) the mesh the array already lives on.  Count
expressions (einshard 0.2's ``a4``, ``*``) build an anonymous mesh over all
devices instead, cached per (devices, shape) so separate calls agree.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ._caches import cached
from ._compat import use_abstract_mesh
from .core.layout import Layout, resolve_counts, resolve_named
from .core.mesh import (
    MeshLike,
    as_mesh,
    auto_axes,
    current_concrete_mesh,
    eagerly_differentiated,
    explicit_axes,
    is_tracer,
    mesh_axes,
    operand_mesh,
    outside_jit,
    show_mesh,
)
from .errors import EinshardError
from .parsing import Expression, format_name, is_count_item, parse_placement
from .tree_rules import Rules, leaf_expressions

__all__ = ["einshard", "sharding", "spec", "describe", "layout", "anonymous_mesh", "current_mesh"]


# ---------------------------------------------------------------------------
# Meshes


# (devices, shape) -> Mesh.  The one piece of state einshard keeps: meshes, as JAX does.
_ANONYMOUS: dict[tuple[tuple[Any, ...], tuple[int, ...]], Mesh] = {}


def anonymous_mesh(shape: tuple[int, ...]) -> Mesh:
    """The canonical mesh count expressions use: all devices, axes ``a0, a1, ...``, Auto axis types.

    The same shape always gives the same Mesh object, so arrays placed by
    separate calls combine in one ``jax.jit`` without resharding.

    Example:
        >>> import einshard, jax
        >>> n = jax.device_count()
        >>> einshard.anonymous_mesh((n,)) is einshard.anonymous_mesh((n,))
        True
    """
    devices = tuple(jax.devices())
    key = (devices, tuple(shape))
    mesh = _ANONYMOUS.get(key)
    if mesh is None:
        names = tuple(f"a{i}" for i in range(len(shape)))
        # create_device_mesh is what einshard 0.2 uses: same device order, same shards.
        grid = mesh_utils.create_device_mesh(tuple(shape), devices=list(devices))
        mesh = _ANONYMOUS[key] = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(shape))
    return mesh


def is_anonymous(mesh: Any) -> bool:
    """Whether ``mesh`` is one of the anonymous meshes count expressions build."""
    return any(mesh is m for m in _ANONYMOUS.values())


def current_mesh() -> Mesh | None:
    """The concrete mesh made current by ``jax.set_mesh``, or None outside any mesh context or while tracing."""
    return current_concrete_mesh()


def _current_abstract_mesh() -> Any:
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def _tracing_in_mesh_context() -> bool:
    """Inside ``jax.jit`` under ``jax.set_mesh``: only the abstract mesh is current, no concrete one."""
    return current_concrete_mesh() is None and _current_abstract_mesh() is not None


# ---------------------------------------------------------------------------
# Expression -> layout -> sharding


def _layout(expr: Expression, shape: tuple[int, ...], mesh: Any) -> Layout:
    if expr.uses_counts:
        return resolve_counts(expr, shape, len(jax.devices()))
    return resolve_named(expr, shape, mesh_axes(mesh))


def _count_mesh_conflict(expr: Expression, mesh: Any, how: str) -> EinshardError:
    return expr.fail(
        f"counts ('a4', '*') build an anonymous mesh over all devices, but {how} {show_mesh(mesh)}; "
        "arrays on the two meshes would not combine",
        next(i.column for i in expr.output.items if is_count_item(i)),
        "Name that mesh's axes instead: 'a b -> a@data b'.",
    )


@cached(maxsize=8192)
def _resolve(text: str, shape: tuple[int, ...], mesh: Any) -> tuple[Layout, NamedSharding | None]:
    """(layout, sharding) for a placement; mesh is the explicit or context mesh, or None."""
    expr = parse_placement(text)
    if expr.uses_counts:
        layout = resolve_counts(expr, shape, len(jax.devices()))
        concrete = anonymous_mesh(tuple(m.size for m in layout.mesh))
        return layout, NamedSharding(concrete, layout.to_spec())
    if mesh is None:
        if expr.uses_mesh_axes:
            raise expr.fail(
                "the expression names mesh axes but there is no mesh",
                next(i.column for i in expr.output.axes if i.mesh_axes is not None),
                "Pass mesh=, or make one current: `with jax.set_mesh(jax.make_mesh((4, 2), ('data', 'model'))):`.",
            )
        # Nothing sharded and no mesh: replicate over all devices, as einshard 0.2's '* a b' does.
        return resolve_counts(parse_placement(_replicate_text(expr)), shape, len(jax.devices())), None
    layout = resolve_named(expr, shape, mesh_axes(mesh))
    # A NamedSharding on an AbstractMesh is what JAX uses under jit (reshard, ShapeDtypeStruct);
    # only placing data needs the concrete mesh, and _concrete_sharding checks that.
    return layout, NamedSharding(mesh, layout.to_spec())


def _replicate_text(expr: Expression) -> str:
    return str(expr).replace("->", "-> *", 1)


def _pick_mesh(expr_text: str, mesh: Any, x: Any = None) -> Any:
    mesh = _check_mesh(mesh)
    ctx = current_mesh() or _current_abstract_mesh()
    return _choose_mesh(expr_text, mesh, ctx, _own_mesh(x) if mesh is None and ctx is None else None)


def _check_mesh(mesh: Any) -> Any:
    """``mesh=`` checked; a dict of sizes becomes an AbstractMesh (enough for layouts and specs, not to place data)."""
    return None if mesh is None else as_mesh(mesh)


def _own_mesh(x: Any) -> Mesh | None:
    """The concrete mesh a jax.Array already lives on (None for host arrays)."""
    if not isinstance(x, jax.Array):
        return None
    own = getattr(x.sharding, "mesh", None)
    return own if isinstance(own, Mesh) else None


def _choose_mesh(expr_text: str, mesh: Any, ctx: Mesh | None, own: Mesh | None) -> Any:
    """The mesh a placement uses: mesh=, else the current mesh, else the array's own; None for counts.

    A pure function of its arguments, so that its result can be cached.
    """
    expr = parse_placement(expr_text)
    if expr.uses_counts:
        if mesh is not None:
            raise _count_mesh_conflict(expr, mesh, "mesh= gives")
        if ctx is not None:
            raise _count_mesh_conflict(expr, ctx, "jax.set_mesh made current")
        return None
    if mesh is not None:
        return mesh
    if ctx is not None:
        return ctx
    return own


@cached(maxsize=8192)
def _cached_eager_sharding(text: str, shape: tuple[int, ...], mesh: Any, ctx: Any, own: Any) -> NamedSharding:
    return _concrete_sharding(text, shape, _choose_mesh(text, mesh, ctx, own))


def _eager_sharding(text: str, x: Any, mesh: Any, ctx: Mesh | None) -> NamedSharding:
    """The sharding ``einshard(x, text, mesh=mesh)`` places ``x`` with, outside jit.

    The hot path of eager placement: one cache lookup keyed by everything the
    answer depends on (the text, the shape, and the three meshes it may come
    from), so a repeated call neither re-parses nor re-resolves.  ``ctx`` is
    ``current_mesh()``, read once by the caller, who has also checked ``mesh``
    with ``_check_mesh`` (before it is hashed as a key).  Errors are not
    cached (lru_cache keeps no exceptions): a bad call fails every time.
    """
    own = _own_mesh(x) if mesh is None and ctx is None else None
    return _cached_eager_sharding(text, tuple(x.shape), mesh, ctx, own)


def layout(expr: str, shape: tuple[int, ...], *, mesh: MeshLike | None = None) -> Layout:
    """The :class:`~einshard.core.layout.Layout` an expression gives an array of ``shape``.

    Example:
        >>> import einshard
        >>> str(einshard.layout('a b -> a4 b', (8, 3)))
        '[a:8@a0 b:3]'
    """
    text = _check_text(expr)
    return _resolve(text, _check_shape(shape, text), _pick_mesh(text, mesh))[0]


def sharding(expr: str, shape: tuple[int, ...], *, mesh: MeshLike | None = None) -> NamedSharding:
    """The ``NamedSharding`` an expression gives an array of ``shape``, without moving data.

    Use it for ``jax.jit(in_shardings=..., out_shardings=...)``, ``jax.ShapeDtypeStruct``
    and initialising a model directly sharded.

    Example:
        >>> import einshard, jax
        >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
        >>> einshard.sharding('b d -> b@data d', (8 * jax.device_count(), 4), mesh=mesh).spec == jax.P('data', None)
        True
    """
    text = _check_text(expr)
    shape = _check_shape(shape, text)
    chosen = _pick_mesh(text, mesh)
    lay, sh = _resolve(text, shape, chosen)
    if sh is None:
        return _replicated_everywhere(lay)
    return sh


def _replicated_everywhere(lay: Layout) -> NamedSharding:
    concrete = anonymous_mesh(tuple(m.size for m in lay.mesh))
    return NamedSharding(concrete, lay.to_spec())


def spec(expr: str, shape: tuple[int, ...] | None = None, *, mesh: MeshLike | None = None) -> PartitionSpec:
    """The ``PartitionSpec`` of an expression.

    ``shape`` is needed for ``...`` (to know the rank) and to check divisibility;
    mesh axis names are checked against ``mesh=`` or the current mesh when there is one.

    Example:
        >>> import einshard
        >>> tuple(einshard.spec('b s d -> b@(data,fsdp) s d'))
        (('data', 'fsdp'), None, None)
    """
    text = _check_text(expr)
    parsed = parse_placement(text)
    if shape is None:
        if parsed.inputs[0].has_ellipsis:
            raise parsed.fail("spec() needs the array's shape to expand '...'", None)
        shape = (0,) * len(parsed.inputs[0].axes)  # 0 divides evenly by anything
    shape = _check_shape(shape, text)
    if parsed.uses_counts:
        return PartitionSpec(*_resolve(text, shape, None)[0].spec_entries())
    chosen = _check_mesh(mesh) if mesh is not None else current_mesh() or _current_abstract_mesh()
    if chosen is None:
        # No mesh to check names against: read them off the expression.
        from .core.layout import expand_names

        names = expand_names(parsed, len(shape))
        dims = {i.name: i.mesh_axes or None for i in parsed.output.axes}
        return PartitionSpec(*[_entry(dims.get(n)) for n in names])
    return PartitionSpec(*resolve_named(parsed, shape, mesh_axes(chosen)).spec_entries())


def _entry(axes: tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _check_shape(shape: Any, text: str) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints, or an EinshardError saying what is wrong with it."""
    try:
        sizes = tuple(int(s) for s in shape)
        exact = all(int(s) == s for s in shape)
    except (TypeError, ValueError):
        sizes, exact = (), False
    if not exact or any(s < 0 for s in sizes):
        raise EinshardError(f"a shape is a tuple of non-negative integers, got {shape!r}", text)
    return sizes


def _check_text(expr: Any) -> str:
    if not isinstance(expr, str):
        raise EinshardError(f"an einshard expression is a string, got {type(expr).__name__}: {expr!r}")
    return expr


# ---------------------------------------------------------------------------
# Placing arrays


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _as_array(leaf: Any) -> np.ndarray:
    """A non-array pytree leaf (a Python number, a list) as a numpy array; anything else is an error."""
    arr = np.asarray(leaf)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise EinshardError(f"a leaf to place must be an array or a number, got {type(leaf).__name__}: {leaf!r:.60}")
    return arr


def einshard(x: Any, expr: Rules, *, mesh: MeshLike | None = None, process_local: bool = False) -> Any:
    """Lay ``x`` out on devices as ``expr`` says.

    Args:
        x: a numpy array, a jax.Array, a tracer (under ``jax.jit``), or a pytree of them.
        expr: one expression for every leaf, or an ordered mapping from path
            patterns (regular expressions searched in ``jax.tree_util.keystr(path)``;
            the first match wins; ``None`` leaves that leaf as it is) to expressions.
        mesh: the mesh for ``@`` expressions; default: the mesh current under
            ``jax.set_mesh``, else the mesh ``x`` already lives on.
        process_local: how ``x`` is read under ``jax.distributed``.  False
            (default): ``x`` is the global array, the same on every process
            (as with ``jax.device_put``; not checked), and each process
            transfers only the shards its own devices hold.  True: ``x`` is
            this process's own slice (as a data loader yields it); the global
            array is assembled from every process's slice, each axis as many
            times longer as there are processes splitting it.  On one process
            both read the same.

    Returns:
        ``x`` laid out: a jax.Array eagerly; under ``jax.jit`` the traced value
        with a sharding constraint (``reshard`` on Explicit mesh axes).

    Example:
        >>> import jax, numpy as np
        >>> from einshard import einshard
        >>> w = einshard(np.zeros((128, 8 * 32)), 'x y -> x y*')
        >>> w.sharding.shard_shape(w.shape)[1] == 256 // jax.device_count()
        True
    """
    if isinstance(expr, str) and _is_array(x):
        return _place_one(x, expr, mesh, process_local)
    return _place_tree(x, expr, mesh, process_local)


def _place_one(x: Any, text: str, mesh: Any, process_local: bool) -> Any:
    if isinstance(x, jax.core.Tracer):
        if process_local:
            raise parse_placement(text).fail(
                "process_local=True places each process's host data; under jax.jit values are already global",
                None,
                "Call einshard(batch, expr, process_local=True) outside jax.jit, then pass the result in.",
            )
        return _constrain(x, text, mesh)
    if process_local:
        return _from_process_local(x, text, _pick_mesh(text, mesh, x))
    mesh = _check_mesh(mesh)
    if _tracing_in_mesh_context() and not isinstance(mesh, Mesh):
        # A host constant inside jax.jit under jax.set_mesh: only the abstract mesh exists
        # here, so the constant becomes a traced value and gets a sharding constraint.
        return _constrain(jax.numpy.asarray(x), text, mesh)
    return _put(x, _eager_sharding(text, x, mesh, current_mesh()))


def _concrete_sharding(text: str, shape: tuple[int, ...], chosen: Any) -> NamedSharding:
    lay, sh = _resolve(text, tuple(shape), chosen)
    if sh is None:
        return _replicated_everywhere(lay)
    if not isinstance(sh.mesh, Mesh):
        raise EinshardError(
            f"placing data needs a concrete jax.sharding.Mesh (with devices); mesh= is {show_mesh(sh.mesh)}",
            text,
            hint="Pass a Mesh (jax.make_mesh(...)); a dict of sizes or an AbstractMesh only describes shapes "
            "(einshard.core.layout, einshard.spec, einshard.analyze).",
        )
    return sh


def _is_global(x: Any) -> bool:
    """A jax.Array spread over several processes (it already is the global array)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def _takes_own_shards(x: Any, sh: NamedSharding) -> bool:
    """Multi-process placement of a value this process holds whole (host array or local jax.Array)."""
    return not sh.is_fully_addressable and not _is_global(x)


def _put(x: Any, sh: NamedSharding) -> Any:
    if _takes_own_shards(x, sh):
        # x is the global value, the same on every process (as with jax.device_put).
        # Each process slices out and transfers only the shards its own devices
        # hold.  jax.device_put would also all-gather x across processes to check
        # that it is equal everywhere (a full copy of x over the network, per call)
        # and refuses a committed jax.Array on this process's devices.
        src = x if isinstance(x, jax.Array) else np.asarray(x)
        return jax.make_array_from_callback(src.shape, sh, lambda idx: src[idx])
    return jax.device_put(x, sh)


def _from_process_local(x: Any, text: str, chosen: Any) -> Any:
    expr = parse_placement(text)
    if _is_global(x):
        raise expr.fail(
            "process_local=True takes this process's own slice, but this jax.Array is already global "
            f"(it spans {len(x.sharding.device_set)} devices of several processes)",
            None,
            "Drop process_local=True to re-lay out a global array.",
        )
    local = x if isinstance(x, jax.Array) else np.asarray(x)
    # The global shape follows from the layout (how many processes split each
    # axis), and with '*' the layout follows from the global shape: start from
    # the layout of an unknown shape (0 divides by anything) and iterate to the
    # fixed point, so data are transferred once, with the final layout.
    sh = _concrete_sharding(text, (0,) * local.ndim, chosen)
    for _ in range(4):
        global_shape = _global_shape(expr, sh, tuple(local.shape))
        final = _concrete_sharding(text, global_shape, chosen)
        if final == sh:
            break
        sh = final
    else:
        raise expr.fail(
            f"cannot settle on a layout for process-local data of shape {tuple(local.shape)}: the '*' split "
            "depends on the global shape, which depends on the split",
            None,
            "Give explicit counts instead of '*', or name mesh axes with '@'.",
        )
    try:
        return jax.make_array_from_process_local_data(sh, local, global_shape)
    except ValueError as err:
        raise expr.fail(f"process-local data of shape {tuple(local.shape)} does not fit the layout: {err}") from None


def _global_shape(expr: Expression, sh: NamedSharding, local_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The global shape whose process-local slice (under ``sh``) has ``local_shape``.

    Along each axis split into ``n`` shards of which this process's devices
    hold ``k`` distinct ones, the process holds ``k/n`` of the axis: the global
    size is ``local * n / k`` (``n == k``: every process holds the whole axis).
    Found from the sharding alone (a probe shape of one element per shard), so
    no data move.
    """
    spec = tuple(sh.spec) + (None,) * (len(local_shape) - len(sh.spec))
    per_axis = [_split_count(sh.mesh, entry) for entry in spec]
    me = jax.process_index()
    held: list[set[int]] = [set() for _ in local_shape]
    for device, index in sh.devices_indices_map(tuple(per_axis)).items():
        if getattr(device, "process_index", 0) == me:
            for axis, part in enumerate(index):
                held[axis].add(part.start or 0)
    if not held or not held[0]:
        if not local_shape:
            return ()
        raise expr.fail(f"this process (index {me}) holds no device of the mesh, so it has no slice to give", None)
    out = []
    for axis, (size, n, mine) in enumerate(zip(local_shape, per_axis, held, strict=True)):
        k = len(mine)
        if k == n:  # the whole axis is here (the layout check then says whether it splits)
            out.append(size)
            continue
        if size % k:
            raise expr.fail(
                f"axis {axis} of the process-local data has size {size}, but this process holds {k} of its "
                f"{n} shards: the size must be a multiple of {k}",
                None,
            )
        out.append(size * n // k)
    return tuple(out)


def _split_count(mesh: Any, entry: Any) -> int:
    if entry is None:
        return 1
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return int(np.prod([mesh.shape[n] for n in names], dtype=np.int64))


def _constrain(x: Any, text: str, mesh: Any) -> Any:
    expr = parse_placement(text)
    if expr.uses_counts:
        chosen = _pick_mesh(text, mesh)
        # Under jit only the abstract mesh of jax.set_mesh is visible; refuse it as eagerly.
        ctx = _current_abstract_mesh()
        if ctx is not None:
            raise _count_mesh_conflict(expr, ctx, "jax.set_mesh made current")
        sh = _concrete_sharding(text, x.shape, chosen)
        return jax.lax.with_sharding_constraint(x, sh)
    target = mesh if mesh is not None else _current_abstract_mesh()
    if target is None:
        own = getattr(jax.typeof(x), "sharding", None)
        own_mesh = getattr(own, "mesh", None)
        target = own_mesh if own_mesh is not None and not own_mesh.empty else None
        if target is not None and outside_jit(x):
            # Eager jax.grad: the type names the abstract mesh, but the backward pass runs eagerly and
            # needs the devices, which the concrete array under the tracer has.
            target = _innermost_concrete_mesh(x) or target
    if target is None:
        raise expr.fail(
            "under jax.jit the expression needs a mesh: pass mesh= or call jax.jit inside `with jax.set_mesh(mesh):`",
            None,
        )
    lay = resolve_named(expr, tuple(x.shape), mesh_axes(target))
    types = dict(zip(target.axis_names, target.axis_types))
    if (
        isinstance(target, Mesh)
        and explicit_axes(target)
        and not auto_axes(target)  # with Auto axes too, the constraint's NamedSharding names the devices
        and _current_abstract_mesh() is None
        and not outside_jit(x)
        and operand_mesh(x) is None
    ):
        # JAX's rule: a value that lives on no mesh cannot be given Explicit axes of mesh= inside jax.jit
        # without the mesh context (it fails later, at dispatch, with "enter your jit into a mesh context").
        raise expr.fail(
            f"under jax.jit, laying out a value that lives on no mesh over the Explicit axes of mesh= "
            f"{show_mesh(target)} needs the mesh context",
            None,
            "Call the jitted function inside `with jax.set_mesh(mesh):`, or place the input with einshard() "
            "before jax.jit.",
        )
    if explicit_axes(target) and _current_abstract_mesh() is None and eagerly_differentiated(x):
        # JAX itself cannot transpose a reshard on Explicit axes outside a mesh context
        # (eager jax.grad fails with "Expected cotangent type ..."): say what works.
        raise expr.fail(
            "eager jax.grad through a layout on Explicit mesh axes needs the mesh context, "
            f"and none is current (mesh {show_mesh(target)})",
            None,
            "Call it inside `with jax.set_mesh(mesh):`, or under jax.jit.",
        )
    explicit = _restrict(lay, lambda m: types[m] == AxisType.Explicit)
    auto = _restrict(lay, lambda m: types[m] == AxisType.Auto)
    # Without a current mesh (the array's own mesh, or mesh= outside jax.set_mesh),
    # reshard needs one to read a PartitionSpec against: make the target current.
    scope = (
        use_abstract_mesh(target.abstract_mesh if isinstance(target, Mesh) else target)
        if _current_abstract_mesh() is None
        else contextlib.nullcontext()
    )
    has_explicit = any(t == AxisType.Explicit for t in types.values())
    has_auto = any(t == AxisType.Auto for t in types.values())

    def apply(v: Any) -> Any:
        if has_explicit:
            v = jax.sharding.reshard(v, NamedSharding(target, explicit) if isinstance(target, Mesh) else explicit)
        if has_auto:
            v = jax.lax.with_sharding_constraint(v, NamedSharding(target, auto))
        return v

    if has_explicit and has_auto and outside_jit(x):
        # On a mixed mesh, eager jax.grad cannot transpose the reshard/constraint pair op by op
        # (plain JAX fails with "Expected cotangent type"); staged together under jit it can.
        apply = jax.jit(apply)
    try:
        with scope:
            x = apply(x)
    except (ValueError, AssertionError) as err:  # JAX asserts when a constraint meets an Explicit mesh
        raise expr.fail(
            f"JAX refused the layout under jit: {err}",
            None,
            "With Explicit mesh axes, trace inside `with jax.set_mesh(mesh):`.",
        ) from None
    return x


def _innermost_concrete_mesh(x: Any) -> Mesh | None:
    """The concrete mesh of the array under eager-transformation tracers (None if it has none)."""
    while isinstance(x, jax.core.Tracer):
        kind = type(x).__name__
        x = x.primal if kind in ("JVPTracer", "LinearizeTracer") else x.val if kind == "BatchTracer" else None
    m = getattr(getattr(x, "sharding", None), "mesh", None)
    return m if isinstance(m, Mesh) else None


def _restrict(lay: Layout, keep: Any) -> PartitionSpec:
    entries = []
    for d in lay.dims:
        kept = tuple(m for m in d if keep(m))
        entries.append(_entry(kept))
    return PartitionSpec(*entries)


def _place_tree(x: Any, rules: Rules, mesh: Any, process_local: bool) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(x)
    texts = leaf_expressions(x, rules)
    mesh = _check_mesh(mesh)
    ctx = current_mesh()
    in_trace = _tracing_in_mesh_context() and not isinstance(mesh, Mesh)
    out: list[Any] = list(leaves)
    pending: list[int] = []
    shardings: list[NamedSharding] = []
    for i, (leaf, text) in enumerate(zip(leaves, texts)):
        if text is None:
            continue
        try:
            if not _is_array(leaf):
                leaf = _as_array(leaf)
                out[i] = leaf
            if isinstance(leaf, jax.core.Tracer) or process_local or in_trace:
                out[i] = _place_one(leaf, text, mesh, process_local)
                continue
            sh = _eager_sharding(text, leaf, mesh, ctx)
        except EinshardError as err:
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(x)[0][i][0])
            raise EinshardError(
                f"at {path} (shape {tuple(np.shape(leaf))}): {err.reason}",
                err.expression,
                err.column,
                err.hint,
            ) from None
        if _takes_own_shards(leaf, sh):
            out[i] = _put(leaf, sh)
            continue
        pending.append(i)
        shardings.append(sh)
    if pending:
        # One device_put for every leaf: one dispatch, transfers batched.
        placed = jax.device_put([out[i] for i in pending], shardings)
        for i, value in zip(pending, placed):
            out[i] = value
    return jax.tree_util.tree_unflatten(treedef, out)


# ---------------------------------------------------------------------------
# Reading a layout back


def describe(x: Any, names: str | None = None) -> str:
    """The expression that reproduces ``x``'s layout: ``einshard(y, describe(x))`` lays ``y`` out the same way.

    Arrays on an anonymous (count) mesh are described with counts; arrays on
    your own mesh with ``@`` (pass ``mesh=`` or set the mesh when reusing it).

    Args:
        x: a jax.Array (or anything with ``.shape`` and ``.sharding``).
        names: axis names to use, space separated (default ``a b c ...``).

    Example:
        >>> import einshard, numpy as np
        >>> einshard.describe(einshard(np.zeros((8, 4)), 'a b -> a* b'))  # doctest: +SKIP
        'a b -> a8 b'
    """
    shape = tuple(np.shape(x))
    axis_names = _default_names(len(shape)) if names is None else names.split()
    if len(axis_names) != len(shape):
        raise EinshardError(f"describe(): {len(axis_names)} names given for an array of rank {len(shape)}")
    left = " ".join(format_name(n) for n in axis_names)
    try:
        expr_left = parse_placement(f"{left} -> {left}")
    except EinshardError as err:
        raise EinshardError(f"describe(names={names!r}): the names do not make an expression: {err.reason}") from None
    sh = _traced_sharding(x, expr_left) if is_tracer(x) else getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding):
        if sh is not None and len(sh.device_set) > 1:
            raise EinshardError(f"describe() reads NamedShardings; this array has a {type(sh).__name__}")
        return f"{left} -> {left}"
    entries = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
    mesh = sh.mesh
    dims = [(() if e is None else (e,) if isinstance(e, str) else tuple(e)) for e in entries]
    unreduced = tuple(getattr(sh.spec, "unreduced", ()) or ())
    if is_anonymous(mesh) and all(len(d) <= 1 for d in dims) and not unreduced:
        owner = {d[0]: i for i, d in enumerate(dims) if d}
        right = []
        for axis_name in mesh.axis_names:
            size = mesh.shape[axis_name]
            if axis_name in owner:
                right.append(f"{format_name(axis_names[owner[axis_name]])}{size}")
            else:
                right.append(str(size))
        right.extend(format_name(axis_names[i]) for i, d in enumerate(dims) if not d)
        return f"{left} -> {' '.join(right)}"
    items = []
    for n, d in zip(axis_names, dims):
        text = format_name(n)
        if d:
            text += "@" + (d[0] if len(d) == 1 else "(" + ",".join(d) + ")")
        items.append(text)
    right_text = " ".join(items)
    if unreduced:
        right_text += " {U:" + ",".join(unreduced) + "}"
    return f"{left} -> {right_text}"


def _traced_sharding(x: Any, expr: Expression) -> Any:
    """A traced value's sharding, read from its type (JAX's sharding-in-types).

    The type carries the Explicit mesh axes only: how Auto axes split the value
    is decided by XLA after tracing, so a value on a mesh with Auto axes cannot
    be described while tracing (saying "replicated" would be silently wrong).
    """
    sh = getattr(jax.typeof(x), "sharding", None)
    m = getattr(sh, "mesh", None)
    if m is None or m.empty:
        return None
    auto = auto_axes(m)
    if auto:
        raise expr.fail(
            f"describe() of a traced value reads its layout from its type, which says nothing of the Auto mesh "
            f"axes {sorted(auto)} (XLA chooses their layout after tracing)",
            None,
            "Call describe() on the result outside jax.jit, or use a mesh with Explicit axes "
            "(jax.make_mesh's default) whose layouts the type carries.",
        )
    return sh


def _default_names(n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [letters[i] if i < 26 else f"a{i}" for i in range(n)]
