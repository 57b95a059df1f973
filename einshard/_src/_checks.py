"""Argument checks at the public boundary: each bad value an EinshardError that names the argument.

Small pure functions, cheap enough for the hot path (an ``isinstance`` and a comparison): the public
functions call them on their plain arguments before any work, so a wrong type never surfaces as a raw
``TypeError``/``AttributeError`` from deep inside, and NaN, infinities, negative or zero counts are refused
instead of becoming nonsense results.  ``where`` is the function's name as users call it
(``einshard.plan``), ``name`` the argument (``memory_budget``); both appear in every message.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from .errors import EinshardError

__all__ = [
    "check_bool",
    "check_callable",
    "check_dtype",
    "check_int",
    "check_int_sequence",
    "check_number",
    "check_optional_str",
    "check_precision",
    "check_str",
    "check_str_or_strs",
    "describe_value",
    "invariant_checks",
    "naming",
]

# EINSHARD_CHECKS=1 (as JAX's jax_enable_checks): the trusted constructors (Layout._derive, MeshAxis._derive,
# Collective._derive), which build records from parts their callers already know are valid, validate them too.
# Off by default: those records are built thousands of times per analysis.  Read at each construction, so
# invariant_checks() switches it for a block (tests run the analyzer under it).
INVARIANTS: bool = os.environ.get("EINSHARD_CHECKS", "") not in ("", "0")


@contextlib.contextmanager
def invariant_checks(on: bool = True) -> Iterator[None]:
    """Within the block, the trusted constructors validate what they build (``EINSHARD_CHECKS=1`` for a block)."""
    global INVARIANTS
    before, INVARIANTS = INVARIANTS, on
    try:
        yield
    finally:
        INVARIANTS = before


def describe_value(value: Any) -> str:
    """``value`` for an error message: its type and a short repr (a huge value never floods the message)."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def argument_error(where: str, name: str, wants: str, value: Any) -> EinshardError:
    """The EinshardError saying ``name=`` takes ``wants`` and what it got (the caller raises it)."""
    return EinshardError(f"{where}: {name}= takes {wants}, got {describe_value(value)}")


def fail(where: str, name: str, wants: str, value: Any) -> Any:
    """Raise the EinshardError saying ``name=`` takes ``wants`` (for rules written as expressions)."""
    raise argument_error(where, name, wants, value)


