"""Sharded checkpoints that remember their layouts (docs/checkpoint.md)."""

from ._src.checkpoint import FORMAT, Saving, read_meta, restore, save

__all__ = ["FORMAT", "Saving", "save", "restore", "read_meta"]
