"""explain's predicted collectives, counted as the compiled HLO's are (tests comparing explain with XLA).

:func:`einshard.testing.hlo.normalized` drops groups of one device and counts a collective once per run; these count
a report the same way: each collective of an op ``op.repeat`` times (a loop body's runs), groups of one device left
out, and the bytes as ``array_bytes`` per run (what ``hlo.collective_bytes`` sums of the compiled program).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from einshard._src.testing.bounds import Measured


def _counted(report: Any, bytes_of: Callable[[Any], float]) -> tuple[Counter[str], float]:
    """The report's collectives by kind (counted per run) and ``bytes_of`` each, summed per run."""
    kinds: Counter[str] = Counter()
    total = 0.0
    for op in report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                kinds[c.kind] += op.repeat
                total += bytes_of(c) * op.repeat
    return kinds, total


def explained_collectives(report: Any) -> tuple[Counter[str], int]:
    """The report's collectives by kind (counted per run) and the bytes they move per device."""
    kinds, moved = _counted(report, lambda c: c.array_bytes)
    return kinds, int(moved)


def sent_collectives(report: Any) -> tuple[Counter[str], float]:
    """The report's collectives by kind (counted per run) and the bytes each device sends (``c.bytes``): what
    ``einshard.testing.hlo``'s sent-bytes reading of a compiled program sums."""
    return _counted(report, lambda c: c.bytes)


def explained(report: Any) -> Measured:
    """explain's side of a comparison: its collectives, bytes and peak per device (``report.peak_bytes``)."""
    kinds, sent = explained_collectives(report)
    return Measured(kinds, sent, float(report.peak_bytes))
