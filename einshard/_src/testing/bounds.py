"""How far explain is from XLA, and whether a report's approximate bound covers it: one rule for every check.

The per-primitive differential test (tests/test_primitive_rules.py) and the external corpus harness
(tests/external_corpus/compare.py) both hold an approximate report to what it says on its first line: XLA's
collectives, bytes sent and peak memory may differ from explain's by at most ``report.approximate_bound``.
They measure the two sides their own way (one-op programs vs whole steps); the distance and the verdict are
computed here, once, so that the two cannot drift apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from ..analysis.program.report import ApproximateBound

BYTES_TOLERANCE = 0.10  # bytes sent per device: explain within 10% of XLA is a match
PEAK_RANGE = (0.75, 1.25)  # peak memory per device: explain / XLA within this range is a match


@dataclass(frozen=True)
class Measured:
    """One side's numbers for a program: collective kinds with their counts, bytes sent and peak bytes per device."""

    kinds: Mapping[str, int]
    sent: float
    peak: float


@dataclass(frozen=True)
class Gaps:
    """explain vs XLA in the bound's terms, each 0 where that comparison is within its tolerance.

    ``collectives``: the multiset edit distance (how many of one side's collectives are not the other's, the
    larger side); ``bytes``: the absolute difference per device; ``peak``: how far explain's peak per device
    lies outside the range of XLA's it is held to."""

    collectives: int
    bytes: float
    peak: float

    @property
    def none(self) -> bool:
        """Whether explain matches XLA (every comparison within tolerance)."""
        return not (self.collectives or self.bytes or self.peak)


def collective_distance(explain: Mapping[str, int], xla: Mapping[str, int]) -> int:
    """How many collectives one side has that the other has not (the larger of the two multiset differences)."""
    e, x = Counter(explain), Counter(xla)
    return max(sum((e - x).values()), sum((x - e).values()))


def gaps(
    explain: Measured,
    xla: Measured,
    *,
    bytes_tolerance: float = BYTES_TOLERANCE,
    peak_range: tuple[float, float] = PEAK_RANGE,
    peak_slack: float = 0.0,
) -> Gaps:
    """How far ``explain`` is from ``xla``.  ``peak_range``: the explain / XLA ratios that count as a match (a
    check of ops whose scratch explain does not model passes a wider one); ``peak_slack``: an absolute
    difference that counts as a match too (tiny programs, where XLA's alignment and scalars dominate)."""
    sent_gap = abs(explain.sent - xla.sent)
    sent = 0.0 if sent_gap <= bytes_tolerance * max(abs(xla.sent), 1.0) else sent_gap
    # Peak: how far explain's lies outside the range it is held to (the report's peak caveat, or the corpus's
    # 25%): the report says XLA's may differ beyond that range by its approximate ops' peak bound.
    lo, hi = peak_range
    beyond = max(lo * xla.peak - explain.peak, explain.peak - hi * max(xla.peak, 1.0), 0.0)
    peak = 0.0 if beyond == 0 or abs(explain.peak - xla.peak) <= peak_slack else float(beyond)
    return Gaps(collective_distance(explain.kinds, xla.kinds), sent, peak)


def within_bound(g: Gaps, bound: ApproximateBound) -> bool:
    """Whether every gap lies within the bound a report states (strict: no tolerance added to the bound).

    A bound with no static size (a while loop's run-time trip count) has nothing to exceed."""
    if bound.collectives is None or bound.bytes is None:
        return True
    return g.collectives <= bound.collectives and g.bytes <= bound.bytes and g.peak <= bound.peak
