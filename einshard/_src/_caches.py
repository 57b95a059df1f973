"""Every cache einshard keeps, and one ``clear_caches()`` (as equinox's ``_caches.py``).

A cache registers itself where it is defined (:func:`cached`, or :func:`register` for a hand-made one), so
``einshard.clear_caches()`` empties all of them without anyone searching for caches by reflection.  The Lark
parser (built once per process from the grammar) and the anonymous meshes (state, as JAX keeps meshes) are not
caches of results and stay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["cached", "register", "clear_caches"]

F = TypeVar("F", bound=Callable[..., Any])
_CLEARERS: list[Callable[[], None]] = []


def register(clear: Callable[[], None]) -> Callable[[], None]:
    """Add a cache's ``clear`` function to those :func:`clear_caches` calls; returns it unchanged."""
    _CLEARERS.append(clear)
    return clear


def cached(maxsize: int | None = 4096) -> Callable[[F], F]:
    """``functools.lru_cache(maxsize)``, registered with :func:`clear_caches`."""

    def wrap(fn: F) -> F:
        memo = functools.lru_cache(maxsize=maxsize)(fn)
        register(memo.cache_clear)
        return memo  # type: ignore[return-value]

    return wrap


def clear_caches() -> None:
    """Empty every einshard cache (parsed expressions, resolved layouts, path-rule matches, analyses).

    Example:
        >>> import einshard
        >>> einshard.clear_caches()
    """
    for clear in _CLEARERS:
        clear()
