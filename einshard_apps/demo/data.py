"""The demo's training text and its batches (the same on every process)."""

from __future__ import annotations

import importlib.resources
import pathlib
from typing import Any

from einshard.errors import EinshardError

__all__ = ["load_corpus", "batch_at"]


def load_corpus(path: str | None = None) -> bytes:
    """The training text as bytes: ``path`` (UTF-8), or the corpus shipped in ``einshard_apps/data``."""
    if path is None:
        return importlib.resources.files("einshard_apps").joinpath("data", "corpus.txt").read_bytes()
    try:
        raw = pathlib.Path(path).read_bytes()
    except OSError as err:
        raise EinshardError(f"--data: cannot read {path!r}: {err.strerror}") from None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise EinshardError(f"--data: {path!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    return raw


def batch_at(corpus: bytes, step: int, batch: int, seq: int, seed: int) -> Any:
    """The global batch of step ``step``: ``batch`` random windows of ``seq + 1`` bytes, the same on every process.

    Example:
        >>> batch_at(b"hello world, hello einshard", 0, 2, 4, 0).shape
        (2, 5)
    """
    import numpy as np

    if len(corpus) < seq + 2:
        raise EinshardError(f"the text has {len(corpus)} bytes; --seq {seq} needs at least {seq + 2}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(corpus) - seq - 1, size=batch)
    data = np.frombuffer(corpus, dtype=np.uint8)
    return np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
