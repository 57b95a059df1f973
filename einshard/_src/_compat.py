"""Differences between the JAX releases einshard supports (jax >= 0.7.1).

jax 0.7.1 is the first release with ``jax.shard_map``, ``jax.set_mesh`` and
``AxisType`` together; ``jax.sharding.get_mesh`` came later, so the concrete
mesh current under ``jax.set_mesh`` is read through JAX's internal module on
older releases.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh

__all__ = [
    "get_concrete_mesh",
    "use_abstract_mesh",
    "has_unreduced",
    "native_unreduced",
    "dtype_itemsize",
    "is_array_dtype",
    "is_extended_dtype",
]


def get_concrete_mesh() -> Any:
    """The concrete mesh made current by ``jax.set_mesh`` (possibly empty).

    Raises ValueError under ``jax.jit`` on releases that only know the abstract mesh there.
    """
    public = getattr(jax.sharding, "get_mesh", None)
    if public is not None:
        return public()
    from jax._src import mesh as mesh_lib  # jax < 0.9: not public yet

    mesh = mesh_lib.get_concrete_mesh()
    if mesh is None:
        return mesh_lib.empty_concrete_mesh if hasattr(mesh_lib, "empty_concrete_mesh") else _EMPTY
    return mesh


class _Empty:
    empty = True


_EMPTY = _Empty()


def use_abstract_mesh(mesh: AbstractMesh) -> Any:
    """A context manager making ``mesh`` (an AbstractMesh) current for tracing (public from jax ~0.8)."""
    public = getattr(jax.sharding, "use_abstract_mesh", None)
    if public is not None:
        return public(mesh)
    from jax._src import mesh as mesh_lib

    return mesh_lib.use_abstract_mesh(mesh)


def has_unreduced() -> bool:
    """Whether this JAX types pending sums: ``PartitionSpec(..., unreduced={...})`` and ``pcast(to='unreduced')``.

    jax 0.10.2 and 0.12.0.1 (the versions CI runs) both do.
    """
    try:
        jax.sharding.PartitionSpec(None, unreduced={"a"})
    except TypeError:
        return False
    return hasattr(jax.lax, "pcast")


def native_unreduced(mesh: Mesh | AbstractMesh | None) -> bool:
    """Whether a shard_map on ``mesh`` can return and take JAX ``unreduced`` arrays.

    JAX allows ``unreduced`` in a shard_map's specs only when every axis of its
    mesh is Explicit (jax 0.10: "the mesh passed to shard_map contains axis names
    all of type Explicit"; jax 0.12 refuses unreduced Auto axes too).
    """
    types = getattr(mesh, "axis_types", None)
    if not types or not has_unreduced():
        return False
    return all(t == jax.sharding.AxisType.Explicit for t in types)


def is_extended_dtype(dtype: Any) -> bool:
    """Whether ``dtype`` is one of JAX's extended dtypes (a typed PRNG key's ``key<fry>``), which NumPy refuses."""
    if isinstance(dtype, np.dtype) or isinstance(dtype, str) or dtype is None:
        return False
    try:
        return bool(jax.dtypes.issubdtype(dtype, jax.dtypes.extended))
    except TypeError:
        return False


def dtype_itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``, JAX's extended dtypes included: a typed PRNG key (``key<fry>``: 8,
    ``key<rbg>``: 16) is no NumPy dtype, so ``np.dtype`` refuses it; its own ``itemsize`` is its buffer's.

    The one sizing every layer uses (the analysis, the planner, drawing, the interop leaves, the pipeline
    lowering): a model whose parameters or state hold a key batch must not fail where a float array passes."""
    if isinstance(dtype, np.dtype):  # every aval's but an extended one: the walk's hot path
        return int(dtype.itemsize)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(dtype.itemsize)
    return int(np.dtype(dtype).itemsize)


def is_array_dtype(dtype: Any) -> bool:
    """Whether a JAX array can hold ``dtype``'s values: bool, a number (ml_dtypes' bfloat16, float8, int4 …
    included: NumPy gives them kind 'V'), or an extended dtype (a typed PRNG key); not strings, bytes, objects
    or NumPy's structured/void records."""
    if not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return True
    try:
        dt = np.dtype(dtype)
    except TypeError:
        return False
    return bool(jax.dtypes.issubdtype(dt, np.number) or dt == np.bool_)
