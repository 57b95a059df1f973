"""explain's predicted collectives, counted as the compiled HLO's are (tests comparing explain with XLA).

:func:`einshard.testing.hlo.normalized` drops groups of one device and counts a collective once per run; these count
a report the same way: each collective of an op ``op.repeat`` times (a loop body's runs), groups of one device left
out, and the bytes as ``array_bytes`` per run (what ``hlo.collective_bytes`` sums of the compiled program).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from einshard._src.testing.bounds import Measured


def explained_collectives(report: Any) -> tuple[Counter[str], int]:
    """The report's collectives by kind (counted per run) and the bytes they move per device."""
    kinds: Counter[str] = Counter()
    sent = 0
    for op in report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                kinds[c.kind] += op.repeat
                sent += c.array_bytes * op.repeat
    return kinds, sent


def explained(report: Any) -> Measured:
    """explain's side of a comparison: its collectives, bytes and peak per device (``report.peak_bytes``)."""
    kinds, sent = explained_collectives(report)
    return Measured(kinds, sent, float(report.peak_bytes))
