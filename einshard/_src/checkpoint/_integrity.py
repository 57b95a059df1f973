"""Checksums of a checkpoint: every stored file (sha256) and every array's values (a layout-free digest).

orbax and tensorstore keep no checksum of the array data they write (OCDBT
data files carry none, and a flipped bit restores as a wrong value), so
einshard writes ``einshard-checksums.json`` into the checkpoint as the last
step of a save, before the checkpoint gets its name:

* ``files``: size and sha256 of every other file, so a flipped bit or a
  truncation of any stored file (array data, orbax's metadata, einshard's
  header) is found before anything is read;
* ``leaves``: a digest of each array's values, computed on the devices from
  the array as laid out (a sum of the values' bit patterns weighted by their
  global positions, exact in uint32, so it is the same for any sharding and
  any number of processes), and checked again on the restored arrays, which
  names the damaged leaf;
* ``digest``: a sha256 of the two above, so damage to this file itself is found.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import EinshardError

MANIFEST = "einshard-checksums.json"
MANIFEST_FORMAT = "einshard-checksums/1"
_CHUNK = 1 << 20


# ---------------------------------------------------------------------------
# Array values


def _words(x: jax.Array) -> list[jax.Array]:
    """The array's bit patterns as uint32 arrays (several for complex or 64-bit values)."""
    dtype = np.dtype(x.dtype)
    if dtype == np.bool_:
        return [x.astype(jnp.uint32)]
    if dtype.kind == "c":
        return [*_words(jnp.real(x)), *_words(jnp.imag(x))]
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}.get(dtype.itemsize)
    if unsigned is None:
        raise TypeError(dtype)
    bits = jax.lax.bitcast_convert_type(x, unsigned)
    if dtype.itemsize == 8:  # bitcast to a narrower type adds a trailing axis of 2 words
        return [bits[..., 0], bits[..., 1]]
    return [bits.astype(jnp.uint32)]


def _positions(shape: tuple[int, ...]) -> jax.Array:
    """Each element's row-major position in the global array, mod 2**32 (built from iotas, no reshape)."""
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride % (1 << 32))
        stride *= shape[axis]
    return pos


@jax.jit
def _digest_words(x: jax.Array) -> jax.Array:
    """Two uint32 sums: a flip of any one bit changes the first (each word times an odd weight)."""
    pos = _positions(tuple(x.shape))
    odd = pos * jnp.uint32(2) + jnp.uint32(1)
    mixed = pos * jnp.uint32(0x9E3779B1) + jnp.uint32(0x7F4A7C15)
    sums = []
    for k, w in enumerate(_words(x)):
        salt = jnp.uint32(0x85EBCA6B * (k + 1) % (1 << 32))
        sums.append(jnp.sum(w * odd + salt, dtype=jnp.uint32))
        sums.append(jnp.sum((w ^ mixed) * (mixed | jnp.uint32(1)), dtype=jnp.uint32))
    return jnp.stack(sums)


def start_digests(leaves: Sequence[Any]) -> list[jax.Array | None]:
    """Dispatch the digest of every leaf (on the devices it lives on); None where the dtype has no bit view."""
    out: list[jax.Array | None] = []
    for leaf in leaves:
        value = leaf if isinstance(leaf, jax.Array) else jnp.asarray(np.asarray(leaf))
        try:
            out.append(_digest_words(value))
        except TypeError:  # int4, float4 and other sub-byte types
            out.append(None)
    return out


def finish_digests(started: Iterable[jax.Array | None]) -> list[str | None]:
    """The digests as hex text (the sums are replicated scalars: every process can read them)."""
    return [None if d is None else np.asarray(d).astype(">u4").tobytes().hex() for d in started]


# ---------------------------------------------------------------------------
# Files


def _sha256(file: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stored_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(f for f in directory.rglob("*") if f.is_file() and f.name != MANIFEST)


def _body_digest(files: dict[str, Any], leaves: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps({"files": files, "leaves": leaves}, sort_keys=True).encode()).hexdigest()


def write_manifest(directory: pathlib.Path, leaves: dict[str, str | None]) -> None:
    """Write the checksums of every file in ``directory`` and of every leaf (the last step of a save)."""
    files = {
        f.relative_to(directory).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)}
        for f in _stored_files(directory)
    }
    body = {"format": MANIFEST_FORMAT, "files": files, "leaves": leaves, "digest": _body_digest(files, leaves)}
    partial = directory / (MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(body, f, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, directory / MANIFEST)  # present only once whole


def is_complete(directory: pathlib.Path) -> bool:
    """Whether a staged save got as far as its checksums (its last step)."""
    return (directory / MANIFEST).is_file()


def read_manifest(directory: pathlib.Path) -> dict[str, Any] | None:
    """The checksums stored in ``directory``; None for a checkpoint written before they were (no file)."""
    file = directory / MANIFEST
    if not file.is_file():
        return None
    try:
        body = json.loads(file.read_bytes())
        ok = (
            isinstance(body, dict)
            and body.get("format") == MANIFEST_FORMAT
            and isinstance(body.get("files"), dict)
            and isinstance(body.get("leaves"), dict)
            and body.get("digest") == _body_digest(body["files"], body["leaves"])
        )
    except (OSError, ValueError, TypeError):
        ok = False
    if not ok:
        raise EinshardError(
            f"checkpoint {os.fspath(directory)!r}: its checksums file {os.fspath(file)!r} is damaged "
            "(it does not match its own digest)"
        )
    return dict(body)


def damaged_files(directory: pathlib.Path, manifest: dict[str, Any]) -> list[str]:
    """Every file whose size or sha256 differs from the manifest, or that is missing: 'name (why)'."""
    out = []
    for name, want in sorted(manifest["files"].items()):
        file = directory / name
        try:
            size = file.stat().st_size
        except OSError:
            out.append(f"{name} (missing)")
            continue
        if size != want.get("size"):
            out.append(f"{name} ({size} bytes, {want.get('size')} were written)")
        elif _sha256(file) != want.get("sha256"):
            out.append(f"{name} (its sha256 differs from the one written)")
    return out
