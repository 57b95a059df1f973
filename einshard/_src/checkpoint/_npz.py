"""Reading checkpoints of the format before orbax (``einshard-checkpoint/1``, einshard <= 0.3).

One ``.npz`` archive: ``leaf_0``, ``leaf_1``, ... each leaf's whole (gathered)
array, and ``__einshard__``, a 0-d string array holding the JSON header
(format, leaves with key, path, expression, shape, dtype, and the caller's
meta).  Read, never written: new checkpoints are orbax directories.
"""

from __future__ import annotations

import json
import os
import pathlib
import zipfile
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..errors import EinshardError
from ..placement import einshard

NPZ_FORMAT = "einshard-checkpoint/1"


def npz_header(where: pathlib.Path) -> dict[str, Any]:
    try:
        with np.load(where, allow_pickle=False) as data:
            header = json.loads(str(data["__einshard__"]))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as err:
        raise EinshardError(f"{os.fspath(where)!r} is not an einshard checkpoint: {err}") from None
    if header.get("format") != NPZ_FORMAT:
        raise EinshardError(f"{os.fspath(where)!r}: unknown checkpoint format {header.get('format')!r}")
    return header


def _place(array: np.ndarray, sh: jax.sharding.Sharding) -> jax.Array:
    # Each process transfers only the shards its devices hold (also under jax.distributed).
    return jax.make_array_from_callback(array.shape, sh, lambda idx: array[idx])


def restore_npz(
    where: pathlib.Path,
    entries: list[dict[str, Any]],
    treedef: Any,
    texts: list[str | None],
    like_leaves: list[Any],
    mesh: Mesh | None,
) -> Any:
    """The format before orbax: every leaf whole in one .npz, laid out again (a ``like`` sharding, or einshard())."""
    out = []
    with np.load(where, allow_pickle=False) as data:
        for entry, text, leaf in zip(entries, texts, like_leaves):
            array = data[entry["key"]]
            sh = (
                getattr(leaf, "sharding", None)
                if text is None and isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
                else None
            )
            if isinstance(sh, jax.sharding.Sharding):
                out.append(_place(array, sh))
            else:
                out.append(einshard(array, text or entry["expression"], mesh=mesh))
    return jax.tree_util.tree_unflatten(treedef, out)
