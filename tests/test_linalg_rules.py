"""Per-primitive differential property tests for rules_linalg: ``tile``, matrix factorisations and solves, ``fft``.

The machinery is tests/test_primitive_rules.py's (:func:`check`): hypothesis draws shapes, parameters and a
layout over a 1-, 2- or 3-axis mesh, Auto or Explicit; the one-op program (and its gradient where JAX has one)
is compiled and explain must name XLA's collectives (kinds, counts, bytes within 10%), give the result XLA's
layout and estimate peak memory within the family's bounds.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax
from test_primitive_rules import DEEP, DIM, FAST, _case, check

F32 = jnp.float32


@st.composite
def tile_case(draw: Any) -> Any:
    """``jnp.tile`` of a 1-3 axis operand by 1-3 repeats per axis (Equinox's rotary embedding tiles its angles)."""
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(DIM) for _ in range(rank))
    reps = tuple(draw(st.integers(1, 3)) for _ in range(rank))
    args = (jax.ShapeDtypeStruct(shape, F32),)
    # "unfused": tile's gradient is a reshape of the cotangent to (repeats, size) and a sum over the repeats,
    # one loop fusion in XLA; explain's liveness walk holds the cotangent and the tiled value both (measured
    # up to 1.59x XLA's peak): the memory walk's known unfused-chain gap (test_primitive_rules.MEMORY_BOUNDS).
    return _case(draw, "tile", lambda x: jnp.tile(x, reps), args, "unfused")


# The matrix ops, as users call them: (name, function of a batch of square matrices).
MATRIX_FNS = {
    "qr": lambda x: jnp.linalg.qr(x)[0],
    "svd": lambda x: jnp.linalg.svd(x, compute_uv=False),
    "lu": lambda x: jax.scipy.linalg.lu_factor(x)[0],
    "triangular_solve": lambda x: lax.linalg.triangular_solve(x, x, left_side=True, lower=True),
    "eigh": lambda x: jnp.linalg.eigh(x, symmetrize_input=False)[0],  # (x + xᵀ) is an elementwise op's case
}


@st.composite
def matrix_case(draw: Any) -> Any:
    """A factorisation or solve of a batch of square matrices, split on batch or matrix axes."""
    name = draw(st.sampled_from(sorted(MATRIX_FNS)))
    n = draw(st.sampled_from([4, 8]))
    batch = tuple(draw(st.sampled_from([2, 4, 8])) for _ in range(draw(st.integers(1, 2))))
    args = (jax.ShapeDtypeStruct((*batch, n, n), F32),)
    # Forward only: XLA's gradients of factorisations are long chains of dots the dot rule prices (not these).
    return _case(draw, name, MATRIX_FNS[name], args, "windows", grad=False)


@st.composite
def fft_case(draw: Any) -> Any:
    """A (real or complex) Fourier transform over the trailing 1-2 axes of a 2-3 axis operand."""
    rank = draw(st.integers(2, 3))
    shape = tuple(draw(st.sampled_from([4, 8, 16])) for _ in range(rank))
    axes = draw(st.sampled_from([(-1,), (-2, -1)]))
    real = draw(st.booleans())
    fn = (lambda x: jnp.fft.rfftn(x, axes=axes).real) if real else (lambda x: jnp.fft.fftn(x, axes=axes).imag)
    args = (jax.ShapeDtypeStruct(shape, F32),)
    return _case(draw, "fft", fn, args, "windows", grad=False)


STRATEGIES = {"tile": tile_case(), "matrix": matrix_case(), "fft": fft_case()}


@pytest.mark.parametrize("family", sorted(STRATEGIES))
def test_rule_matches_xla(family: str) -> None:
    FAST(given(STRATEGIES[family])(check))()


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(STRATEGIES))
def test_rule_matches_xla_deep(family: str) -> None:
    DEEP(given(STRATEGIES[family])(check))()
