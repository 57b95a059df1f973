"""Identical blocks costed once: a call's body is walked once per structure and entering layouts, then replayed.

An unrolled decoder of L layers calls the same block L times (the backward
pass of ``jax.checkpoint`` is one ``remat`` call per layer, a ``jax.jit``-ed
block one ``jit`` call per layer and direction), and the planner costs the
program under hundreds of layouts.  A call's body is a pure function of its
structure and of the layouts entering it: walking it needs nothing of the
walk around it (its values are its own, and XLA's CSE and the look-ahead of
sharding propagation stop at its boundary in :mod:`.walker` too).  So the
walk of a body is recorded once, as a :class:`Tape` (its results' layouts,
the ops it records, the environments peak memory inlines, and what the
walker subclass tracks: :class:`~einshard.planner.combining.DependencyWalker`'s
collective dependences), keyed by

* the body's **structure** (:func:`body_index`): each equation's primitive,
  parameters (nested bodies by their structure), operand wiring by position,
  result types and phase: two bodies traced separately from the same code
  share it even though their objects differ;
* the **layouts entering it**, the repeat count, the phase, and the walker's
  kind (a quiet dry run records nothing; a dependency walker records more).

Every call of that body under those layouts then replays the tape (each op
renumbered; where the body is another object of the same structure, its ops'
source lines and environments are mapped onto that object's equations and
values by position).  The recording walk runs in a sandbox walker with no
state from the outer walk, and a walk without the memo (``OpCosts.memoise_blocks
= False``) runs the same sandbox every time: the memo never changes a result
(tests/test_block_memo.py checks it over layouts).  A body whose walk met an
op without a rule is not memoised (the report names that op's call site, which
is the caller's).  A ``lax.scan`` already costs one body per loop (its rule
walks the body once with the trip count as the repeat): its plan time does not
grow with its length.

:class:`WalkCounts` counts jaxpr walks, equations stepped and tapes replayed,
for tests that check that a deeper model walks no more (never timed).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...core.layout import Layout
from .report import OpReport
from .values import DERIVED_NAMES

__all__ = ["WalkCounts", "BodyIndex", "Tape", "body_index", "normal_param", "translate_env"]


@dataclass
class WalkCounts:
    """How much walking the costings of one traced program did (mutable tallies; read them in tests)."""

    walks: int = 0  # jaxprs walked (the program, each call body, loop body and branch walked)
    equations: int = 0  # equations stepped in them
    replays: int = 0  # call bodies not walked: their tape replayed
    recorded: int = 0  # call bodies walked to record a tape
    segment_replays: int = 0  # repeated top-level stretches replayed (see .segment_memo)
    segments_open: int = 0  # stretches walked whose walk read outside them (not kept)
    # Entering values whose state a segment key read (not taken from the key of the copy replayed before it).
    segment_key_reads: int = 0
    # Walks of a report walked again for its open values (.open_values), and the stretches replayed before the
    # walk reported last began (its own replays are those since).
    rewalks: int = 0
    segment_replays_before: int = 0

    def snapshot(self) -> tuple[int, int, int, int]:
        return (self.walks, self.equations, self.replays, self.recorded)


@dataclass(frozen=True, eq=False)
class BodyIndex:
    """A call body's structure (``ordinal``: equal for equal structures) and its values and equations by position.

    Positions are those of a depth-first visit (invars, constvars, then each equation's results; a
    nested body's where it is first met), so two bodies of one structure align value for value.
    """

    jaxpr: Any
    ordinal: int
    values: tuple[Any, ...]
    value_at: dict[Any, int]
    eqns: tuple[Any, ...]
    eqn_at: dict[int, int]  # id(equation) -> position (the equations are held in ``eqns``)


@dataclass(frozen=True)
class Tape:
    """What walking one call body under one key did, to be replayed at every other call with that key."""

    body: BodyIndex
    outs: tuple[Layout, ...]
    ops: tuple[tuple[OpReport, int | None], ...]  # each op, and its equation's position in the body (None: none)
    envs: tuple[tuple[tuple[int, ...], dict[Any, Layout]], ...]  # call path in positions -> environment
    extra: Any = None  # the walker subclass's own record (see Walker.tape_extra)


@dataclass
class BodyStructures:
    """The structures met so far, by signature, and each body object's index (held, so ids stay theirs)."""

    ordinals: dict[Hashable, int] = field(default_factory=dict)
    by_id: dict[int, BodyIndex] = field(default_factory=dict)


def body_index(jaxpr: Any, known: BodyStructures, phase_of: Any) -> BodyIndex:
    """``jaxpr``'s :class:`BodyIndex` (computed once per object; ``phase_of(eqn)`` is part of the structure)."""
    hit = known.by_id.get(id(jaxpr))
    if hit is not None and hit.jaxpr is jaxpr:
        return hit
    values: list[Any] = []
    value_at: dict[Any, int] = {}
    eqns: list[Any] = []
    bodies: dict[int, int] = {}  # id(nested body) -> its ordinal within this visit (a body used twice)

    def ref(v: Any) -> Hashable:
        if hasattr(v, "val"):  # a literal
            return ("literal", str(v.aval), normal_param(v.val))
        p = value_at.get(v)
        if p is None:
            p = value_at[v] = len(values)
            values.append(v)
        return p

    def param(x: Any) -> Hashable:
        inner = getattr(x, "jaxpr", None) if not hasattr(x, "eqns") else x
        if inner is not None and hasattr(inner, "eqns"):
            consts = tuple(str(getattr(c, "aval", np.shape(c))) for c in getattr(x, "consts", ()))
            seen = bodies.get(id(inner))
            if seen is not None:
                return ("body", seen, consts)
            bodies[id(inner)] = len(bodies)
            return ("body", visit(inner), consts)
        if isinstance(x, (tuple, list)):
            return tuple(param(e) for e in x)
        if isinstance(x, dict):
            return tuple(sorted((str(k), param(e)) for k, e in x.items()))
        return normal_param(x)

    def visit(j: Any) -> Hashable:
        sig: list[Hashable] = [
            tuple((ref(v), str(v.aval)) for v in j.invars),
            tuple((ref(v), str(v.aval)) for v in j.constvars),
        ]
        for e in j.eqns:
            eqns.append(e)
            params = tuple(sorted((k, param(x)) for k, x in e.params.items()))
            ins = tuple(ref(v) for v in e.invars)
            outs = tuple((ref(v), str(v.aval)) for v in e.outvars)
            sig.append((e.primitive.name, params, ins, outs, phase_of(e)))
        sig.append(tuple(ref(v) for v in j.outvars))
        return tuple(sig)

    signature = visit(jaxpr)
    ordinal = known.ordinals.setdefault(signature, len(known.ordinals))
    index = BodyIndex(jaxpr, ordinal, tuple(values), value_at, tuple(eqns), {id(e): i for i, e in enumerate(eqns)})
    known.by_id[id(jaxpr)] = index
    return index


def normal_param(x: Any) -> Hashable:
    """A parameter's value as a hashable token that is equal for equal values (a miss, never a wrong hit,
    where a value has no faithful token: its repr then names its object)."""
    if x is None or isinstance(x, (bool, int, float, str, bytes)):
        return (type(x).__name__, x)
    if isinstance(x, np.generic):
        return ("scalar", str(x.dtype), x.item())
    if isinstance(x, np.ndarray) or (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "__array__")):
        a = np.asarray(x)
        # Constant arrays in parameters are values no layout rule reads beyond their type; small ones are
        # compared whole all the same.
        digest = a.tobytes() if a.size <= 4096 else b""
        return ("array", a.shape, str(a.dtype), digest)
    if isinstance(x, (tuple, list)):
        return tuple(normal_param(e) for e in x)
    if callable(x) and not isinstance(x, type):
        # A function parameter (a remat policy, a custom rule's thunk): the walk never calls it.
        return ("function", getattr(x, "__qualname__", type(x).__name__))
    return (type(x).__name__, repr(x))


def translate_env(env: dict[Any, Layout], src: BodyIndex, dst: BodyIndex) -> dict[Any, Layout]:
    """``env`` (keyed by ``src``'s values, or buffers derived from them) keyed by ``dst``'s values at their positions."""
    out: dict[Any, Layout] = {}
    for k, lay in env.items():
        of = getattr(k, "of", None)
        if of is not None and type(k).__name__ in DERIVED_NAMES:
            p = src.value_at.get(of)
            if p is not None:
                out[type(k)(dst.values[p])] = lay
            continue
        p = src.value_at.get(k)
        if p is not None:
            out[dst.values[p]] = lay
    return out
