"""Property-based testing tools for sharded JAX code: strategies, layout-invariance and collective checks.

``pip install 'einshard[testing]'`` (it adds hypothesis).  The strategies
(:func:`meshes`, :func:`expressions`, :func:`layouts`, :func:`einsums`) need
hypothesis and load on first use; the checks (:func:`assert_layout_invariant`,
:func:`assert_collectives`, :func:`assert_explained`, :func:`assert_fits`) and
the HLO reader (:mod:`einshard.testing.hlo`) do not, so explain and benchmark
code can read compiled HLO without the extra.  Without hypothesis, asking for
a strategy raises an ImportError that names the extra.

Example:
    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from hypothesis import given, settings
    >>> import einshard.testing as et
    >>> mesh = jax.make_mesh((4, 2), ('data', 'model'))
    >>> params = {'w': np.ones((8, 4), np.float32)}
    >>> @settings(max_examples=5, deadline=None)
    ... @given(et.layouts(params, mesh))
    ... def test_loss(lay):
    ...     et.assert_layout_invariant(lambda p: jnp.sum(p['w'] ** 2), params, layouts=lay, mesh=mesh, grad=True)
    >>> test_loss()
"""

from __future__ import annotations

import importlib
from typing import Any

from . import hlo
from .checks import assert_collectives, assert_explained, assert_fits, assert_layout_invariant, place_args

__all__ = [
    "assert_collectives",
    "assert_explained",
    "assert_fits",
    "assert_layout_invariant",
    "place_args",
    "hlo",
    "meshes",
    "expressions",
    "layouts",
    "einsums",
    "EinsumCase",
]

_STRATEGIES = {"meshes", "expressions", "layouts", "einsums", "EinsumCase", "array_names", "strategies"}


def __getattr__(name: str) -> Any:
    # Strategies import hypothesis: loaded on first use, so the checks and the HLO reader work without it.
    if name in _STRATEGIES:
        module = importlib.import_module(".strategies", __name__)
        return module if name == "strategies" else getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
