"""XLA's other choice at an approximate op, followed to the program's end: what the op's bound must cover.

A rule that marks its choice approximate (:func:`.movement.mark_approximate`) bounds what XLA may do
differently *at that op*.  Where XLA's other choice also changes the layout the result leaves with (a conv
whose window covers its result: explain gathers the input's rows, but where a later residual add asks for the
rows split XLA keeps them split through the chain, with halo permutes and the batch norm's all-reduces), the
ops after it differ too, and a bound of the op's own collectives is too small.  So a rule that knows the alternative *offers* it (:func:`offer`), and
the report walks the whole program once more with that op taking it (:func:`taking`; a fork: a fresh walk
over the same traced program, whose result is compared, never reported).  The op's bound becomes the larger
of its own and the measured difference between the two walks (:func:`difference`: collectives as a multiset of
kinds, the bytes the fork adds or drops, peak bytes), which also covers XLA taking the choice only in part.

Marks are rare and each fork is one more walk, so at most :data:`MAX_FORKS` are walked per report; the
report says how many further ones kept their local bound (``ProgramReport.alternatives_unwalked``).

A fork forces its op by the equation's identity: a block replayed at a call of another body of the same
structure (:mod:`.blocks`) is walked as the main walk did there (its own bound only).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .oplog import OpLog
from .report import OpBound, OpReport, ProgramReport, default_bound

if TYPE_CHECKING:
    from .registry import WalkerLike

__all__ = ["MAX_FORKS", "offer", "taking", "difference", "widen"]

# How many alternatives one report walks to the program's end (each is a whole walk more).
MAX_FORKS = 4


def offer(w: WalkerLike, eqn: Any, since: int) -> None:
    """Say that the ops recorded since ``since`` (already marked approximate) have a known alternative:
    a fork of the walk where ``eqn``'s rule takes it (:func:`taking` is then True for it)."""
    if w.quiet or w.costs.forced:
        return  # a dry run records nothing; a fork's own marks are not walked again
    for i in range(since, len(w.ops)):
        if w.ops[i].approximate:
            w.ops[i] = dataclasses.replace(w.ops[i], alternative=id(eqn))


def taking(w: WalkerLike, eqn: Any) -> bool:
    """Whether this walk is the fork in which ``eqn``'s rule takes XLA's other choice."""
    return id(eqn) in w.costs.forced


def _sent(report: ProgramReport) -> Counter[tuple[str, tuple[str, ...], float]]:
    """Every collective the report runs (each run counted), by kind, mesh axes and bytes sent."""
    sent: Counter[tuple[str, tuple[str, ...], float]] = Counter()
    for op in report.ops:
        for c in op.collectives:
            sent[(c.kind, tuple(c.axes), float(c.bytes))] += op.repeat
    return sent


def _kinds(sent: Counter[tuple[str, tuple[str, ...], float]]) -> Counter[str]:
    kinds: Counter[str] = Counter()
    for (kind, _, _), n in sent.items():
        kinds[kind] += n
    return kinds


def difference(main: ProgramReport, fork: ProgramReport) -> OpBound:
    """How far XLA may be from the main walk where it takes the fork's choice, wholly or in part.

    XLA may take the other choice at the op and return to explain's layout further on (a consumer that wants
    the split back slices the whole value for free: measured on the keras-hub ResNet, the rows gathered for
    one conv and its batch norm, split again for the next conv's halos), so its program lies between the two
    walks: some of what the fork adds, some of what it drops.  Collectives: the larger of the fork's added
    and dropped counts (as a multiset of kinds, every run counted); bytes: the larger of the bytes the fork
    adds and the bytes it drops (not their net, which a partial choice can exceed); peak: the walks' gap."""
    a, b = _sent(main), _sent(fork)
    added, dropped = b - a, a - b
    collectives = max(sum((_kinds(a) - _kinds(b)).values()), sum((_kinds(b) - _kinds(a)).values()))
    moved = max(sum(k[2] * n for k, n in added.items()), sum(k[2] * n for k, n in dropped.items()))
    return OpBound(collectives, moved, float(abs(main.peak_bytes - fork.peak_bytes)))


def _widest(op: OpReport, measured: OpBound) -> OpBound:
    """The larger of the op's own bound and the measured difference (per run: the report multiplies by repeat)."""
    own = op.bound or default_bound(op)
    runs = max(1, op.repeat)
    return OpBound(
        max(own.collectives, -(-measured.collectives // runs)),
        max(own.bytes, measured.bytes / runs),
        max(own.peak, measured.peak),  # held once, not once per run
    )


def widen(
    report: ProgramReport, fork: Callable[[frozenset[int]], ProgramReport], cap: int | None = None
) -> ProgramReport:
    """``report`` with each offered alternative's bound widened to what it changes to the program's end.

    ``fork(forced)``: the report of a walk in which the ops of ``forced`` take their alternative.  The
    measured bound goes on the first op of each alternative (its other ops keep their own).  ``cap``: how many
    forks to walk (None: :data:`MAX_FORKS`); the others keep their local bound and the report counts them."""
    listed = report.ops
    if isinstance(listed, OpLog):  # (its replayed ops' alternatives read without making the ops)
        offered = list(dict.fromkeys(listed.alternatives()))
    else:
        offered = list(dict.fromkeys(op.alternative for op in listed if op.alternative and op.approximate))
    if not offered:
        return report
    walked = offered[: MAX_FORKS if cap is None else cap]
    if not walked:  # nothing to widen: the ops as they are (unmade where they were)
        return dataclasses.replace(report, alternatives_unwalked=len(offered))
    ops = list(report.ops)
    for eqn_id in walked:
        measured = difference(report, fork(frozenset({eqn_id})))
        first = next(i for i, op in enumerate(ops) if op.alternative == eqn_id)
        ops[first] = dataclasses.replace(ops[first], bound=_widest(ops[first], measured))
    return dataclasses.replace(report, ops=tuple(ops), alternatives_unwalked=len(offered) - len(walked))
