"""Staged ``shard_map`` programs, kept by what they are built from.

Every einshard lowering stages its ``shard_map`` with ``jax.jit`` (eagerly, a shard_map runs its body one
primitive at a time).  ``jax.jit`` caches its compiled program on the function object, so a program rebuilt
on every call (a fresh closure) is traced and compiled again each time: an eager ``einshard.pipeline`` call
cost 1-2 s of compiling, every call.  :func:`staged` returns the same jitted function for the same static
description (the user's layer function, the schedule, the mesh, the specs), so a repeat call is a cache hit
in ``jax.jit``.  Under an outer ``jax.jit`` the inner one is inlined either way.

The cache is small (the functions it holds keep their closures alive) and ``einshard.clear_caches()`` empties it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from .._caches import register

__all__ = ["staged"]

F = TypeVar("F", bound=Callable[..., Any])
_MAX_PROGRAMS = 64
_PROGRAMS: OrderedDict[Hashable, Any] = OrderedDict()
register(_PROGRAMS.clear)


def staged(key: Hashable, build: Callable[[], F]) -> F:
    """``build()``, or the function an earlier call with an equal ``key`` built (least recently used evicted).

    ``key`` must name everything ``build`` closes over that is not an argument of the function it returns;
    an unhashable key (a layer function that is a bound method of an unhashable object) builds afresh.
    """
    try:
        hit = _PROGRAMS.get(key)
    except TypeError:
        return build()
    if hit is not None:
        _PROGRAMS.move_to_end(key)
        return hit  # type: ignore[no-any-return]
    fn = build()
    _PROGRAMS[key] = fn
    if len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.popitem(last=False)
    return fn
