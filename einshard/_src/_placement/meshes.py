"""Which mesh a placement uses: ``mesh=``, else the current mesh, else the array's own; counts' anonymous meshes."""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, AxisType, Mesh

from .._expression import AxisItem, ReplicaItem, format_name
from ..core.mesh import AnyMesh, MeshLike, as_mesh, current_concrete_mesh, show_mesh
from ..errors import EinshardError
from ..parsing import Expression, is_count_item

__all__ = ["anonymous_mesh", "is_anonymous"]


# (devices, shape) -> Mesh.  The one piece of state einshard keeps: meshes, as JAX does.
_ANONYMOUS: dict[tuple[tuple[Any, ...], tuple[int, ...]], Mesh] = {}


def anonymous_mesh(shape: tuple[int, ...]) -> Mesh:
    """The canonical mesh count expressions use: all devices, axes ``a0, a1, ...``, Auto axis types.

    The same shape always gives the same Mesh object, so arrays placed by
    separate calls combine in one ``jax.jit`` without resharding.

    Example:
        >>> import einshard, jax
        >>> n = jax.device_count()
        >>> einshard.placement.anonymous_mesh((n,)) is einshard.placement.anonymous_mesh((n,))
        True
    """
    devices = tuple(jax.devices())
    # Checked before the lookup: (2.0, 4) hashes as (2, 4) does, and must be refused after that mesh exists too.
    _check_grid(shape, len(devices))
    key = (devices, tuple(shape))
    mesh = _ANONYMOUS.get(key)
    if mesh is None:
        names = tuple(f"a{i}" for i in range(len(shape)))
        # create_device_mesh is what einshard 0.2 uses: same device order, same shards.
        grid = mesh_utils.create_device_mesh(tuple(shape), devices=list(devices))
        mesh = _ANONYMOUS[key] = Mesh(grid, names, axis_types=(AxisType.Auto,) * len(shape))
    return mesh


def _check_grid(shape: Any, n_devices: int) -> None:
    ok = isinstance(shape, tuple) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
    if not ok or math.prod(shape) != n_devices:
        raise EinshardError(
            f"anonymous_mesh: shape= takes a tuple of positive integers whose product is the {n_devices} devices, "
            f"got {shape!r:.60}"
        )


def is_anonymous(mesh: object) -> bool:
    """Whether ``mesh`` is one of the anonymous meshes count expressions build."""
    return any(mesh is m for m in _ANONYMOUS.values())


def current_abstract_mesh() -> AbstractMesh | None:
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def tracing_in_mesh_context() -> bool:
    """Inside ``jax.jit`` under ``jax.set_mesh``: only the abstract mesh is current, no concrete one."""
    return current_concrete_mesh() is None and current_abstract_mesh() is not None


def count_mesh_conflict(expr: Expression, mesh: AnyMesh, how: str) -> EinshardError:
    # In the user's own words: their counts, and their expression with a mesh axis named instead.
    counts = [i for i in expr.output.items if is_count_item(i)]
    free = iter(getattr(mesh, "axis_names", ()) or ("data",))  # one mesh axis per counted array axis, in order
    rewritten = []
    for i in expr.output.items:
        if isinstance(i, ReplicaItem):
            continue
        if isinstance(i, AxisItem) and is_count_item(i):
            axis = next(free, None)
            rewritten.append(format_name(i.name) + ("" if axis is None else f"@{axis}"))
        else:
            rewritten.append(str(i))
    left = ", ".join(str(side) for side in expr.inputs)
    return expr.fail(
        f"counts ({', '.join(repr(str(i)) for i in counts)}) build an anonymous mesh over all devices, but "
        f"{how} {show_mesh(mesh)}; arrays on the two meshes would not combine",
        counts[0].column,
        f"Name that mesh's axes instead: '{left} -> {' '.join(rewritten)}'.",
    )


def pick_mesh(expr: Expression, mesh: AnyMesh | None, x: Any = None) -> AnyMesh | None:
    """The mesh a placement uses; ``mesh`` is ``mesh=`` already checked by :func:`check_mesh`."""
    ctx = current_concrete_mesh() or current_abstract_mesh()
    return choose_mesh(expr, mesh, ctx, placed_mesh(x) if mesh is None and ctx is None else None)


def check_mesh(mesh: MeshLike | None) -> AnyMesh | None:
    """``mesh=`` checked; a dict of sizes becomes an AbstractMesh (enough for layouts and specs, not to place data)."""
    return None if mesh is None else as_mesh(mesh)


def placed_mesh(x: Any) -> Mesh | None:
    """The concrete mesh a jax.Array already lives on (None for host arrays)."""
    if not isinstance(x, jax.Array):
        return None
    own = getattr(x.sharding, "mesh", None)
    return own if isinstance(own, Mesh) else None


def choose_mesh(expr: Expression, mesh: AnyMesh | None, ctx: AnyMesh | None, own: Mesh | None) -> AnyMesh | None:
    """The mesh a placement uses: mesh=, else the current mesh, else the array's own; None for counts.

    A pure function of its arguments, so that its result can be cached.
    """
    if expr.uses_counts:
        if mesh is not None:
            raise count_mesh_conflict(expr, mesh, "mesh= gives")
        if ctx is not None:
            raise count_mesh_conflict(expr, ctx, "jax.set_mesh made current")
        return None
    if mesh is not None:
        return mesh
    if ctx is not None:
        return ctx
    return own
