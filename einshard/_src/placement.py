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

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ._caches import cached
from ._checks import check_bool, describe_value
from ._placement.agreement import check_placement, checking
from ._placement.describe import describe
from ._placement.meshes import (
    anonymous_mesh,
    check_mesh,
    choose_mesh,
    current_abstract_mesh,
    is_anonymous,
    pick_mesh,
    placed_mesh,
    tracing_in_mesh_context,
)
from ._placement.process_local import from_process_local, is_global
from ._placement.resolve import (
    concrete_sharding,
    replicated_everywhere,
    spec_entry,
)
from ._placement.resolve import (
    resolve_layout as resolve_layout,
)
from ._placement.traced import constrain
from .core.layout import Layout, resolve_named
from .core.logical import AxisRules, AxisRulesLike, current_axis_rules, resolve_expression, scoped_axis_rules
from .core.mesh import AnyMesh, MeshLike, current_concrete_mesh, mesh_axes
from .errors import EinshardError
from .parsing import Expression, parse_placement
from .tree_rules import Rules, leaf_expressions

__all__ = ["einshard", "sharding", "spec", "describe", "layout", "anonymous_mesh", "is_anonymous"]

# ---------------------------------------------------------------------------
# Expression -> layout -> sharding


def layout(
    expr: str, shape: tuple[int, ...], *, mesh: MeshLike | None = None, axis_rules: AxisRulesLike | None = None
) -> Layout:
    """The :class:`~einshard.core.layout.Layout` an expression gives an array of ``shape``.

    Example:
        >>> import einshard
        >>> str(einshard.layout('a b -> a4 b', (8, 3)))
        '[a:8@a0 b:3]'
    """
    if axis_rules is not None:  # (a branch, not a null context: the call without rules stays as fast)
        with scoped_axis_rules(axis_rules):
            return layout(expr, shape, mesh=mesh)
    text = _check_text(expr)
    shape = _check_shape(shape, text)
    parsed, chosen = _parsed_and_mesh(text, mesh)
    return resolve_layout(parsed, shape, chosen)[0]


def sharding(
    expr: str, shape: tuple[int, ...], *, mesh: MeshLike | None = None, axis_rules: AxisRulesLike | None = None
) -> NamedSharding:
    """The ``NamedSharding`` an expression gives an array of ``shape``, without moving data.

    Use it for ``jax.jit(in_shardings=..., out_shardings=...)``, ``jax.ShapeDtypeStruct``
    and initialising a model directly sharded.

    Example:
        >>> import einshard, jax
        >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
        >>> einshard.sharding('b d -> b@data d', (8 * jax.device_count(), 4), mesh=mesh).spec == jax.P('data', None)
        True
    """
    if axis_rules is not None:
        with scoped_axis_rules(axis_rules):
            return sharding(expr, shape, mesh=mesh)
    text = _check_text(expr)
    shape = _check_shape(shape, text)
    parsed, chosen = _parsed_and_mesh(text, mesh)
    lay, sh = resolve_layout(parsed, shape, chosen)
    if sh is None:
        return replicated_everywhere(lay)
    return sh


