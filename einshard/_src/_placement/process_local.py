"""``process_local=True``: each process gives its own slice; the global array's shape follows from the layout."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from ..core.layout import spec_dims
from ..core.mesh import AnyMesh
from ..parsing import Expression
from .resolve import concrete_sharding


def is_global(x: Any) -> bool:
    """A jax.Array spread over several processes (it already is the global array)."""
    return isinstance(x, jax.Array) and not x.is_fully_addressable


def from_process_local(x: Any, expr: Expression, chosen: AnyMesh | None) -> Any:
    if is_global(x):
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
    sh = concrete_sharding(expr, (0,) * local.ndim, chosen)
    for _ in range(4):
        global_shape = _global_shape(expr, sh, tuple(local.shape))
        final = concrete_sharding(expr, global_shape, chosen)
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
    per_axis = list(_split_counts(sh, local_shape))
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


def _split_counts(sh: NamedSharding, shape: tuple[int, ...]) -> tuple[int, ...]:
    """How many pieces ``sh`` splits each axis of an array of ``shape`` into."""
    sizes = dict(sh.mesh.shape)
    return tuple(int(np.prod([sizes[n] for n in d], dtype=np.int64)) for d in spec_dims(sh.spec, len(shape)))
