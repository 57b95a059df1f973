"""What the walk of each copy of a repeated run reads outside the copy (an audit, for tests and for the design
of :mod:`.segment_memo`): the walker's tables are swapped for logging ones for one walk, which it does not change."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from .segments import Run
from .values import DERIVED_NAMES
from .walker import Walker

__all__ = ["BoundaryRead", "boundary_reads"]

# -- what the walk of a copy reads outside it ------------------------------------------------------------------

Channel = Literal["env", "summed", "uses", "requested", "program_outputs", "made"]
Where = Literal["inside", "entering", "before", "after", "input"]


@dataclass(frozen=True)
class BoundaryRead:
    """One read of walker state by the step of a copy's equation at ``position`` (a top-level position).

    ``where``: where the value it concerns was made, relative to the copy (``'inside'`` it; ``'entering'``: an
    operand of one of its equations made before it; ``'before'``: made before it and reached otherwise, by the
    look-ahead; ``'after'``: made after it (the backward pass); ``'input'``: a program argument).  A read of
    ``uses`` is ``'after'`` where one of the consumers it returns lies after the copy (the look-ahead leaves it).
    """

    copy: int
    position: int
    channel: Channel
    where: Where


class _Log:
    """The reads of one audited walk: which top-level equation is being stepped, and what its step read."""

    def __init__(self, jaxpr: Any) -> None:
        self.made_at: dict[int, int] = {}  # id(value) -> top-level position that made it (-1: a program input)
        self.held: list[Any] = []  # the values, so their ids stay theirs
        for v in (*jaxpr.invars, *jaxpr.constvars):
            self.made_at[id(v)] = -1
            self.held.append(v)
        self.eqn_at: dict[int, int] = {}
        for i, e in enumerate(jaxpr.eqns):
            self.eqn_at[id(e)] = i
            for v in e.outvars:
                self.made_at[id(v)] = i
                self.held.append(v)
        self.at: int | None = None
        self.reads: list[tuple[int, str, int, int]] = []  # (position, channel, id(value), furthest consumer)

    def read(self, channel: str, key: int, furthest: int = -1) -> None:
        if self.at is not None and key in self.made_at:
            self.reads.append((self.at, channel, key, furthest))


def _value_id(key: Any) -> int:
    """The value an environment key concerns (a value, or a buffer derived from one: its gathered copy, its
    partial sum)."""
    return id(getattr(key, "of", key)) if type(key).__name__ in DERIVED_NAMES else id(key)


class _EnvLog(dict):  # type: ignore[type-arg]
    """An environment that logs which values' layouts are read."""

    log: _Log

    def get(self, key: Any, default: Any = None) -> Any:
        if not hasattr(key, "val"):
            self.log.read("env", _value_id(key))
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.log.read("env", _value_id(key))
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.log.read("env", _value_id(key))
        return super().__contains__(key)


class _ByIdLog(dict):  # type: ignore[type-arg]
    """A table keyed by ``id(value)`` (pending sums, uses, requested layouts) that logs what is read."""

    log: _Log
    channel: str

    def get(self, key: Any, default: Any = None) -> Any:
        hit = super().get(key, default)
        furthest = -1
        if self.channel == "uses" and hit:
            furthest = max(self.log.eqn_at.get(id(e), -1) for e, _ in hit)
        self.log.read(self.channel, key, furthest)
        return hit

    def __getitem__(self, key: Any) -> Any:
        self.log.read(self.channel, key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.log.read(self.channel, key)
        return super().__contains__(key)


class _SetLog(set):  # type: ignore[type-arg]
    """The program's outputs (ids), logging membership tests."""

    log: _Log

    def __contains__(self, key: Any) -> bool:
        self.log.read("program_outputs", key)
        return super().__contains__(key)


class _MadeLog(dict):  # type: ignore[type-arg]
    """The walker's CSE history (keys ``((walk, id(value)), move)``), logging which values' moves are looked up."""

    log: _Log

    def __contains__(self, key: Any) -> bool:
        self.log.read("made", key[0][1] if isinstance(key[0], tuple) else id(key[0]))
        return super().__contains__(key)


def boundary_reads(traced: Any, in_specs: Any, out_specs: Any, run: Run) -> tuple[BoundaryRead, ...]:
    """The reads that the walk of ``run``'s copies makes of state lying outside the copy being stepped.

    ``traced.report(in_specs, out_specs)`` is walked once with logging tables in place of the walker's
    environment, pending-sum tags, uses, requested layouts, program outputs and CSE history (the walk's
    results are not changed by the logging).  Reads of a copy's own values are left out.
    """
    log = _Log(traced.jaxpr)

    class Audit(Walker):
        def walk(self, jaxpr: Any, in_layouts: Any, repeat: int, phase_hint: Any, env: Any = None) -> Any:
            if jaxpr is not traced.jaxpr or self._walks:
                return super().walk(jaxpr, in_layouts, repeat, phase_hint, env)
            logged = _EnvLog(env or {})
            logged.log = log
            for name, channel in (("summed", "summed"), ("uses", "uses"), ("requested", "requested")):
                table = _ByIdLog(getattr(self, name))
                table.log, table.channel = log, channel
                setattr(self, name, table)
            made = _MadeLog(self._made)
            made.log = log
            self._made = made
            outs = super().walk(jaxpr, in_layouts, repeat, phase_hint, logged)
            if env is not None:
                env.update(logged)
            return outs

        def step(self, eqn: Any, ins: Any, repeat: int, phase: str) -> Any:
            if self._stepping or id(eqn) not in log.eqn_at:
                return super().step(eqn, ins, repeat, phase)
            log.at = log.eqn_at[id(eqn)]
            outputs = _SetLog(self.program_outputs)
            outputs.log = log
            self.program_outputs = outputs
            try:
                return super().step(eqn, ins, repeat, phase)
            finally:
                log.at = None

    memo, traced.costs.memoise_segments = traced.costs.memoise_segments, False  # every copy stepped
    try:
        traced.report(in_specs, out_specs, walker=Audit(traced.costs))
    finally:
        traced.costs.memoise_segments = memo
    copies = run.copies()
    out: list[BoundaryRead] = []
    for position, channel, key, furthest in log.reads:
        for c, span in enumerate(copies):
            if position not in span:
                continue
            where = _where(log.made_at[key], furthest, span, traced.jaxpr.eqns, key)
            if where != "inside":
                out.append(BoundaryRead(c, position, cast(Channel, channel), where))
    return tuple(out)


def _where(made: int, furthest: int, span: range, eqns: Sequence[Any], key: int) -> Where:
    if furthest >= span.stop:
        return "after"
    if made < 0:
        return "input"
    if made >= span.stop:
        return "after"
    if made >= span.start:
        return "inside"
    operands = {id(v) for p in span for v in eqns[p].invars}
    return "entering" if key in operands else "before"
