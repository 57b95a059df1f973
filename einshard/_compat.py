"""Differences between the JAX releases einshard supports (jax >= 0.7.1).

jax 0.7.1 is the first release with ``jax.shard_map``, ``jax.set_mesh`` and
``AxisType`` together; ``jax.sharding.get_mesh`` came later, so the concrete
mesh current under ``jax.set_mesh`` is read through JAX's internal module on
older releases.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["get_concrete_mesh", "use_abstract_mesh"]


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


def use_abstract_mesh(mesh: Any) -> Any:
    """A context manager making ``mesh`` (an AbstractMesh) current for tracing (public from jax ~0.8)."""
    public = getattr(jax.sharding, "use_abstract_mesh", None)
    if public is not None:
        return public(mesh)
    from jax._src import mesh as mesh_lib

    return mesh_lib.use_abstract_mesh(mesh)
