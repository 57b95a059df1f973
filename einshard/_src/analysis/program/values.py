"""The values explain's modules share: the primitive sets the rules and peak memory both read, and the buffers
XLA derives from a jaxpr value (its gathered copy, its pending partial sum) that the walk binds next to it.

A leaf of the package (it imports nothing of it), so that the walker, the rules and :mod:`.memory` can all
import it without importing each other (issue 23: the rule registry had formed an import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..._compat import dtype_itemsize

__all__ = ["ELEMENTWISE", "REDUCTIONS", "CARRIERS", "Derived", "Gathered", "Partial", "Sent", "dtype_itemsize"]

# Ops that compute each position from the same positions of their operands: a layout passes through them
# (rules_structural.elementwise) and XLA fuses them into one loop (memory).
ELEMENTWISE = {
    "add",
    "sub",
    "mul",
    "div",
    "max",
    "min",
    "pow",
    "integer_pow",
    "neg",
    "exp",
    "exp2",
    "log",
    "log1p",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "sqrt",
    "rsqrt",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "erf",
    "erf_inv",
    "select_n",
    "convert_element_type",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "stop_gradient",
    "square",
    "copy",
    "copy_p",
    "clamp",
    "nextafter",
    "rem",
    "atan2",
    "expm1",
    "is_finite",
    "reduce_precision",
    "imag",
    "real",
    "conj",
    "tan",
    "cbrt",
    "add_any",
    "pjit_identity",
    "optimization_barrier",
    "cumsum",
    "cumlogsumexp",
    "cummax",
    "cummin",
    "cumprod",
    "random_bits",
    "random_wrap",
    "random_unwrap",
    "threefry2x32",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "iota",
    "one_minus_square",  # jax >= 0.12: the derivative of tanh
    "log2",  # jax >= 0.12: jnp.log2 (was log divided by log 2)
    "polynomial",  # jax >= 0.12: lax.erf/erfc's and jnp.polyval's, sinc's evaluation at each position
    # Found by tools/list_primitives.py (jnp, jax.nn, lax sweeps): elementwise, nothing moves.
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "cosh",
    "sinh",
    "erfc",
    "lgamma",
    "digamma",
    "polygamma",
    "zeta",
    "igamma",
    "igammac",
    "igamma_grad_a",
    "random_gamma_grad",
    "bessel_i0e",
    "bessel_i1e",
    "complex",
    "random_fold_in",
    "random_seed",
    "random_clone",  # jax.random.clone: the same keys, a copy
}
# Ops that reduce along some axes (rules_structural.reduce; memory fuses them with their producers).
REDUCTIONS = {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin", "reduce_and", "reduce_or"}
# Ops that carry a value unchanged but for its axes' order or its dtype: a pending sum passes through them
# (the walker) and a dot's result leaves the program through them (rules_indexing.leaves_program).
CARRIERS = {"transpose", "convert_element_type", "copy", "copy_p"}


@dataclass(frozen=True, eq=False)
class Derived:
    """A buffer XLA makes from a jaxpr value: keyed by the value (identity), bound to the buffer's layout."""

    of: Any

    def __hash__(self) -> int:
        return hash((type(self), id(self.of)))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.of is self.of  # type: ignore[attr-defined]


class Gathered(Derived):
    """The all-gathered copy of a value (an argument gathered for a dot: an FSDP weight)."""


class Partial(Derived):
    """A value's per-device partial sum, before its all-reduce."""


class Sent(Derived):
    """An operand of the equation making this value, moved by an all-to-all: bound to the operand's layout before
    the move (the largest, where several are moved).  XLA:CPU holds its send and its receive buffers while the
    all-to-all runs (memory.py)."""
