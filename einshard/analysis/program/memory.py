"""Peak live bytes per device: a liveness walk over the top-level program, from each value's layout.

What ``ProgramReport.peak_bytes`` reports, and what the planner's memory budget
is built on (``einshard.planner.combining``).  Checked against XLA's buffer
assignment (``compiled.memory_analysis()``: arguments + outputs + temporaries)
on the corpus (tests/test_explain_corpus.py).  It models what XLA does with
buffers, not just what the jaxpr names:

* **fusion**: a value made by an elementwise op and read only by elementwise
  ops and reductions never gets a buffer (XLA fuses the chain into one loop);
* **gathered arguments**: an argument the walk all-gathered (an FSDP weight)
  is gathered by XLA at the start of the step, and the gathered copy held to
  the argument's last use;
* **combined sums**: a partial sum whose reduced value only leaves the
  program (a gradient's all-reduce) waits for XLA's all-reduce combiner,
  which issues the step's independent all-reduces together at the end:
  the partial buffer stays live until then.

The walk tells this module about the last two by binding, next to each value's
layout, the layout of its gathered copy (``layouts[Gathered(v)]``) and of its
pending partial sum (``layouts[Partial(v)]``) (see :mod:`.walker` and the
``dot_general``/reduction rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...core.layout import Layout
from .costing import is_free

__all__ = ["peak_bytes", "Gathered", "Partial"]


@dataclass(frozen=True, eq=False)
class _Derived:
    """A buffer XLA makes from a jaxpr value: keyed by the value (identity), bound to the buffer's layout."""

    of: Any

    def __hash__(self) -> int:
        return hash((type(self), id(self.of)))

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.of is self.of  # type: ignore[attr-defined]


class Gathered(_Derived):
    """The all-gathered copy of a value (an argument gathered for a dot: an FSDP weight)."""


class Partial(_Derived):
    """A value's per-device partial sum, before its all-reduce."""


# Ops XLA fuses into one loop with their elementwise producers (loop and input fusion).
_FUSING = {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "transpose",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "argmax",
    "argmin",
    "reduce_and",
    "reduce_or",
}
# Ops that read or write whole buffers, or leave the loop (scans, cumulative ops, random bits).
_NOT_FUSED = {
    "cumsum",
    "cumlogsumexp",
    "cummax",
    "cummin",
    "cumprod",
    "random_bits",
    "threefry2x32",
    "optimization_barrier",
}


# XLA's "expensive" elementwise ops (HloInstruction::IsOpElementwise + IsExpensive): not duplicated into consumers.
_EXPENSIVE = {
    "exp", "exp2", "expm1", "log", "log1p", "tanh", "logistic", "sin", "cos", "tan", "sqrt", "rsqrt", "cbrt",
    "pow", "div", "rem", "erf", "erf_inv", "atan2",
}  # fmt: skip


def _fusible_elementwise() -> frozenset[str]:
    from .rules_structural import ELEMENTWISE

    return frozenset(ELEMENTWISE - _NOT_FUSED) | {"broadcast_in_dim", "iota"}


def peak_bytes(jaxpr: Any, layouts: dict[Any, Layout]) -> int:
    """Peak live bytes per device over the top-level program, from each value's layout.

    Arguments stay allocated for the whole step (nothing is donated); other values die
    after their last use; sub-jaxprs (scan bodies, nested jits) count through their inputs
    and outputs only.  Fused temporaries, gathered arguments and combined partial sums as
    the module says.
    """

    def nbytes_as(v: Any, lay: Layout | None) -> int:
        aval = v.aval
        if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
            return 0
        if lay is not None and is_free(lay):
            # A broadcast constant: XLA fuses it into its consumers (and sinks it into
            # loops that take it as an invariant), it is not materialised.
            return 0
        shape = lay.shard_shape if lay is not None else tuple(aval.shape)
        return int(math.prod(shape)) * int(np.dtype(aval.dtype).itemsize)

    n = len(jaxpr.eqns)
    last_use: dict[Any, int] = {}
    readers: dict[Any, list[str]] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not hasattr(v, "val"):
                last_use[v] = i
                readers.setdefault(v, []).append(eqn.primitive.name)
    outputs = {v for v in jaxpr.outvars if not hasattr(v, "val")}
    for v in outputs:
        last_use[v] = n
    fusible = _fusible_elementwise()
    fusing = fusible | _FUSING

    def fused(eqn: Any, v: Any) -> bool:
        """Made by an elementwise op and read only inside fusions: no buffer of its own.

        XLA fuses a producer into several consumers only when it is cheap to compute again;
        an expensive one (exp, log, divide...) read twice is computed once, into a buffer.
        """
        name, reads = eqn.primitive.name, readers.get(v, ())
        if name not in fusible or v in outputs or not all(r in fusing for r in reads):
            return False
        return len(reads) <= 1

    # Gathered copies of arguments, live from the start to the argument's last use.
    args = set(jaxpr.invars)
    extra_until: list[tuple[int, int]] = []  # (last index, bytes) of buffers live from the start
    for v in jaxpr.invars:
        copy = layouts.get(Gathered(v))
        if copy is not None and v in last_use:
            extra_until.append((last_use[v], nbytes_as(v, copy) - nbytes_as(v, layouts.get(v))))
    # Partial sums that only leave the program: held from their making to the end (the combiner).
    leaves = _leaves_program(jaxpr, outputs)

    live = {v: nbytes_as(v, layouts.get(v)) for v in jaxpr.invars}
    held = 0  # partial sums waiting for the combined all-reduce
    peak = sum(live.values()) + sum(b for _, b in extra_until)
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            live[v] = 0 if fused(eqn, v) else nbytes_as(v, layouts.get(v))
            part = layouts.get(Partial(v))
            if part is not None and v in leaves:
                held += nbytes_as(v, part)
        gathered = sum(b for last, b in extra_until if last >= i)
        peak = max(peak, sum(live.values()) + gathered + held)
        for v in eqn.invars:
            if not hasattr(v, "val") and last_use.get(v) == i and v not in args:
                live.pop(v, None)
    return peak


# Ops a gradient passes through on its way out (its value, re-laid or re-shaped).
_ON_THE_WAY_OUT = {"transpose", "reshape", "convert_element_type", "copy", "copy_p", "squeeze", "expand_dims"}


def _leaves_program(jaxpr: Any, outputs: set[Any]) -> set[Any]:
    """Values read only by shape ops on the way to the program's outputs (or outputs themselves)."""
    readers: dict[Any, list[Any]] = {}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not hasattr(v, "val"):
                readers.setdefault(v, []).append(eqn)
    out = set(outputs)
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name not in _ON_THE_WAY_OUT:
            continue
        for v in eqn.invars:
            if hasattr(v, "val") or v in out:
                continue
            if all(r.primitive.name in _ON_THE_WAY_OUT and all(o in out for o in r.outvars) for r in readers[v]):
                out.add(v)
    return out
