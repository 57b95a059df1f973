"""The values explain's modules share: the primitive sets the rules and peak memory both read, and the buffers
XLA derives from a jaxpr value (its gathered copy, its pending partial sum) that the walk binds next to it.

A leaf of the package (it imports nothing of it), so that the walker, the rules and :mod:`.memory` can all
import it without importing each other (issue 23: the rule registry had formed an import cycle).
"""

from __future__ import annotations

from typing import Any

from ..._compat import dtype_itemsize

__all__ = [
    "ELEMENTWISE",
    "REDUCTIONS",
    "CARRIERS",
    "PLACEMENTS",
    "Derived",
    "Gathered",
    "Partial",
    "Sent",
    "GatheredLhs",
    "GatheredRhs",
    "DOT_GATHERED",
    "DERIVED_NAMES",
    "dtype_itemsize",
]

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
# Ops that place their result where the user says (a sharding constraint, Explicit axes' reshard or mesh_cast, a
# device_put in the program): XLA's propagation may not change that layout (the walker pins them; memory keeps the
# placed buffer; an open value is never one of them, open_values).
PLACEMENTS = frozenset({"sharding_constraint", "reshard", "device_put", "mesh_cast"})
# Ops that carry a value unchanged but for its axes' order or its dtype: a pending sum passes through them
# (the walker) and a dot's result leaves the program through them (rules_indexing.leaves_program).
CARRIERS = {"transpose", "convert_element_type", "copy", "copy_p"}


class Derived:
    """A buffer XLA makes from a jaxpr value: keyed by the value (identity), bound to the buffer's layout.

    Immutable, with its hash made once: the walk and peak memory hash these keys millions of times in a plan
    (an 80-layer decoder's: 2.2M), and a hash built from a new tuple at each was a visible share of it.  The
    value is the one a tuple of (type, id) gives, so sets of keys iterate as before."""

    __slots__ = ("of", "_hash")
    of: Any
    _hash: int

    def __init__(self, of: Any) -> None:
        object.__setattr__(self, "of", of)
        object.__setattr__(self, "_hash", hash((type(self), id(of))))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.of is self.of  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(of={self.of!r})"


class Gathered(Derived):
    """The all-gathered copy of a value (an argument gathered for a dot: an FSDP weight)."""

    __slots__ = ()


class Partial(Derived):
    """A value's per-device partial sum, before its all-reduce."""

    __slots__ = ()


class Sent(Derived):
    """An operand of the equation making this value, moved by an all-to-all: bound to the operand's layout before
    the move (the largest, where several are moved).  XLA:CPU holds its send and its receive buffers while the
    all-to-all runs (memory.py)."""

    __slots__ = ()


class GatheredLhs(Derived):
    """The gathered copy of the first operand of the dot making this value, where the walk all-gathers that operand
    for this dot (the largest, where it is gathered in steps).  :class:`Gathered` is the value's own copy, whichever
    op gathered it; this says which dot reads it: XLA:CPU holds the copy from the value's first reader to the last
    dot gathering it (memory.py)."""

    __slots__ = ()


class GatheredRhs(Derived):
    """:class:`GatheredLhs` of the dot's second operand."""

    __slots__ = ()


# By dot operand (0 lhs, 1 rhs): the key a dot's gathered operand is bound under, by the dot's result.
DOT_GATHERED: tuple[type[Derived], type[Derived]] = (GatheredLhs, GatheredRhs)
# The derived kinds by name (the modules that key or translate environments by the value a key derives from).
DERIVED_NAMES = frozenset({"Gathered", "Partial", "Sent", "GatheredLhs", "GatheredRhs"})
