"""What XLA's SPMD partitioner sends to slice an axis split ``n`` ways into a result split the same way.

A ``slice`` (``jnp.split``'s pieces lower to slices) of a split axis is, for XLA, a windowed read of size 1
whose low padding is minus the slice's start (``HandleSlice`` → ``ReshardAsWindowedInput``).  Device ``k``
holds input positions ``[k·s, (k+1)·s)`` and needs ``[offset + k·o, offset + (k+1)·o)`` (``s`` the input
block, ``o`` the result block); the halos are what it needs beyond its own block on each side:
``left(k) = k·s - (offset + k·o)``, ``right(k) = offset + (k+1)·o - (k+1)·s``.  XLA then moves them one of
three ways (``ExchangeHaloAndGetValidData``):

* a halo wider than twice the result block: the *compact* exchange, each device's needed stretch sent
  from the block that holds it, as many disjoint sends as possible sharing one collective-permute
  (``ExchangeHaloCompact``);
* otherwise the plain *halo* exchange: one collective-permute per neighbour distance and side, each
  sending the whole halo (the stretch from the needed start to the block's end, ``ExchangeHalo``: a
  GRU's fused [8, 192] gates over 2 split into 3 × 64 send 64 columns each way, not the 32 each device
  reads), minus what no device reads at its far end;
* where the halos reach past the neighbours with most of the axis to move, the axis is gathered whole
  (an all-gather) and sliced locally.

The functions here are pure arithmetic on the sizes (positions along the axis); the rules turn them into
collectives (rules_ordering.split).  Measured against the compiled HLO on 2-, 4- and 8-device axes
(tests/test_scan_carry_rules.py: the slice sizes drawn, each permute's size compared).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["HaloSend", "Pieces", "SliceMove", "exchange_pieces", "group_compact_sends", "slice_move"]

SliceHow = Literal["none", "halo", "compact", "gather"]
Pieces = list[tuple[int, int]]  # one collective-permute each: (positions sent, sending devices per group)


@dataclass(frozen=True)
class SliceMove:
    """How XLA brings one slice's data into place: ``how`` and each collective-permute's size (positions)."""

    how: SliceHow
    permutes: tuple[int, ...] = ()


def _ceil_div(a: int, b: int) -> int:
    """C's ``CeilOfRatio`` for the positive sizes it is used with here (0 for a halo of 0 or less)."""
    return -(-a // b) if a > 0 else 0


def slice_move(length: int, n: int, size: int, offset: int) -> SliceMove:
    """What XLA sends for the slice ``[offset, offset + size)`` of an axis of ``length`` split ``n`` ways
    into a result split ``n`` ways (both dividing evenly)."""
    s, o = length // n, size // n
    left = [k * s - (offset + k * o) for k in range(n)]
    right = [offset + (k + 1) * o - (k + 1) * s for k in range(n)]
    if n <= 1 or (max(left) <= 0 and max(right) <= 0):
        return SliceMove("none")
    # ExchangeHaloAndGetValidData: the result block is the shard size with halo (a slice's window is 1 wide).
    if max(max(left), max(right)) > 2 * o:
        if 2 * o >= n * s:
            return SliceMove("gather")
        return SliceMove("compact", _compact(s, n, offset, o))
    return _exchange(s, n, left, right)


def _exchange(s: int, n: int, left: list[int], right: list[int]) -> SliceMove:
    """``ExchangeHalo``: one collective-permute per neighbour distance and side (:func:`exchange_pieces`)."""
    pieces = exchange_pieces(left, right, s)
    if pieces is None:
        return SliceMove("gather")
    return SliceMove("halo", tuple(rows for rows, _ in pieces))


def exchange_pieces(left: list[int], right: list[int], size: int) -> Pieces | None:
    """The collective-permutes of XLA's halo exchange along one axis split ``len(left)`` ways (its SPMD
    partitioner's ``ExchangeHalo``), or None where XLA gives up on halos and replicates the operand.

    ``left[k]`` / ``right[k]``: how many positions shard ``k`` needs beyond its block of ``size`` on each side
    (negative: fewer than its block).  XLA sends the largest halo any shard needs to every shard, one permute per
    block-sized piece (from the ``i+1``-th neighbour: ``n - i - 1`` senders), skipping pieces no shard reads.
    """
    n = len(left)
    max_left = max(left[1:], default=0)
    max_right = max(right[:-1], default=0)
    if max_left + max_right + size >= size * n and (max_left > size or max_right > size):
        return None
    # Only data within [left_bound, right_bound) of a block is read by anyone.
    left_bound, right_bound = -max(left), size + max(right)
    if left_bound >= right_bound:
        return None
    pieces: Pieces = []
    i = _ceil_div(max_left, size) - 1
    while i >= 0 and (-i - 1) * size < right_bound:
        pieces.append((min(max_left - size * i, size) - max(-i * size - right_bound, 0), n - i - 1))
        i -= 1
    skipped = min(max(left_bound - size, 0), max(max_right, 0)) // size
    for i in range(skipped, _ceil_div(max_right, size)):
        pieces.append((min(max_right - size * i, size) - max(left_bound - (i + 1) * size, 0), n - i - 1))
    return [(rows, senders) for rows, senders in pieces if rows > 0]


@dataclass(frozen=True)
class HaloSend:
    """One piece of a device's window that another device's block holds (XLA's compact exchange): the device
    that needs it and the stretch ``[start, limit)`` of the source block it reads."""

    dst: int
    start: int
    limit: int


def group_compact_sends(sends: Sequence[Sequence[HaloSend]], block: int) -> Pieces:
    """The collective-permutes of ``ExchangeHaloCompact`` given, per source device, the pieces it sends in XLA's
    order (by where they land in the destination's window): greedily, each permute takes the next piece of every
    source whose destination does not yet receive in it, sized to cover every piece it carries.  Returns
    (positions sent, sending devices) per permute."""
    nxt = [0] * len(sends)
    pieces: Pieces = []
    while True:
        seen: set[int] = set()
        lo, hi, senders = block, 0, 0
        for src, queue in enumerate(sends):
            if nxt[src] >= len(queue):
                continue
            h = queue[nxt[src]]
            # XLA delays a send whose destination already receives in this permute, or that would stretch it
            # from a small left piece to a small right one.
            if senders and (
                h.dst in seen
                or (lo > h.limit and hi == block and h.start == 0)
                or (hi < h.start and lo == 0 and h.limit == block)
            ):
                continue
            seen.add(h.dst)
            lo, hi, senders = min(lo, h.start), max(hi, h.limit), senders + 1
            nxt[src] += 1
        if not senders:
            return pieces
        pieces.append((hi - lo, senders))


@dataclass(frozen=True)
class _Halo:
    dst: int  # the device that needs it
    src: int  # the device whose block holds it
    start: int  # within the source block
    limit: int
    offset: int  # where it lands in the destination's stretch


def _compact(s: int, n: int, offset: int, o: int) -> tuple[int, ...]:
    """``ExchangeHaloCompact``: each device's stretch cut at block edges; sends from one source to distinct
    destinations share a collective-permute (one per round), sized to cover every piece it carries."""
    rounds: list[list[_Halo]] = []
    for i in range(n):
        start, limit = offset + i * o, offset + (i + 1) * o
        at, j = start, 0
        while at < limit:
            piece = min(s - at % s, limit - at)
            if j == len(rounds):
                rounds.append([])
            rounds[j].append(_Halo(i, at // s, at % s, at % s + piece, at - start))
            at, j = at + piece, j + 1
    # Per source, the pieces other devices need, in the order XLA lists them (round by round), then by offset.
    by_src: list[list[_Halo]] = [[] for _ in range(n)]
    for r in rounds:
        for h in r:
            if h.src != h.dst:
                by_src[h.src].append(h)
    for lst in by_src:
        lst.sort(key=lambda h: h.offset)  # stable, as absl::c_stable_sort
    sends = [[HaloSend(h.dst, h.start, h.limit) for h in lst] for lst in by_src]
    return tuple(rows for rows, _ in group_compact_sends(sends, s))
