"""Peak live bytes per device: a liveness walk over the top-level program, from each value's layout.

What ``ProgramReport.peak_bytes`` reports, and what the planner's memory budget
is built on (``einshard.planner.combining``).  Checked against XLA's buffer
assignment (``compiled.memory_analysis()``) on the corpus (tests/test_explain_corpus.py).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ...core.layout import Layout
from .costing import is_free

__all__ = ["peak_bytes"]


def peak_bytes(jaxpr: Any, layouts: dict[Any, Layout]) -> int:
    """Peak live bytes per device over the top-level program, from each value's layout.

    Arguments stay allocated for the whole step; other values die after their last
    use; sub-jaxprs (scan bodies, nested jits) count through their inputs and outputs only.
    """

    def nbytes(v: Any) -> int:
        aval = v.aval
        if not hasattr(aval, "shape") or not hasattr(aval, "dtype"):
            return 0
        lay = layouts.get(v)
        if lay is not None and is_free(lay):
            # A broadcast constant: XLA fuses it into its consumers (and sinks it into
            # loops that take it as an invariant), it is not materialised.
            return 0
        shape = lay.shard_shape if lay is not None else tuple(aval.shape)
        return int(math.prod(shape)) * int(np.dtype(aval.dtype).itemsize)

    last_use: dict[Any, int] = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not hasattr(v, "val"):
                last_use[v] = i
    for v in jaxpr.outvars:
        if not hasattr(v, "val"):
            last_use[v] = len(jaxpr.eqns)
    # Arguments are the caller's buffers: they stay allocated for the whole step (nothing is donated).
    args = set(jaxpr.invars)
    live = {v: nbytes(v) for v in jaxpr.invars}
    peak = sum(live.values())
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            live[v] = nbytes(v)
        peak = max(peak, sum(live.values()))
        for v in eqn.invars:
            if not hasattr(v, "val") and last_use.get(v) == i and v not in args:
                live.pop(v, None)
    return peak
