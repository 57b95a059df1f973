"""What ``plan`` reads from its caller: the memory budget, the mesh, the arguments' shapes."""

from __future__ import annotations

import math
import re
from typing import Any, Literal, get_args

import numpy as np

from .._checks import describe_value
from .._compat import dtype_itemsize
from ..core.layout import MeshAxis
from ..core.mesh import MeshLike
from ..errors import EinshardError

__all__ = [
    "Objective",
    "OBJECTIVES",
    "parse_bytes",
    "mesh_axes_of",
    "devices_memory",
    "shape_of",
    "itemsize_of",
]

Objective = Literal["training", "inference", "memory", "communication"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)


def parse_bytes(budget: int | float | str | None, name: str = "memory_budget") -> int | None:
    """A memory budget in bytes from a number or a string like ``'16GiB'``, ``'1.5 GB'``, ``'512MiB'``.

    A budget is a positive, finite size: 0, negative numbers, NaN and infinities are errors (no layout fits
    in nothing, and an infinite budget is ``None``).  ``name``: the argument, as the error names it.

    Example:
        >>> parse_bytes('16GiB') == 16 * 2**30, parse_bytes('2 GB'), parse_bytes(None)
        (True, 2000000000, None)
    """
    if not isinstance(name, str) or not name:
        raise EinshardError(f"parse_bytes: name= takes the argument's name (a string), got {name!r:.40}")
    if budget is None:
        return None
    label = name if name.startswith("--") else f"{name}="  # a command-line flag, or the function's argument
    wants = f"{label} is not a size: it takes a positive number of bytes or a string like '16GiB', '2GB'"
    if isinstance(budget, (bool, np.bool_)) or not isinstance(budget, (int, float, np.integer, np.floating, str)):
        raise EinshardError(f"{wants}, got {describe_value(budget)}")
    if isinstance(budget, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]i?B|B)?\s*", budget, re.IGNORECASE)
        if not m or len(m.group(1)) > 30:
            raise EinshardError(f"{wants}, got {describe_value(budget)}")
        unit = (m.group(2) or "B").upper()
        scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
        scale |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        value = float(m.group(1)) * scale[unit]
    else:
        value = float(budget)
    if not math.isfinite(value) or value < 1:
        raise EinshardError(f"{wants} (at least 1 byte, finite), got {describe_value(budget)}")
    return int(value)


def mesh_axes_of(mesh: MeshLike, args: tuple[Any, ...] = ()) -> tuple[MeshAxis, ...]:
    """The mesh ``plan`` works on, by einshard's one precedence (``einshard.core.mesh.resolve_mesh``).

    ``mesh=`` (a Mesh, an AbstractMesh or sizes ``{'data': 4}``), else the
    mesh of ``jax.set_mesh``, else the arguments' own mesh.
    """
    from ..core.mesh import mesh_axes, resolve_mesh

    found = resolve_mesh(mesh, args, what="plan()", check_operands=False)
    return mesh_axes(found)


def devices_memory(mesh: MeshLike, args: tuple[Any, ...] = ()) -> int | None:
    """The memory of one device of the accelerators ``plan`` runs for here: the default ``memory_budget``.

    The mesh's devices where it is a concrete mesh, else this machine's first device (the one the default profile
    is read from); the smallest ``memory_stats()['bytes_limit']`` among them, what the runtime lets one program
    allocate.  None on a CPU (host memory is not a device's budget) or where the runtime reports no limit.
    """
    import jax

    from ..core.mesh import resolve_mesh

    found = resolve_mesh(mesh, args, what="plan()", check_operands=False)
    # An AbstractMesh (sizes only, or the mesh under a trace) has no devices: this machine's stand for them.
    devices = list(found.devices.flat) if isinstance(found, jax.sharding.Mesh) else jax.devices()[:1]
    if any(getattr(d, "platform", "cpu") == "cpu" for d in devices):
        return None
    limits = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - a runtime without memory statistics raises its own kinds
            return None
        limit = (stats or {}).get("bytes_limit")
        if not limit:
            return None
        limits.append(int(limit))
    return min(limits) if limits else None


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in (x.shape if hasattr(x, "shape") else np.shape(x)))


def itemsize_of(x: Any) -> int:
    return dtype_itemsize(getattr(x, "dtype", np.float32))  # a typed PRNG key's too: np.dtype refuses it
