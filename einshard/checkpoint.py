"""Checkpoints of sharded pytrees: one ``.npz`` file, every leaf with its einshard expression.

The format (``einshard-checkpoint/1``) is a plain numpy ``.npz`` archive:

* ``leaf_0``, ``leaf_1``, ...: each leaf as its whole global array (the
  shards gathered; under ``jax.distributed`` from every process, written by
  process 0 alone);
* ``__einshard__``: a 0-d string array holding JSON::

      {"format": "einshard-checkpoint/1",
       "leaves": [{"key": "leaf_0", "path": "['params']['unembed']",
                   "expression": "d v -> d v@model", "shape": [64, 256], "dtype": "float32"}, ...],
       "mesh": {"data": 4, "model": 2},
       ...anything the caller adds (step, config, ...)}

``load`` lays each leaf out again with ``einshard()``: with the expressions
it was saved with, or with new ones (resume a data-parallel run as tensor
parallel).  Any numpy can read the arrays back; no pickle is involved.

Example:
    >>> import jax, numpy as np, tempfile, os, einshard
    >>> from einshard import checkpoint
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> tree = {'w': einshard.einshard(np.arange(16.0).reshape(8, 2), 'a b -> a@data b', mesh=mesh)}
    >>> path = os.path.join(tempfile.mkdtemp(), 'ckpt.npz')
    >>> checkpoint.save(path, tree, {'w': 'a b -> a@data b'})
    >>> back = checkpoint.load(path, tree, mesh=mesh)
    >>> bool((np.asarray(back['w']) == np.asarray(tree['w'])).all()), back['w'].sharding.spec
    (True, P('data', None))
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .errors import EinshardError
from .placement import einshard

__all__ = ["FORMAT", "save", "load", "read_meta"]

FORMAT = "einshard-checkpoint/1"


def _gather(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def save(path: str | os.PathLike[str], tree: Any, expressions: Any, meta: Mapping[str, Any] | None = None) -> None:
    """Write ``tree`` (a pytree of arrays) and its per-leaf ``expressions`` (a tree of strings alike) to ``path``.

    Under ``jax.distributed`` every process must call it (the shards are
    gathered collectively); process 0 writes the file.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    texts = treedef.flatten_up_to(expressions)  # type: ignore[attr-defined]
    arrays: dict[str, np.ndarray] = {}
    described = []
    for i, ((p, leaf), text) in enumerate(zip(leaves, texts)):
        full = _gather(leaf)
        key = f"leaf_{i}"
        arrays[key] = full
        described.append(
            {
                "key": key,
                "path": jax.tree_util.keystr(p),
                "expression": text,
                "shape": list(full.shape),
                "dtype": str(full.dtype),
            }
        )
    header = {"format": FORMAT, "leaves": described, **dict(meta or {})}
    if jax.process_index() != 0:
        return
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, __einshard__=np.array(json.dumps(header)), **arrays)  # type: ignore[arg-type]
    os.replace(tmp, target)  # a crash mid-write never leaves a half checkpoint under the real name


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON header of a checkpoint (format, leaves with paths and expressions, and the caller's meta)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(str(data["__einshard__"]))
    except (OSError, KeyError, ValueError) as err:
        raise EinshardError(f"{os.fspath(path)!r} is not an einshard checkpoint: {err}") from None
    if header.get("format") != FORMAT:
        raise EinshardError(f"{os.fspath(path)!r}: unknown checkpoint format {header.get('format')!r}")
    return header


def load(
    path: str | os.PathLike[str],
    like: Any,
    *,
    mesh: jax.sharding.Mesh | None = None,
    expressions: Any = None,
) -> Any:
    """Read a checkpoint into the structure of ``like``, each leaf laid out by ``einshard()``.

    Args:
        path: a file written by :func:`save`.
        like: a pytree with the structure to restore (arrays or ``jax.ShapeDtypeStruct``);
            leaves are matched by path, and shapes must agree.
        mesh: the mesh for ``@`` expressions.
        expressions: a tree of expressions like ``like`` to lay leaves out anew;
            default: the expressions saved with each leaf.
    """
    header = read_meta(path)
    saved = {leaf["path"]: leaf for leaf in header["leaves"]}
    leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    texts = treedef.flatten_up_to(expressions) if expressions is not None else [None] * len(leaves)  # type: ignore[attr-defined]
    out = []
    with np.load(path, allow_pickle=False) as data:
        for (p, leaf), text in zip(leaves, texts):
            key = jax.tree_util.keystr(p)
            entry = saved.get(key)
            if entry is None:
                raise EinshardError(
                    f"checkpoint {os.fspath(path)!r} has no leaf {key}; it holds {len(saved)} leaves, "
                    f"e.g. {next(iter(saved), 'none')}"
                )
            array = data[entry["key"]]
            if tuple(array.shape) != tuple(np.shape(leaf)):
                raise EinshardError(
                    f"checkpoint leaf {key} has shape {tuple(array.shape)}, but the model expects {tuple(np.shape(leaf))}"
                )
            out.append(einshard(array, text or entry["expression"], mesh=mesh))
    return jax.tree_util.tree_unflatten(treedef, out)