def spec(
    expr: str,
    shape: tuple[int, ...] | None = None,
    *,
    mesh: MeshLike | None = None,
    axis_rules: AxisRulesLike | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of an expression.

    ``shape`` is needed for ``...`` (to know the rank) and to check divisibility;
    mesh axis names are checked against ``mesh=`` or the current mesh when there is one.

    Example:
        >>> import einshard
        >>> tuple(einshard.spec('b s d -> b@(data,fsdp) s d'))
        (('data', 'fsdp'), None, None)
    """
    if axis_rules is not None:
        with scoped_axis_rules(axis_rules):
            return _spec(_check_text(expr), shape, mesh)
    return _spec(_check_text(expr), shape, mesh)


def _spec(text: str, shape: tuple[int, ...] | None, mesh: MeshLike | None) -> PartitionSpec:
    parsed = parse_placement(text)
    if shape is None:
        if parsed.inputs[0].has_ellipsis:
            raise parsed.fail("spec() needs the array's shape to expand '...'", None)
        shape = (0,) * len(parsed.inputs[0].axes)  # 0 divides evenly by anything
    shape = _check_shape(shape, text)
    if parsed.uses_counts:
        return PartitionSpec(*resolve_layout(parsed, shape, None)[0].spec_entries())
    chosen = check_mesh(mesh) if mesh is not None else current_concrete_mesh() or current_abstract_mesh()
    if chosen is None:
        # No mesh to check names against: read them off the expression.
        from .core.layout import expand_names

        parsed = resolve_expression(parsed, None)  # logical names through the current rules, if any
        names = expand_names(parsed, len(shape))
        dims = {i.name: i.mesh_axes or None for i in parsed.output.axes}
        return PartitionSpec(*[spec_entry(dims.get(n)) for n in names])
    return PartitionSpec(*resolve_named(parsed, shape, mesh_axes(chosen)).spec_entries())


def _parsed_and_mesh(text: str, mesh: MeshLike | None) -> tuple[Expression, AnyMesh | None]:
    """The expression, parsed once here at the entry, and the mesh it is placed on (None for counts).

    ``mesh=`` is checked before the text is parsed, so that a call wrong in both says what it always said.
    """
    checked = check_mesh(mesh)
    parsed = parse_placement(text)
    return parsed, pick_mesh(parsed, checked)


def _check_shape(shape: Any, text: str) -> tuple[int, ...]:
    """A shape as a tuple of non-negative ints, or an EinshardError saying what is wrong with it."""
    # Integers only (Python or numpy; 8.0 is refused as jnp.zeros refuses it): a str or a float would be
    # read digit by digit or rounded, giving a layout for an array that does not exist.
    if isinstance(shape, (tuple, list)) and all(
        isinstance(s, (int, np.integer)) and not isinstance(s, bool) and s >= 0 for s in shape
    ):
        return tuple(int(s) for s in shape)
    raise EinshardError(f"shape= takes a tuple of non-negative integers, got {describe_value(shape)}", text)


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
    if isinstance(leaf, np.ndarray):
        _check_host_dtype(leaf)
        return leaf
    try:
        arr = np.asarray(leaf)
    except (TypeError, ValueError):  # ragged lists, objects numpy cannot convert
        arr = np.empty((), dtype=object)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise EinshardError(f"a leaf to place must be an array or a number, got {type(leaf).__name__}: {leaf!r:.60}")
    return arr


def einshard(
    x: Any,
    expr: Rules,
    *,
    mesh: MeshLike | None = None,
    process_local: bool = False,
    axis_rules: AxisRulesLike | None = None,
) -> Any:
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
        axis_rules: a table from logical axis names to mesh axes for ``@batch``-style names
            (``{'batch': ('data', 'fsdp'), 'embed': None}`` or Flax's list of pairs); default the table
            made current by ``with einshard.axis_rules(...)``.  See docs/logical-axes.md.

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
    if axis_rules is not None:
        with scoped_axis_rules(axis_rules):
            return einshard(x, expr, mesh=mesh, process_local=process_local)
    if checking() and not any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(x)):
        # Several processes: they must place the same shapes and layouts (einshard.multihost.unchecked skips it).
        check_placement(x, expr, mesh, process_local)
    if isinstance(expr, str) and _is_array(x):
        return _place_one(x, expr, mesh, process_local)
    return _place_tree(x, expr, mesh, process_local)


def _check_host_dtype(x: Any) -> None:
    """A numpy array JAX can hold: strings, bytes, objects and structured records it cannot (raw TypeErrors)."""
    dt = x.dtype
    if dt.kind in "OUS" or (dt.kind == "V" and (dt.names is not None or dt.name.startswith("void"))):
        raise EinshardError(
            f"einshard: x= is a numpy array of {dt} ({dt.kind!r} kind), which JAX cannot place on devices; "
            "arrays to place hold numbers or bools"
        )


def _place_one(x: Any, text: str, mesh: MeshLike | None, process_local: bool) -> Any:
    """One array placed: ``text`` is parsed here, once, and the parsed expression goes down."""
    if process_local.__class__ is not bool:
        check_bool(process_local, "einshard", "process_local")
    if x.__class__ is np.ndarray or isinstance(x, np.generic):
        _check_host_dtype(x)
    if isinstance(x, jax.core.Tracer):
        expr = parse_placement(text)
        if process_local:
            raise expr.fail(
                "process_local=True places each process's host data; under jax.jit values are already global",
                None,
                "Call einshard(batch, expr, process_local=True) outside jax.jit, then pass the result in.",
            )
        return constrain(x, expr, check_mesh(mesh))
    checked = check_mesh(mesh)  # (before the expression: a bad mesh= is reported first, as it always was)
    if process_local:
        expr = parse_placement(text)
        return from_process_local(x, expr, pick_mesh(expr, checked, x))
    if tracing_in_mesh_context() and not isinstance(checked, Mesh):
        # A host constant inside jax.jit under jax.set_mesh: only the abstract mesh exists
        # here, so the constant becomes a traced value and gets a sharding constraint.
        return constrain(jax.numpy.asarray(x), parse_placement(text), checked)
    return _put(x, _eager_sharding(text, x, checked, current_concrete_mesh()))


def _eager_sharding(text: str, x: Any, mesh: AnyMesh | None, ctx: Mesh | None) -> NamedSharding:
    """The sharding ``einshard(x, text, mesh=mesh)`` places ``x`` with, outside jit.

    The hot path of eager placement (per array, per step): one cache lookup keyed by everything the answer
    depends on (the text, the shape, and the three meshes it may come from), so a repeated call neither parses
    nor resolves.  ``ctx`` is ``current_concrete_mesh()``, read once by the caller, who has also checked
    ``mesh`` with ``check_mesh`` (before it is hashed as a key).  Errors are not cached (lru_cache keeps no
    exceptions): a bad call fails every time.
    """
    own = placed_mesh(x) if mesh is None and ctx is None else None
    return _cached_eager_sharding(text, tuple(x.shape), mesh, ctx, own, current_axis_rules())


@cached(maxsize=8192)
def _cached_eager_sharding(
    text: str, shape: tuple[int, ...], mesh: AnyMesh | None, ctx: Mesh | None, own: Mesh | None, rules: AxisRules | None
) -> NamedSharding:
    # Keyed on the text, not the parsed Expression, on purpose: this is the one cache in front of the parser.  A
    # str hashes in C with its hash kept, where a hit through the parser's cache and the Expression's (Python)
    # __hash__ cost 0.25 µs a leaf (bench_placement's own work: 1.8 -> 2.1 µs a leaf on 50 leaves).  On a miss
    # the text is parsed here, once, and the Expression goes down (every cache below is keyed on it).
    expr = parse_placement(text)
    return concrete_sharding(expr, shape, choose_mesh(expr, mesh, ctx, own))


def _takes_own_shards(x: Any, sh: NamedSharding) -> bool:
    """Multi-process placement of a value this process holds whole (host array or local jax.Array)."""
    return not sh.is_fully_addressable and not is_global(x)


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


def _place_tree(x: Any, rules: Rules, mesh: MeshLike | None, process_local: bool) -> Any:
    check_bool(process_local, "einshard", "process_local")
    leaves, treedef = jax.tree_util.tree_flatten(x)
    texts = leaf_expressions(x, rules)
    checked = check_mesh(mesh)
    ctx = current_concrete_mesh()
    in_trace = tracing_in_mesh_context() and not isinstance(checked, Mesh)
    out: list[Any] = list(leaves)
    pending: list[int] = []
    shardings: list[NamedSharding] = []
    for i, (leaf, text) in enumerate(zip(leaves, texts)):
        if text is None:
            continue
        try:
            if not isinstance(leaf, jax.Array):  # host values: numbers, lists, numpy arrays (checked dtypes)
                leaf = _as_array(leaf)
                out[i] = leaf
            if isinstance(leaf, jax.core.Tracer) or process_local or in_trace:
                out[i] = _place_one(leaf, text, checked, process_local)
                continue
            sh = _eager_sharding(text, leaf, checked, ctx)
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
