"""Hardware targets: a mesh of a chip you do not have (``'tpu:v5e-256'``), for plans and compiles (docs/targets.md)."""

from ._src.targets import (
    CHIPS,
    Chip,
    Target,
    libtpu_available,
    on_target,
    parse_target,
    target_devices,
    target_mesh,
)

__all__ = ["Chip", "Target", "CHIPS", "parse_target", "target_mesh", "target_devices", "libtpu_available", "on_target"]
