"""Read a compiled HLO module's collectives (``compiled.as_text()``): kinds, groups, bytes, in program order."""

from .._src.testing.hlo import DTYPE_BYTES, HloCollective, collectives, normalized, signature

__all__ = ["HloCollective", "collectives", "normalized", "signature", "DTYPE_BYTES"]
