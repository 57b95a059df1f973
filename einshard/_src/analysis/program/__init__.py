"""Whole-program analysis: ``einshard.explain(fn, *args)``.

Traces ``fn`` to a jaxpr and walks it once, following each value's
:class:`~einshard.core.layout.Layout` from the arguments' shardings.  Each
primitive has a layout rule in a registry (:mod:`.registry`): elementwise and
shape ops (:mod:`.rules_structural`), ``dot_general``/gather/scatter
(:mod:`.rules_indexing`, dots priced by :func:`einshard.analyze`), control
flow, shard_map regions and explicit placement (:mod:`.rules_control`), ops that
read along a whole axis (:mod:`.rules_ordering`: sort, top_k, cumulative ops,
split...), windows (:mod:`.rules_windows`: convolutions, pooling) and loops and
branches (:mod:`.rules_loops`), tiling, matrix factorisations and Fourier transforms
(:mod:`.rules_linalg`); :mod:`.coverage` lists them per primitive.
Where a value's layout must change the collective comes from the analyzer's
``transition``.  Operations with no rule are listed by name in the report,
never silently guessed.

Nothing here moves data or compiles: the walk is far cheaper than
``jax.jit(fn).lower(...).compile()`` (see ``benchmarks/bench_explain.py``).
"""

from __future__ import annotations

# The rules modules register their rules when imported: here, where the package is put together, so that
# the walker needs none of them and they need only the registry's WalkerLike (no import cycle, issue 23).
from . import (  # noqa: F401
    rules_control,
    rules_indexing,
    rules_linalg,
    rules_loops,
    rules_ordering,
    rules_random,
    rules_structural,
    rules_windows,
)
from .registry import RULES, register
from .report import OpReport, ProgramReport
from .trace import TracedProgram, explain, trace

__all__ = ["explain", "trace", "TracedProgram", "ProgramReport", "OpReport", "RULES", "register"]
