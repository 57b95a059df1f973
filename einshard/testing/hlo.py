"""Read a compiled HLO module's collectives (``compiled.as_text()``): kinds, groups, bytes, in program order."""

from .._src.testing.hlo import (
    DTYPE_BYTES,
    HloCollective,
    collective_bytes,
    collective_counts,
    collectives,
    normalized,
    signature,
)

__all__ = [
    "HloCollective",
    "collectives",
    "normalized",
    "signature",
    "collective_counts",
    "collective_bytes",
    "DTYPE_BYTES",
]
