"""Collectives counted alike on both sides of a comparison: XLA's compiled program and explain's report.

Kinds by count (a loop's collective once per trip on both sides) and the bytes of the buffers they move; collectives
of a group of one device are not collectives on either side.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from einshard.testing import hlo


def xla_collectives(compiled: Any) -> tuple[Counter, float]:
    """(kinds by count, bytes) of a compiled program's collectives (``einshard.testing.hlo.normalized``)."""
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    kinds: Counter = Counter()
    for c in found:
        kinds[c.kind] += c.runs
    return kinds, float(sum(c.array_bytes * c.runs for c in found))


def explained_collectives(report: Any) -> tuple[Counter, float]:
    """(kinds by count, bytes) of a report's collectives, each op's repeats counted."""
    ops = [(op, c) for op in report.ops for c in op.collectives if c.group_size > 1]
    kinds: Counter = Counter()
    for op, c in ops:
        kinds[c.kind] += op.repeat
    return kinds, float(sum(c.array_bytes * op.repeat for op, c in ops))