def check_bool(value: Any, where: str, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise argument_error(where, name, "True or False", value)
    return bool(value)


def check_str(value: Any, where: str, name: str, *, empty: bool = False) -> str:
    """A str (bytes are refused: a ``b'data'`` axis name would never match the mesh's ``'data'``)."""
    if not isinstance(value, str):
        raise argument_error(where, name, "a string", value)
    if not empty and not value.strip():
        raise argument_error(where, name, "a non-empty string", value)
    return value


def check_optional_str(value: Any, where: str, name: str) -> str | None:
    return None if value is None else check_str(value, where, name)


def check_str_or_strs(value: Any, where: str, name: str) -> tuple[str, ...]:
    """A mesh axis name or a tuple/list of distinct ones (``'data'``, ``('data', 'fsdp')``)."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (tuple, list)) or not items or not all(isinstance(v, str) and v for v in items):
        raise argument_error(where, name, "a mesh axis name or a tuple of them", value)
    if len(set(items)) != len(items):
        raise argument_error(where, name, "distinct mesh axis names", value)
    return tuple(items)


def check_int(value: Any, where: str, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (a Python or numpy int, never a bool or a float) within ``[minimum, maximum]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise argument_error(where, name, "an integer", value)
    value = int(value)
    if minimum is not None and value < minimum:
        raise argument_error(where, name, f"an integer >= {minimum}", value)
    if maximum is not None and value > maximum:
        raise argument_error(where, name, f"an integer <= {maximum}", value)
    return value


def check_number(value: Any, where: str, name: str, *, minimum: float | None = None, positive: bool = False) -> float:
    """A finite real number (NaN and infinities refused: they make every comparison or sum meaningless)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise argument_error(where, name, "a number", value)
    if not math.isfinite(value):
        raise argument_error(where, name, "a finite number", value)
    if positive and value <= 0:
        raise argument_error(where, name, "a number > 0", value)
    if minimum is not None and value < minimum:
        raise argument_error(where, name, f"a number >= {minimum}", value)
    return float(value)


def check_int_sequence(
    value: Any, where: str, name: str, *, minimum: int = 0, distinct: bool = True
) -> tuple[int, ...]:
    """A list or tuple of integers (``param_args=(0,)``); a bare string or int is refused, not iterated."""
    if not isinstance(value, (tuple, list, range)):
        raise argument_error(where, name, "a tuple of integers", value)
    out = tuple(check_int(v, where, name, minimum=minimum) for v in value)
    if distinct and len(set(out)) != len(out):
        raise argument_error(where, name, "distinct integers", value)
    return out


def check_callable(value: Any, where: str, name: str) -> Callable[..., Any]:
    if not callable(value):
        raise argument_error(where, name, "a function", value)
    return value  # type: ignore[no-any-return]


def check_dtype(value: Any, where: str, name: str, *, optional: bool = True) -> np.dtype[Any] | None:
    """A numeric or bool dtype (what JAX computes with), else an EinshardError naming ``name``."""
    if value is None and optional:
        return None
    if isinstance(value, (bytes, bool)) or (isinstance(value, str) and not value.strip()):
        raise argument_error(where, name, "a numeric dtype", value)
    try:
        dt = np.dtype(value)
    except (TypeError, ValueError):
        raise argument_error(where, name, "a numeric dtype ('float32', jnp.bfloat16, ...)", value) from None
    if dt.kind not in "biufc" and dt.name not in _ML_DTYPES:
        raise argument_error(where, name, "a numeric dtype ('float32', jnp.bfloat16, ...)", value)
    return dt


# ml_dtypes' types (bfloat16, float8_*, int4, ...) have numpy kind 'V'.
_ML_DTYPES = frozenset(
    {
        "bfloat16",
        "float8_e4m3fn",
        "float8_e4m3b11fnuz",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e3m4",
        "float8_e4m3",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "float6_e2m3fn",
        "float6_e3m2fn",
        "int2",
        "int4",
        "uint2",
        "uint4",
    }
)

# What jax.lax.dot_general accepts as precision=: None, a name, a Precision, or a pair of them.
_PRECISION_NAMES = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32", "fastest", "bfloat16_3x")


def check_precision(value: Any, where: str, name: str = "precision") -> Any:
    """``None``, a ``jax.lax.Precision``, one of its names, a ``DotAlgorithmPreset``, or a pair of those."""
    import jax

    def one(v: Any) -> bool:
        if isinstance(v, str):
            return v in _PRECISION_NAMES or v in jax.lax.DotAlgorithmPreset.__members__
        return v is None or isinstance(v, (jax.lax.Precision, jax.lax.DotAlgorithmPreset, jax.lax.DotAlgorithm))

    if value is None or one(value):
        return value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(one(v) for v in value):
        return value
    names = ", ".join(repr(n) for n in _PRECISION_NAMES)
    raise argument_error(where, name, f"None, a jax.lax.Precision, one of {names}, or a pair of them", value)


def check_sequence_of(value: Any, where: str, name: str, test: Callable[[Any], bool], wants: str) -> Sequence[Any]:
    if not isinstance(value, (tuple, list)) or not all(test(v) for v in value):
        raise argument_error(where, name, wants, value)
    return value


@contextlib.contextmanager
def naming(where: str, name: str) -> Iterator[None]:
    """Errors raised inside (about what ``name=`` holds: a rule, a leaf's layout) name the argument too."""
    try:
        yield
    except EinshardError as err:
        if f"{name}=" in err.reason:
            raise
        raise EinshardError(f"{where}: in {name}=, {err.reason}", err.expression, err.column, err.hint) from None


# ---------------------------------------------------------------------------
# Checks by parameter name: a registry the public wrappers of low-level functions read.
#
# The analysis primitives, the collective-matmul kernels and the like are called inside einshard's own loops
# millions of times with values that are right by construction; their public names (einshard.analysis.all_gather,
# einshard.lowering.ring_shift, ...) are wrapped by :func:`checked`, which checks each argument by its name's rule
# once per user call.  A rule takes (value, where, name, arguments) and returns the value to pass on (a profile
# name becomes its Profile); ``arguments`` are the call's other arguments, for rules that depend on them.

Rule = Callable[[Any, str, str, dict[str, Any]], Any]


def _rule(check: Callable[..., Any], **options: Any) -> Rule:
    return lambda value, where, name, arguments: check(value, where, name, **options)


def optional(rule: Rule) -> Rule:
    """``rule``, with None also accepted."""
    return _optional(rule)


def _optional(rule: Rule) -> Rule:
    return lambda value, where, name, arguments: None if value is None else rule(value, where, name, arguments)


def _axis_name_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """A mesh axis name bound where the function runs (inside ``jax.shard_map``), or a tuple of them."""

    names = (value,) if isinstance(value, str) else value
    if not isinstance(names, (tuple, list)) or not names or not all(isinstance(n, str) and n for n in names):
        raise argument_error(where, name, "a mesh axis name or a tuple of them", value)
    if len(set(names)) != len(names):
        raise argument_error(where, name, "distinct mesh axis names", value)
    # Whether the names are bound is JAX's to find out when the function runs: checked() names the argument
    # in the NameError JAX raises for an unbound axis (after the function's own checks of its other arguments).
    return value


def _axes_tuple_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """Tensor axis names, distinct (``('a', 'c')``); a bare string would be read one letter per axis."""
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
        raise argument_error(where, name, "a tuple of axis names", value)
    if len(set(value)) != len(value):
        raise argument_error(where, name, "distinct axis names", value)
    return tuple(value)


def _operand_axes_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    if not isinstance(value, (tuple, list)) or not value:
        raise argument_error(where, name, "a tuple of each operand's axis names", value)
    return tuple(_axes_tuple_rule(v, where, name, arguments) for v in value)


def _spec_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from jax.sharding import PartitionSpec

    if not isinstance(value, PartitionSpec):
        raise argument_error(where, name, "a jax.sharding.PartitionSpec", value)
    return value


def _shapes_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """One shape per operand, each a tuple of integers >= 0."""

    def is_shape(s: Any) -> bool:
        return isinstance(s, (tuple, list)) and all(
            isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in s
        )

    if not isinstance(value, (tuple, list)) or not all(is_shape(s) for s in value):
        raise argument_error(where, name, "one shape (a tuple of integers >= 0) per operand", value)
    return [tuple(int(n) for n in s) for s in value]


def _invariant_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (tuple, list, set, frozenset)) and all(isinstance(m, str) for m in value):
        return value
    raise argument_error(where, name, "True/False, or the mesh axes the block is invariant over", value)


