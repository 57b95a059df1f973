"""What XLA's SPMD partitioner sends when an op reads neighbours' data: halo exchanges and shifted pieces.

Two measured patterns (one-op programs on the 8-CPU-device mesh, ``.compile().as_text()``):

* a **shift** (``slice``, ``split``, ``pad`` along a split axis): device ``k`` of the result needs the input
  positions ``[k·o + offset, (k+1)·o + offset)``; each piece that lives on another device arrives by a
  collective-permute, one per distinct source-to-destination distance, as large as the largest piece at
  that distance (``x[:, 4:20]`` on 2 devices: one permute of 4 columns);
* a **halo** (``conv_general_dilated``, ``reduce_window*`` along a split spatial axis): the window reaches
  ``left`` positions into the previous device's block and ``right`` into the next one's; each side is one
  collective-permute per device block it spans.  Several split axes exchange one after another, each
  moving the block already grown by the previous axes' halos (a 2-D split's second exchange carries the
  corners).

These functions are pure arithmetic on sizes; the rules (``rules_ordering``, ``rules_windows``) price
them and record them on the walker with :func:`charge`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..cost import Collective, sent_bytes
from .report import APPROXIMATE_MARK

if TYPE_CHECKING:
    from .registry import WalkerLike

__all__ = ["APPROXIMATE", "shift_pieces", "halo_pieces", "charge", "itemsize", "group_size", "mark_approximate"]

# The note that marks an op whose collectives turn on an XLA heuristic explain does not reproduce
# (``OpReport.note`` starts with it, followed by what may differ and by how much).
APPROXIMATE = APPROXIMATE_MARK

SentKind = Literal["all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"]


def mark_approximate(w: WalkerLike, since: int, why: str) -> None:
    """Mark the ops recorded since index ``since`` as approximate (``OpReport.note``), saying what may differ."""
    if w.quiet:
        return
    from dataclasses import replace

    for i in range(since, len(w.ops)):
        w.ops[i] = replace(w.ops[i], note=f"{APPROXIMATE}: {why}")


def itemsize(dtype: Any) -> int:
    return int(np.dtype(dtype).itemsize)


def group_size(w: WalkerLike, axes: tuple[str, ...]) -> int:
    return math.prod(w.costs.mesh_sizes[m] for m in axes)


def shift_pieces(length: int, n: int, out_length: int, offset: int) -> list[int]:
    """Collective-permute sizes (positions along the axis) for a result whose device ``k`` holds
    ``[k·o + offset, (k+1)·o + offset)`` of an input split ``n`` ways (``o = out_length / n``)."""
    s, o = length // n, out_length // n
    by_distance: dict[int, int] = {}
    for k in range(n):
        lo, hi = max(k * o + offset, 0), min((k + 1) * o + offset, length)
        for j in range(lo // s, -(-hi // s)):
            piece = min(hi, (j + 1) * s) - max(lo, j * s)
            if j != k and piece > 0:
                by_distance[j - k] = max(by_distance.get(j - k, 0), piece)
    return [by_distance[d] for d in sorted(by_distance)]


def halo_pieces(
    length: int,
    n: int,
    out_length: int,
    window: int,
    stride: int,
    dilation: int,
    low: int,
    window_split: bool = False,
) -> list[int]:
    """Collective-permute sizes (positions) of a windowed read along one axis split ``n`` ways.

    Device ``k`` computes result positions ``[a, b)`` over window taps ``[p, q)``; result position ``r``
    with tap ``t`` reads input ``r·stride + t·dilation - low``.  Normally the result is split and every
    device runs the whole window; a window split too (``window_split``: a kernel gradient, whose
    "window" is the split cotangent) gives each device its block of taps and the whole result.
    """
    s = length // n
    left = right = 0
    for k in range(n):
        if window_split:
            a, b, p, q = 0, out_length, k * (window // n), (k + 1) * (window // n)
        else:
            o = out_length // n
            a, b, p, q = k * o, (k + 1) * o, 0, window
        start = a * stride + p * dilation - low
        end = (b - 1) * stride + (q - 1) * dilation - low + 1
        if k > 0:
            left = max(left, k * s - start)
        if k < n - 1:
            right = max(right, end - (k + 1) * s)
    pieces = []
    for side in (left, right):
        while side > 0:
            pieces.append(min(side, s))
            side -= s
    return pieces


def charge(
    w: WalkerLike,
    eqn: Any,
    phase: str,
    repeat: int,
    kind: SentKind,
    axes: tuple[str, ...],
    arrays: list[int],
    why: str,
    out: Any = None,
    note: str = "",
) -> None:
    """Record one collective of ``kind`` over ``axes`` per buffer size in ``arrays`` (bytes, XLA's convention)."""
    n = group_size(w, axes)
    if n <= 1 or not arrays:
        return
    colls = []
    for array in arrays:
        sent = sent_bytes(kind, n, array)
        t = w.costs.profile.collective_time(kind, n, sent, array)
        colls.append(Collective(kind, axes, n, int(sent), int(array), t, "operand 1", why))
    w.record(eqn, phase, why, out, tuple(colls), 0.0, sum(c.time for c in colls), repeat, note)
