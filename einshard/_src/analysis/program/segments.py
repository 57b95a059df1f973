"""Repeated runs of top-level equations: the inlined forward of identical layers, found by structure.

JAX inlines each ``jax.checkpoint``-ed layer's *forward* into the top-level
jaxpr (only the backward stays a ``remat`` call, which :mod:`.blocks`
replays), so an unrolled decoder's program is one run of L structurally
identical stretches of equations; its backward is another, of the glue
between the remat calls (each layer's cotangent padded into the stack at
its row and summed), whose operands from the forward are named by type.  This module finds them, for the analysis
only (nothing here changes a walk):

* :func:`equation_signatures` gives each top-level equation a structural
  signature (primitive, parameters with nested bodies by their structure,
  result types, phase, and each operand as "produced ``k`` equations back,
  result ``j``", "a program input" or a literal), as a small integer: equal
  integers are equal signatures.
* :func:`repeated_runs` finds, in such a sequence, maximal runs of one period
  repeated at least twice (:class:`Run`), longest coverage first and never
  overlapping.

Why a run is not simply replayed by structure and entering layouts: the walk
of a copy reads state that lies outside it (:func:`.segment_audit.boundary_reads`
and tests/test_segments.py): XLA's CSE history (``Walker._made``) and the
pending-sum tags of the values entering it, and the look-ahead of sharding
propagation (``consumer_split``, ``leaves_program``, ``_padded_back``) follows
its values into the backward pass.  :mod:`.segment_memo` keys a copy's walk on
all of that, and walks the copy where its walk read anything else.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .blocks import BodyStructures, body_index, normal_param

__all__ = ["LAYER_INDEX", "Run", "param_token", "equation_signatures", "repeated_runs", "find_runs"]


@dataclass(frozen=True)
class Run:
    """``count`` copies of a stretch of ``period`` equations, the first at ``start`` (top-level positions)."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    def copies(self) -> tuple[range, ...]:
        """The positions of each copy, in program order."""
        return tuple(range(self.start + i * self.period, self.start + (i + 1) * self.period) for i in range(self.count))


# Parameters that name the layer a copy is (a Python loop's ``params[i]`` is a ``slice`` of the stacked weight
# at row ``i``): left out of the signature, so that the layers of an unrolled loop sign alike.  A replay of one
# copy at another would have to key on them (a stack split along its layer axis gives each row its own devices).
# A ``pad`` in the backward's glue pads a layer's weight gradient into the stack at the layer's own row: its
# ``padding_config`` is left out too, and a replay checks it where the pad's walk read it (:mod:`.segment_memo`).
LAYER_INDEX: dict[str, frozenset[str]] = {
    "slice": frozenset({"start_indices", "limit_indices"}),
    "pad": frozenset({"padding_config"}),
}


def equation_signatures(
    jaxpr: Any,
    known: BodyStructures,
    phase_of: Callable[[Any], str],
    varying: Mapping[str, frozenset[str]] = LAYER_INDEX,
) -> tuple[int, ...]:
    """Each top-level equation's structural signature, as an integer (equal integers: equal signatures).

    An operand is named by where it comes from relative to its reader (``k`` equations back, result ``j``),
    never by its object: the same code traced twice, or the same layer at another depth, signs alike.  An
    operand made in another phase (a forward residual read by the backward's remat call) is named by its type
    only: its distance grows with the layers between the two passes, so the backward's copies would never sign
    alike (the copies' exact wiring is :attr:`.segment_memo.Copy.wiring`, and the replay keys on it).
    ``varying``: per primitive, the parameters left out (:data:`LAYER_INDEX`).
    """
    made: dict[Any, tuple[int, int]] = {}  # value -> (equation position, result index)
    phases: list[str] = []
    ids: dict[Hashable, int] = {}
    out: list[int] = []
    for i, eqn in enumerate(jaxpr.eqns):
        ins: list[Hashable] = []
        phase = phase_of(eqn)
        phases.append(phase)
        for v in eqn.invars:
            if hasattr(v, "val"):
                ins.append(("literal", str(v.aval), normal_param(v.val)))
            elif v in made:
                at, j = made[v]
                ins.append(("back", i - at, j) if phases[at] == phase else ("across", str(v.aval)))
            else:
                ins.append(("input", str(v.aval)))
        skip = varying.get(eqn.primitive.name, frozenset())
        params = tuple(sorted((k, param_token(x, known, phase_of)) for k, x in eqn.params.items() if k not in skip))
        outs = tuple(str(v.aval) for v in eqn.outvars)
        sig = (eqn.primitive.name, params, tuple(ins), outs, phase)
        out.append(ids.setdefault(sig, len(ids)))
        for j, v in enumerate(eqn.outvars):
            made[v] = (i, j)
    return tuple(out)


def param_token(x: Any, known: BodyStructures, phase_of: Callable[[Any], str]) -> Hashable:
    """A parameter as a structural token: a nested body by its structure's ordinal (see :func:`.blocks.body_index`)."""
    inner = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
    if inner is not None and hasattr(inner, "eqns"):
        consts = tuple(str(getattr(c, "aval", type(c).__name__)) for c in getattr(x, "consts", ()))
        return ("body", body_index(inner, known, phase_of).ordinal, consts)
    if isinstance(x, (tuple, list)):
        return tuple(param_token(e, known, phase_of) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((str(k), param_token(e, known, phase_of)) for k, e in x.items()))
    return normal_param(x)


def repeated_runs(signatures: Sequence[int], min_count: int = 2, candidates: int = 8) -> tuple[Run, ...]:
    """Maximal runs of one period repeated at least ``min_count`` times, in program order, never overlapping.

    The periods tried are the ``candidates`` most frequent distances between an equation and the previous
    one of its signature (a layer's equations all recur at the layer's length); for each, the positions where
    ``signatures[i] == signatures[i + period]`` form stretches, and a stretch of ``n`` such positions holds
    ``1 + n // period`` copies.  Runs are taken greedily by the equations they cover.
    """
    n = len(signatures)
    last: dict[int, int] = {}
    gaps: Counter[int] = Counter()
    for i, s in enumerate(signatures):
        if s in last:
            gaps[i - last[s]] += 1
        last[s] = i
    found: list[Run] = []
    for period, _ in gaps.most_common(candidates):
        i = 0
        while i + period < n:
            if signatures[i] != signatures[i + period]:
                i += 1
                continue
            j = i
            while j + period < n and signatures[j] == signatures[j + period]:
                j += 1
            count = 1 + (j - i) // period
            if count >= min_count:
                found.append(Run(i, period, count))
            i = j + 1
    chosen: list[Run] = []
    taken = [False] * n
    for run in sorted(found, key=lambda r: (-(r.period * r.count), r.period, r.start)):
        if not any(taken[run.start : run.stop]):
            chosen.append(run)
            for p in range(run.start, run.stop):
                taken[p] = True
    return tuple(sorted(chosen, key=lambda r: r.start))


def find_runs(jaxpr: Any, known: BodyStructures, phase_of: Callable[[Any], str]) -> tuple[Run, ...]:
    """The repeated runs of ``jaxpr``'s top-level equations (:func:`repeated_runs` of their signatures)."""
    return repeated_runs(equation_signatures(jaxpr, known, phase_of))