def _layout_entries_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """Per argument: an expression, None, path-pattern rules or a pytree of expressions (strings all the way)."""
    import jax

    leaves = jax.tree_util.tree_leaves(value)
    if not all(isinstance(x, str) for x in leaves):
        bad = next(x for x in leaves if not isinstance(x, str))
        raise argument_error(where, name, "expressions (strings), None, or path-pattern rules, per argument", bad)
    return value


def _spec_tree_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    import jax
    from jax.sharding import PartitionSpec

    leaves = jax.tree_util.tree_leaves(value, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if not all(isinstance(x, PartitionSpec) for x in leaves):
        raise argument_error(where, name, "PartitionSpecs (or None), one per output", value)
    return value


def _shape_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    ok = isinstance(value, (tuple, list)) and all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 0 for n in value
    )
    if not ok:
        raise argument_error(where, name, "a shape (a tuple of integers >= 0)", value)
    return tuple(int(n) for n in value)


RULES: dict[str, Rule] = {
    "itemsize": _rule(check_int, minimum=1),
    "tensor": _rule(check_str, empty=True),
    "why": _rule(check_str, empty=True),
    "precision": lambda value, where, name, arguments: check_precision(value, where, name),
    "preferred_element_type": _rule(check_dtype),
    "axis_name": _axis_name_rule,
    "shift": _rule(check_int),
    "dim": _rule(check_int, minimum=0),
    "gathered": _rule(check_int, minimum=0, maximum=1),
    "two_way": _optional(_rule(check_bool)),
    "stages": _rule(check_int, minimum=1),
    "repeats": _rule(check_int, minimum=1),
    "rtol": _rule(check_number, minimum=0),
    "atol": _rule(check_number, minimum=0),
    "grad": _rule(check_bool),
    "check_operands": _rule(check_bool),
    "required": _rule(check_bool),
    "what": _rule(check_str),
    "max_axes": _rule(check_int, minimum=1),
    "max_rank": _rule(check_int, minimum=1),
    "max_per_axis": _optional(_rule(check_int, minimum=1)),
    "annotate_output": _optional(_rule(check_bool)),
    "operand_axes": _operand_axes_rule,
    "fn": _rule(check_callable),
    "make_model": _rule(check_callable),
    "initializer": _rule(check_callable),
    "layouts": _layout_entries_rule,
    "out_shardings": _spec_tree_rule,
    "shape": _shape_rule,
    "default": lambda value, where, name, arguments: check_optional_str(value, where, name),
    "axis_names": lambda value, where, name, arguments: check_str_or_strs(value, where, name),
    "shapes": _shapes_rule,
    "invariant": _invariant_rule,
    "subscripts": _rule(check_str),
    "out_axes": _axes_tuple_rule,
    "spec": _spec_rule,
}


# Rules some functions give a parameter name that means something else elsewhere.
def RULES_FOR_INT(minimum: int | None = None, maximum: int | None = None) -> Rule:  # noqa: N802 - a rule maker
    return _rule(check_int, minimum=minimum, maximum=maximum)


def checked(fn: Callable[..., Any], where: str, **rules: Rule) -> Callable[..., Any]:
    """``fn`` with each argument checked by its rule (``rules`` first, then :data:`RULES` by name) before it runs.

    For the public names of functions einshard also calls internally (those calls stay unchecked)."""
    import functools
    import inspect

    signature = inspect.signature(fn)
    table = {name: rules.get(name, RULES.get(name)) for name in signature.parameters}
    active = {name: rule for name, rule in table.items() if rule is not None}

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            raise EinshardError(f"{where}: {err}") from None
        arguments = bound.arguments
        for name, rule in active.items():
            if name in arguments:
                arguments[name] = rule(arguments[name], where, name, arguments)
        try:
            return fn(*bound.args, **bound.kwargs)
        except NameError as err:  # JAX: "unbound axis name: r" outside a shard_map over that axis
            axis = next((n for n, rule in active.items() if rule is _axis_name_rule), None)
            if axis is None or "axis name" not in str(err):
                raise
            raise EinshardError(
                f"{where}: {axis}={arguments.get(axis)!r} is not a mesh axis of a jax.shard_map this runs in "
                f"(JAX: {err}); it runs inside jax.shard_map, over one of its mesh axes"
            ) from None

    return run
