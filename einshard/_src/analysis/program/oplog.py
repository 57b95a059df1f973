"""The walk's ops in program order, where a replayed stretch's ops stay as a run until someone reads them.

A replayed copy of a repeated top-level stretch (:mod:`.segment_memo`) adds one op per op of its tape: the tape's
op with this copy's index, words and (for an offered alternative) equation.  Most costings (the planner's search)
read only what the ops sum to, which the tape's ops give as they are (a replay changes no cost field), so
:class:`OpLog` keeps each replay as a :class:`ReplayRun` and makes its ops only when one is read by index, sliced or
iterated: then the run is replaced by its ops, once, so that every later read sees the same objects.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from .report import OpReport

__all__ = ["CostTerms", "OpLog", "ReplayRun", "cost_terms"]


# What one op adds to its phase's totals: (phase, flops × repeat, bytes sent × repeat, collectives × repeat, time ×
# repeat, whether it has collectives), each product as ``trace._phase_totals`` adds it.
CostTerms = tuple[str, float, float, int, float, bool]


def cost_terms(op: OpReport) -> CostTerms:
    """``op``'s terms of its phase's totals (the products as the report's sum takes them: the same floats)."""
    repeat, collectives = op.repeat, op.collectives
    sent = repeat * sum(c.bytes for c in collectives) if collectives else 0.0  # op.comm_bytes
    return (op.phase, op.flops * repeat, sent, len(collectives) * repeat, op.time_s * repeat, bool(collectives))


class ReplayRun:
    """The ops one replay of a tape adds: ``tape_ops`` ((op, offset in the copy or None, equation) per op, as
    ``SegmentTape.ops``), the copy's ``words`` and ``eqns`` by offset, and the index of its first op; ``terms``:
    the tape's ops' :func:`cost_terms`, made once per tape by the caller (a replay changes no cost field)."""

    __slots__ = ("tape_ops", "words", "eqns", "start", "terms")

    def __init__(
        self,
        tape_ops: tuple[tuple[OpReport, int | None, Any], ...],
        words: tuple[tuple[str, str, tuple[str, ...]], ...],
        eqns: Sequence[Any],
        start: int,
        terms: tuple[CostTerms, ...] | None = None,
    ) -> None:
        self.tape_ops, self.words, self.eqns, self.start = tape_ops, words, eqns, start
        self.terms = tuple(cost_terms(op) for op, _, _ in tape_ops) if terms is None else terms

    def __len__(self) -> int:
        return len(self.tape_ops)

    def expand(self) -> list[OpReport]:
        """The replay's ops, as the walker's replay made them one by one (fields copied, not re-validated)."""
        out: list[OpReport] = []
        counter, words, eqns = self.start, self.words, self.eqns
        for op, off, _ in self.tape_ops:
            new = object.__new__(OpReport)  # dataclasses.replace without its per-call introspection
            fields = new.__dict__
            fields.update(op.__dict__)
            fields["index"] = counter
            counter += 1
            if off is not None:
                fields["where"], fields["inside"], fields["reads"] = words[off]
                if op.alternative:  # an offered alternative names this copy's equation, as a walk here would
                    fields["alternative"] = id(eqns[off])
            out.append(new)
        return out

    def alternatives(self) -> Iterator[int]:
        """The ``alternative`` of each approximate op that offers one, as :meth:`expand`'s ops have it."""
        for op, off, _ in self.tape_ops:
            if op.alternative and op.approximate:
                yield op.alternative if off is None else id(self.eqns[off])


class OpLog(Sequence[OpReport]):
    """A list of ops (append, index, assign, slice, iterate) whose replayed stretches are :class:`ReplayRun` s.

    Chunks in program order: lists of ops and runs; the last chunk is the list :meth:`append` adds to.  Reading an
    op inside a run (or iterating, or slicing across one) expands that run in place."""

    __slots__ = ("_chunks", "_tail", "_len")

    def __init__(self) -> None:
        self._tail: list[OpReport] = []
        self._chunks: list[list[OpReport] | ReplayRun] = [self._tail]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, op: OpReport) -> None:
        self._tail.append(op)
        self._len += 1

    def add_run(self, run: ReplayRun) -> None:
        """Append a replay's ops, unmade."""
        if not run.tape_ops:
            return
        if not self._tail:
            self._chunks.pop()
        self._chunks.append(run)
        self._tail = []
        self._chunks.append(self._tail)
        self._len += len(run)

    def _locate(self, i: int) -> tuple[list[OpReport], int]:
        """The list holding op ``i`` (a run there expanded) and its position in it."""
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("op index out of range")
        start = self._len - len(self._tail)
        if i >= start:  # the ops a rule reads and marks are its own, the latest ones
            return self._tail, i - start
        chunks = self._chunks
        for k in range(len(chunks) - 2, -1, -1):
            chunk = chunks[k]
            start -= len(chunk)
            if i >= start:
                if isinstance(chunk, ReplayRun):
                    chunk = chunks[k] = chunk.expand()
                return chunk, i - start
        raise IndexError("op index out of range")  # unreachable: the chunks' lengths sum to _len

    @overload
    def __getitem__(self, i: int) -> OpReport: ...

    @overload
    def __getitem__(self, i: slice) -> list[OpReport]: ...

    def __getitem__(self, i: int | slice) -> OpReport | list[OpReport]:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            tail_start = self._len - len(self._tail)
            if step == 1 and start >= tail_start:
                return self._tail[start - tail_start : stop - tail_start]
            return list(self)[i]
        chunk, j = self._locate(i)
        return chunk[j]

    def __setitem__(self, i: int, op: OpReport) -> None:
        chunk, j = self._locate(i)
        chunk[j] = op

    def __iter__(self) -> Iterator[OpReport]:
        chunks = self._chunks
        for k in range(len(chunks)):
            chunk = chunks[k]
            if isinstance(chunk, ReplayRun):
                chunk = chunks[k] = chunk.expand()
            yield from chunk

    def __eq__(self, other: object) -> bool:
        # As the tuple of ops a report held before (a report compares and hashes by its ops).
        if isinstance(other, (OpLog, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))

    def costs(self) -> Iterator[CostTerms]:
        """Each op's :func:`cost_terms` in program order, without making a run's ops: a replayed op's are its tape
        op's (a replay changes its index, words and equation only), made once per tape."""
        for chunk in self._chunks:
            if isinstance(chunk, ReplayRun):
                yield from chunk.terms
            else:
                yield from map(cost_terms, chunk)

    def cost_ops(self) -> Iterator[OpReport]:
        """Each op in program order for reading its cost fields (flops, repeat, out_layout, collectives), without
        making a run's ops: a replayed op is its tape's op there (a replay changes its index, words and equation
        only)."""
        for chunk in self._chunks:
            if isinstance(chunk, ReplayRun):
                for op, _, _ in chunk.tape_ops:
                    yield op
            else:
                yield from chunk

    def alternatives(self) -> Iterator[int]:
        """``op.alternative`` of each approximate op that offers one, in program order, without making a run's ops."""
        for chunk in self._chunks:
            if isinstance(chunk, ReplayRun):
                yield from chunk.alternatives()
            else:
                for op in chunk:
                    if op.alternative and op.approximate:
                        yield op.alternative
