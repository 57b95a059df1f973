"""Property-based testing tools for sharded JAX code: strategies, layout-invariance and collective checks.

``pip install 'einshard[testing]'`` (it adds hypothesis).  The strategies (``meshes``, ``expressions``, ``layouts``,
``einsums``) need hypothesis and load on first use (the ``__getattr__`` re-exported below); the checks and the HLO
reader (:mod:`einshard.testing.hlo`) do not.  See docs/testing-your-model.md.
"""

from .._src.testing import __getattr__ as __getattr__  # the lazy strategies
from .._src.testing.checks import (
    assert_collectives,
    assert_explained,
    assert_fits,
    assert_layout_invariant,
    place_args,
)
from . import hlo

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
