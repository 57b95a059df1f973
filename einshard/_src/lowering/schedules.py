"""Pipeline tick tables: which stage does which micro-batch's forward (F) or backward (B) at each tick.

Everything here is static Python, computed once at trace time.  A *tick* is one
lock-step iteration of the pipeline's ``lax.scan``: every stage does at most one
operation, then activations move one stage forward and gradients one stage back
(one ``ppermute`` each).  With R repeats a device holds R *chunks*; virtual stage
``v = c·S + s`` is chunk c of stage s and runs global layers ``[v·Lps, (v+1)·Lps)``.

* :func:`forward_ticks`: GPipe (R = 1) and circular (R > 1) forward scans; their
  backward is the AD-transposed scan, the same table run backwards.
* :func:`one_f_one_b`: the 1F1B order (PipeDream-Flush; Megatron's interleaved
  order for R > 1): stage s runs a few warm-up forwards, then alternates one
  forward and one backward, so at most about S micro-batches are in flight on
  a stage instead of M.  The order per stage is fixed; :func:`_simulate` starts
  each operation at the first tick its input has arrived, and the buffers that
  hold arrived activations / gradients get slots by interval colouring, so a
  slot is never overwritten before it is read (checked here, not hoped for).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["Op", "OneFOneBPlan", "forward_ticks", "one_f_one_b", "render"]

Kind = Literal["F", "B"]
IDLE, FORWARD, BACKWARD = 0, 1, 2


@dataclass(frozen=True)
class Op:
    """One stage operation: forward or backward of micro-batch ``m`` through chunk ``chunk``."""

    kind: Kind
    m: int
    chunk: int = 0

    def label(self, repeats: int) -> str:
        return f"{self.kind}{self.m}" + (f".{self.chunk}" if repeats > 1 else "")


Table = tuple[tuple[Op | None, ...], ...]  # [tick][stage]


def forward_ticks(stages: int, microbatches: int, repeats: int) -> Table:
    """GPipe / circular forward: stage s works on item ``u = t − s`` (micro-batch u mod M, round u // M)."""
    S, M, R = stages, microbatches, repeats
    rows = []
    for t in range(M * R + S - 1):
        rows.append(tuple(Op("F", (t - s) % M, (t - s) // M) if 0 <= t - s < M * R else None for s in range(S)))
    return tuple(rows)


def backward_of(table: Table) -> Table:
    """The AD-transposed scan: the same ticks in reverse, each F answered by its B."""
    return tuple(tuple(Op("B", op.m, op.chunk) if op else None for op in row) for row in reversed(table))


def _orders(S: int, M: int, R: int) -> list[list[Op]]:
    """Each stage's operation order: warm-up forwards, then one forward / one backward, then the last backwards."""
    orders = []
    for s in range(S):
        if R == 1:
            fwd = [Op("F", m) for m in range(M)]
            bwd = [Op("B", m) for m in range(M)]
            warm = min(S - s - 1, M)
        else:  # Megatron's interleaved order: groups of S micro-batches, chunk by chunk (backward: chunks reversed)
            groups = [range(g * S, (g + 1) * S) for g in range(M // S)]
            fwd = [Op("F", m, c) for grp in groups for c in range(R) for m in grp]
            bwd = [Op("B", m, c) for grp in groups for c in reversed(range(R)) for m in grp]
            warm = min((S - s - 1) * 2 + (R - 1) * S, M * R)
        order = fwd[:warm]
        for i in range(len(fwd) - warm):
            order += [fwd[warm + i], bwd[i]]
        order += bwd[len(fwd) - warm :]
        orders.append(order)
    return orders


def _simulate(S: int, M: int, R: int) -> tuple[Table, dict[tuple[Kind, int, int], int]]:
    """Lock-step execution of the per-stage orders; an op starts once what it needs arrived (sent a tick earlier)."""
    V = S * R
    orders = _orders(S, M, R)
    heads = [0] * S
    done: dict[tuple[Kind, int, int], int] = {}  # (kind, m, virtual stage) -> tick
    rows: list[tuple[Op | None, ...]] = []
    t = 0
    while any(h < len(o) for h, o in zip(heads, orders, strict=True)):
        row: list[Op | None] = []
        for s in range(S):
            op = orders[s][heads[s]] if heads[s] < len(orders[s]) else None
            if op is not None:
                v = op.chunk * S + s
                need: tuple[Kind, int, int] | None
                if op.kind == "F":
                    need = None if v == 0 else ("F", op.m, v - 1)
                else:
                    need = ("F", op.m, v) if v == V - 1 else ("B", op.m, v + 1)
                if need is not None and done.get(need, t) >= t:
                    op = None
            row.append(op)
        for s, op in enumerate(row):
            if op is not None:
                done[(op.kind, op.m, op.chunk * S + s)] = t
                heads[s] += 1
        rows.append(tuple(row))
        t += 1
        if t > 4 * (M * R + S) * (R + 1):  # a fixed order that cannot proceed: a bug here, not bad input
            raise RuntimeError(f"1F1B order deadlocks for S={S} M={M} R={R}")
    return tuple(rows), done


def _colour(intervals: list[tuple[int, int, tuple[int, int]]]) -> tuple[dict[tuple[int, int], int], int]:
    """Slots for [arrive, last_read] intervals; a slot is reused only after its last read (strictly earlier tick)."""
    free_at: list[int] = []  # per slot: the last tick it is read
    slots: dict[tuple[int, int], int] = {}
    for start, end, key in sorted(intervals):
        slot = next((i for i, last in enumerate(free_at) if last < start), None)
        if slot is None:
            slot = len(free_at)
            free_at.append(end)
        free_at[slot] = end
        slots[key] = slot
    return slots, len(free_at)


@dataclass(frozen=True)
class OneFOneBPlan:
    """A 1F1B schedule as per-tick, per-stage integer tables (``[ticks, stages]``) for the scan.

    Attributes:
        table: the operations, for display (:func:`render`).
        kind: 0 idle, 1 forward, 2 backward.  ``m``, ``chunk``: the operation's micro-batch and chunk.
        act_slot: the stash slot holding the operation's input activation (−1: the pipeline input x).
        grad_slot: the slot holding the incoming gradient of a backward (−1: the output cotangent dy).
        recv_act / recv_grad: the slot the activation / gradient arriving this tick goes to (−1: none).
        act_slots / grad_slots: buffer sizes (the stash: at most about S, not M).
    """

    table: Table
    kind: np.ndarray
    m: np.ndarray
    chunk: np.ndarray
    act_slot: np.ndarray
    grad_slot: np.ndarray
    recv_act: np.ndarray
    recv_grad: np.ndarray
    act_slots: int
    grad_slots: int

    @property
    def ticks(self) -> int:
        return len(self.table)


def one_f_one_b(stages: int, microbatches: int, repeats: int = 1) -> OneFOneBPlan:
    """The 1F1B (R = 1) or interleaved 1F1B (R > 1, M a multiple of S) tick tables."""
    S, M, R = stages, microbatches, repeats
    V = S * R
    table, done = _simulate(S, M, R)
    T = len(table)
    act_iv: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(S)]
    grad_iv: list[list[tuple[int, int, tuple[int, int]]]] = [[] for _ in range(S)]
    for m in range(M):
        for v in range(V):
            s = v % S
            if v > 0:  # the activation arrives from v − 1 and is kept until this stage's backward recomputes from it
                act_iv[s].append((done[("F", m, v - 1)] + 1, done[("B", m, v)], (m, v)))
            if v < V - 1:
                grad_iv[s].append((done[("B", m, v + 1)] + 1, done[("B", m, v)], (m, v)))
    coloured = [_colour(iv) for iv in act_iv]
    gcoloured = [_colour(iv) for iv in grad_iv]
    tables = {name: np.full((T, S), -1, np.int32) for name in ("m", "chunk", "act", "grad", "ra", "rg")}
    kind = np.zeros((T, S), np.int32)
    for t, row in enumerate(table):
        for s, op in enumerate(row):
            if op is None:
                continue
            v = op.chunk * S + s
            kind[t, s] = FORWARD if op.kind == "F" else BACKWARD
            tables["m"][t, s], tables["chunk"][t, s] = op.m, op.chunk
            if v > 0:
                tables["act"][t, s] = coloured[s][0][(op.m, v)]
            if op.kind == "B" and v < V - 1:
                tables["grad"][t, s] = gcoloured[s][0][(op.m, v)]
            # what this op sends arrives at the neighbour next tick
            if t + 1 < T and op.kind == "F" and v < V - 1:
                tables["ra"][t + 1, (s + 1) % S] = coloured[(s + 1) % S][0][(op.m, v + 1)]
            if t + 1 < T and op.kind == "B" and v > 0:
                tables["rg"][t + 1, (s - 1) % S] = gcoloured[(s - 1) % S][0][(op.m, v - 1)]
    return OneFOneBPlan(
        table=table,
        kind=kind,
        m=np.maximum(tables["m"], 0),
        chunk=np.maximum(tables["chunk"], 0),
        act_slot=tables["act"],
        grad_slot=tables["grad"],
        recv_act=tables["ra"],
        recv_grad=tables["rg"],
        act_slots=max(1, max(n for _, n in coloured)),
        grad_slots=max(1, max(n for _, n in gcoloured)),
    )


def idle_fraction(table: Table) -> float:
    """The share of stage-ticks with no operation (the bubble, counting F and B ticks alike)."""
    cells = [op for row in table for op in row]
    return sum(op is None for op in cells) / len(cells)


def render(table: Table, repeats: int = 1) -> str:
    """The table as text: one line per stage, one column per tick (``.`` = idle)."""
    labels = [[(op.label(repeats) if op else ".") for op in row] for row in table]
    width = max(len(x) for row in labels for x in row)
    stages = len(table[0]) if table else 0
    return "\n".join(f"stage {s}: " + " ".join(row[s].rjust(width) for row in labels) for s in range(stages))
