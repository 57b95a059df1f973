"""Checkpoints of sharded pytrees on orbax: each process writes its own shards, restore into any layout.

``save(path, tree)`` writes a directory with orbax-checkpoint (tensorstore,
OCDBT): every process writes only the shards its own devices hold (one copy
of each replicated shard), nothing is gathered.  Next to the arrays, in
orbax's checkpoint metadata, einshard keeps a JSON header::

    {"format": "einshard-checkpoint/2",
     "leaves": [{"path": "['params']['unembed']", "expression": "a b -> a b@model",
                 "shape": [64, 256], "dtype": "float32", "mesh": 0}, ...],
     "meshes": [{"axes": [["data", 4, "Explicit"], ["model", 2, "Explicit"]]}],
     "checksums": "einshard-checksums.json",
     ...anything the caller adds (step, config, ...)}

and, as the last file of a save, ``einshard-checksums.json``: the sha256 of
every stored file and a digest of every leaf's values, both checked by
``restore``.  A save is staged beside ``path`` and renamed in once complete,
under an exclusive lock on ``path + '.einshard-lock'`` (one writer per path).

``restore(path, like)`` lays every leaf out again: with the expression it was
saved with, or with new ones (one expression, rules as ``einshard()`` takes
them, or a tree of expressions), on the saved mesh shape, the current mesh
or ``mesh=``.  orbax reads, on each process, only the chunks its devices need.

Saves are atomic (staged, then renamed in; ``overwrite=True`` swaps the old
checkpoint out only after the new one is complete, and the next save or
restore recovers from a swap that was interrupted) and may run in the background
(``blocking=False``; ``wait_until_finished()`` on the returned handle).
Checkpoints of the format before (``einshard-checkpoint/1``: one ``.npz``
with gathered arrays) still restore; new ones are always written with orbax.

orbax-checkpoint is an optional dependency: ``pip install 'einshard[checkpoint]'``.

Example:
    >>> import jax, numpy as np, tempfile, os, einshard
    >>> from einshard import checkpoint
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> tree = {'w': einshard.einshard(np.arange(64.0).reshape(8, 8), 'a b -> a@data b', mesh=mesh)}
    >>> path = os.path.join(tempfile.mkdtemp(), 'step_1')
    >>> checkpoint.save(path, tree, meta={'step': 1}).path.name
    'step_1'
    >>> checkpoint.read_meta(path)['leaves'][0]['expression']
    'a b -> a@data b'
    >>> back = checkpoint.restore(path, expressions='a b -> a b@data')
    >>> bool((np.asarray(back['w']) == np.asarray(tree['w'])).all()), back['w'].sharding.spec == jax.P(None, 'data')
    (True, True)
"""

from __future__ import annotations

import errno
import json
import math
import os
import pathlib
import threading
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from .._placement.agreement import absent_processes, agree, exchange, first_difference, peer_timeout
from ..core.mesh import current_concrete_mesh
from ..errors import EinshardError
from ..placement import describe, is_anonymous, sharding
from ..tree_rules import leaf_expressions
from . import _guard, _integrity, _keys
from ._npz import NPZ_FORMAT, npz_header, restore_npz

__all__ = ["FORMAT", "Saving", "save", "restore", "read_meta"]

FORMAT = "einshard-checkpoint/2"
_RESERVED = ("format", "leaves", "meshes", "checksums")
_PREVIOUS = _guard.PREVIOUS
# orbax's setup of a save (its temporary directory, its async machinery) is not
# safe from several threads at once: the calls into orbax take turns.
_ORBAX_TURN = threading.RLock()
# What the runtime says when a collective or barrier loses a process.
_PEER_FAILURES = ("DEADLINE_EXCEEDED", "CoordinationService", "Gloo", "UNAVAILABLE", "barrier")


def _orbax() -> ModuleType:
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise EinshardError(
            "einshard.checkpoint writes and reads sharded checkpoints with orbax-checkpoint, which is not "
            "installed: pip install 'einshard[checkpoint]'"
        ) from None
    return ocp


# ---------------------------------------------------------------------------
# Saving


class Saving:
    """A save in progress: ``wait_until_finished()`` returns once the checkpoint is complete at ``path``."""

    def __init__(self, path: pathlib.Path, checkpointer: Any, finish: Any) -> None:
        self.path = path
        self._checkpointer = checkpointer
        self._finish = finish  # writes the checksums, renames the staged checkpoint in, releases the lock

    def wait_until_finished(self) -> None:
        if self._checkpointer is None:
            return
        checkpointer, self._checkpointer = self._checkpointer, None
        self._finish(checkpointer)

    def done(self) -> bool:
        """Whether the save has finished (after ``wait_until_finished``)."""
        return self._checkpointer is None

    def __repr__(self) -> str:
        return f"Saving({os.fspath(self.path)!r}, {'done' if self.done() else 'in progress'})"


def _sync(name: str) -> None:
    """Wait for every process (bounded: the peer timeout, then an EinshardError naming the absent)."""
    exchange("checkpoint-sync", "", name)


def _drain(checkpointer: Any) -> None:
    """Let every background write of a failed save end, then close it.

    orbax re-raises one failed background write per wait and leaves the others
    running, and one of them could re-create the staging directory after it is
    removed: wait until none is left.
    """
    for _ in range(64):
        try:
            with _ORBAX_TURN:
                checkpointer.close()
            return
        except Exception:
            continue


def _join_orbax_threads(started_with: set[threading.Thread], deadline_s: float) -> None:
    """Wait (bounded) for the threads orbax started for a failed save: some still write after the failure."""
    end = time.monotonic() + deadline_s
    for t in set(threading.enumerate()) - started_with:
        if t is threading.current_thread():
            continue
        if type(t).__module__.startswith("orbax") or t.name.startswith(("metadata_store", "array_type_handler")):
            t.join(max(0.0, end - time.monotonic()))


def _write_error(target: pathlib.Path, err: BaseException) -> EinshardError:
    """What a failed write becomes: disk full said plainly, anything else with its first line."""
    if isinstance(err, EinshardError):
        return err
    text = _first_lines(err)
    code = err.errno if isinstance(err, OSError) else None
    room = {
        "the disk is full": code == errno.ENOSPC or any(s in str(err) for s in ("RESOURCE_EXHAUSTED", "No space left")),
        "the disk quota is used up": code == errno.EDQUOT or "Disk quota" in str(err),
        "a file size limit was hit": code == errno.EFBIG or "File too large" in str(err),
    }
    full = any(room.values())
    what = next((k for k, hit in room.items() if hit), "the write failed")
    if not full and jax.process_count() > 1 and any(s in str(err) for s in _PEER_FAILURES):
        # A collective of the save (its checksums, orbax's barriers) lost a peer: say which one.
        absent = absent_processes(min(5.0, peer_timeout()))
        if absent:
            what = f"process{'es' if len(absent) > 1 else ''} {', '.join(map(str, absent))} stopped taking part"
    return EinshardError(
        f"cannot save the checkpoint at {os.fspath(target)!r}: {what} ({text}); the partly written copy was "
        "removed and the checkpoint that was there before (if any) is unchanged"
    )


def _orbax_name(path: tuple[Any, ...]) -> str:
    """The name orbax stores a leaf under: its keys joined with '.' (not injective: 'a.b' and a/b collide)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        else:
            parts.append(str(getattr(k, "key", k)))
    return ".".join(parts)


def _refuse_colliding_names(keys: list[str], paths: list[tuple[Any, ...]]) -> None:
    seen: dict[str, str] = {}
    for key, path in zip(keys, paths):
        name = _orbax_name(path)
        if name in seen:
            raise EinshardError(
                f"the leaves {seen[name]} and {key} would be stored under the same name {name!r} "
                "(orbax joins the keys of a path with '.'): restoring would give both the values of one",
                hint="Rename one of them (e.g. replace the '.' in the flat key), or nest both the same way.",
            )
        seen[name] = key


def _check_processes_agree(target: pathlib.Path, header: dict[str, Any]) -> None:
    """Every process saves the same tree with the same layouts to the same path (else all refuse)."""
    if jax.process_count() == 1:
        return
    record = {"path": os.fspath(target), "leaves": header["leaves"], "meshes": header["meshes"]}

    def differ(a: dict[str, Any], b: dict[str, Any]) -> str:
        if a["path"] != b["path"]:
            return f"path {a['path']!r} against {b['path']!r}"
        if a["meshes"] != b["meshes"]:
            return f"meshes {a['meshes']} against {b['meshes']}"
        return first_difference(
            a["leaves"], b["leaves"], lambda e: f"{e['path']} {e['shape']} {e['dtype']} {e['expression']!r}"
        )

    agree("checkpoint-save", record, f"the checkpoint to save at {os.fspath(target)!r}", differ)


def _mesh_record(mesh: Mesh | jax.sharding.AbstractMesh) -> dict[str, Any]:
    axes = [[str(n), int(mesh.shape[n]), t.name] for n, t in zip(mesh.axis_names, mesh.axis_types)]
    return {"axes": axes, **({"anonymous": True} if is_anonymous(mesh) else {})}


def _leaf_expressions(tree: Any, expressions: Any, leaves: list[tuple[Any, Any]], treedef: Any) -> list[str | None]:
    """One expression per leaf: given (one, rules, or a tree like ``tree``), or None to describe the leaf."""
    if expressions is None:
        return [None] * len(leaves)
    if _is_expression_tree(expressions, treedef):
        return list(treedef.flatten_up_to(expressions))
    return list(leaf_expressions(tree, expressions))


def _is_expression_tree(expressions: Any, treedef: Any) -> bool:
    """A tree of strings with ``treedef``'s structure (rather than rules keyed by path patterns)."""
    if isinstance(expressions, str):
        return False
    try:
        return jax.tree_util.tree_structure(expressions) == treedef
    except (TypeError, ValueError):
        return False


def _saved_expression(key: str, leaf: Any, text: str | None) -> str:
    """The expression stored for ``leaf``: ``text`` if it gives the leaf's actual layout, else refuse."""
    if text is None:
        return describe(leaf)
    sh = getattr(leaf, "sharding", None)
    if not isinstance(leaf, jax.Array) or not isinstance(sh, NamedSharding):
        return text
    mesh = sh.mesh if isinstance(sh.mesh, Mesh) and not is_anonymous(sh.mesh) else None
    try:
        want = sharding(text, tuple(leaf.shape), mesh=mesh)
    except EinshardError as err:
        raise EinshardError(f"at {key} (shape {tuple(leaf.shape)}): {err.reason}", err.expression, err.column) from None
    if not want.is_equivalent_to(sh, leaf.ndim):
        raise EinshardError(
            f"at {key}: the expression {text!r} lays the leaf out as {want.spec}, but it is laid out as "
            f"{sh.spec} ({describe(leaf)!r}); the saved expression must describe the leaf",
            hint="Leave expressions= out to store what einshard.describe() reads from each leaf.",
        )
    return text


def save(
    path: str | os.PathLike[str],
    tree: Any,
    expressions: Any = None,
    meta: Mapping[str, Any] | None = None,
    *,
    blocking: bool = True,
    overwrite: bool = False,
) -> Saving:
    """Write ``tree`` (a pytree of jax.Arrays, possibly spanning processes) to the directory ``path``.

    Under ``jax.distributed`` every process calls it with the same ``path`` (a
    file system all of them see); each writes only its own shards.

    Args:
        path: the checkpoint directory; it must not exist unless ``overwrite``.
        tree: the pytree to save (jax.Arrays; numpy arrays and scalars are saved whole).
        expressions: the einshard expression stored with each leaf: one, rules
            as ``einshard()`` takes them, or a tree of them like ``tree``.  Each
            must give the leaf's actual layout.  Default: ``einshard.describe(leaf)``.
        meta: JSON-serialisable values stored with it (step, config, ...).
        blocking: wait until the checkpoint is complete (default).  False
            returns once the shards are copied off the devices, the files are
            written in the background: call ``wait_until_finished()``.
        overwrite: replace an existing checkpoint at ``path``, atomically: the
            new one is written beside it and swapped in by ``wait_until_finished()``
            (with ``blocking=False``, call it, or the new checkpoint stays under
            ``path + '.einshard-next'``).

    Returns:
        A :class:`Saving` handle.
    """
    ocp = _orbax()
    target = pathlib.Path(os.fspath(path)).absolute()
    extra = dict(meta or {})
    clash = sorted(set(extra) & set(_RESERVED))
    if clash:
        raise EinshardError(f"meta keys {clash} are reserved for the checkpoint's own header {list(_RESERVED)}")
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
        raise EinshardError(f"save({os.fspath(path)!r}): the tree has no leaves to save")
    texts = _leaf_expressions(tree, expressions, leaves, treedef)
    meshes: list[dict[str, Any]] = []
    described = []
    for (p, leaf), text in zip(leaves, texts):
        key = jax.tree_util.keystr(p)
        sh = getattr(leaf, "sharding", None)
        mesh_index = None
        if isinstance(leaf, jax.Array) and isinstance(sh, NamedSharding):
            record = _mesh_record(sh.mesh)
            if record not in meshes:
                meshes.append(record)
            mesh_index = meshes.index(record)
        described.append(
            {
                "path": key,
                "expression": _saved_expression(key, leaf, text),
                "shape": list(np.shape(leaf)),
                "dtype": str(np.result_type(leaf) if not hasattr(leaf, "dtype") else leaf.dtype),
                "mesh": mesh_index,
                **_keys.record(leaf),
            }
        )
    # "checksums" says the save writes its checksums file, so a checkpoint that lacks it is refused
    # (one written before einshard stored checksums has no such key, and restores unverified).
    header = {"format": FORMAT, "leaves": described, "meshes": meshes, "checksums": _integrity.MANIFEST, **extra}
    try:
        json.dumps(header)
    except (TypeError, ValueError) as err:
        raise EinshardError(f"save({os.fspath(path)!r}): meta must be JSON-serialisable: {err}") from None
    keys = [str(e["path"]) for e in described]
    _refuse_colliding_names(keys, [p for p, _ in leaves])
    _check_processes_agree(target, header)
    # Typed PRNG keys are written as their key data (_keys): orbax and the checksums see plain uint32 words.
    values = [_keys.stored(leaf) for _, leaf in leaves]
    tree = jax.tree_util.tree_unflatten(treedef, values)
    return _start_save(ocp, target, tree, header, values, keys, overwrite, blocking)


def _start_save(
    ocp: ModuleType,
    target: pathlib.Path,
    tree: Any,
    header: dict[str, Any],
    values: list[Any],
    keys: list[str],
    overwrite: bool,
    blocking: bool,
) -> Saving:
    """Take the path's lock, stage the checkpoint with orbax; the handle finishes it (checksums, rename, unlock)."""
    lead = jax.process_index() == 0
    staged = _guard.sibling(target, _guard.NEXT)
    started_with = set(threading.enumerate())
    lock: _guard.WriterLock | None = None
    failure = ""
    if lead:  # one process takes the lock and tidies; the others learn how that went
        try:
            lock = _guard.acquire(target)
            _guard.recover(target)
            if target.exists() and not overwrite:
                raise EinshardError(
                    f"a checkpoint already exists at {os.fspath(target)!r}",
                    hint="Save each step to its own directory, or pass overwrite=True to replace it atomically.",
                )
        except (EinshardError, OSError) as err:
            if lock is not None:
                lock.release()
                lock = None
            failure = str(err) if isinstance(err, EinshardError) else str(_write_error(target, err))
    verdicts = exchange("checkpoint-lock", failure, f"the start of the save to {os.fspath(target)!r}")
    if verdicts[0]:
        raise EinshardError(verdicts[0] if lead else f"process 0 refused the save: {verdicts[0]}")

    held = [lock] if lock is not None else []  # released once, by whichever path ends the save

    def unlock() -> None:
        while held:
            held.pop().release()

    def abandon(err: BaseException) -> BaseException:
        """Clean up after a failed save: what to raise (an interrupt stays an interrupt)."""
        try:
            _join_orbax_threads(started_with, deadline_s=10.0)
            if lead:
                _guard.remove_staging(target, settle_s=0.3)
        finally:
            unlock()
        return _write_error(target, err) if isinstance(err, Exception) else err

    # Directories made before save() returns, not by a background task that could outlive a failed save
    # and re-create the staging directory after it was removed.
    checkpointer = ocp.StandardCheckpointer(async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    try:
        digests = _integrity.start_digests(values)
        with _ORBAX_TURN:
            checkpointer.save(staged, tree, custom_metadata={"einshard": header})
    except BaseException as err:
        _drain(checkpointer)
        raise abandon(err) from None

    def finish(saving: Any) -> None:
        try:
            with _ORBAX_TURN:
                saving.wait_until_finished()
                saving.close()
            written = dict(zip(keys, _integrity.finish_digests(digests)))
            _sync(f"the end of the save to {os.fspath(target)!r}")
        except BaseException as err:
            _drain(saving)
            raise abandon(err) from None
        failure = ""
        try:
            if lead:  # the last steps, on process 0 alone; the others learn how they went
                try:
                    _integrity.write_manifest(staged, written)
                    _guard.swap_in(staged, target)
                except BaseException as err:
                    outcome = abandon(err)
                    if not isinstance(err, Exception):
                        raise  # an interrupt: cleaned up, and the other processes name this one after their wait
                    failure = str(outcome)
            verdicts = exchange("checkpoint-swap", failure, f"the swap of the save to {os.fspath(target)!r}")
        finally:
            unlock()
        if verdicts[0]:
            raise EinshardError(verdicts[0] if lead else f"process 0 could not finish the save: {verdicts[0]}")

    handle = Saving(target, checkpointer, finish)
    if blocking:
        handle.wait_until_finished()
    return handle


# ---------------------------------------------------------------------------
# Reading


def _locate(path: str | os.PathLike[str]) -> pathlib.Path:
    """The checkpoint to read: ``path``, or the previous one an interrupted overwrite left aside."""
    target = pathlib.Path(os.fspath(path)).absolute()
    if target.exists():
        return target
    previous = target.with_name(target.name + _PREVIOUS)
    if previous.is_dir():
        return previous
    raise EinshardError(f"there is no checkpoint at {os.fspath(path)!r} (no such file or directory)")


def _tidy(path: str | os.PathLike[str]) -> None:
    """Recover or remove what an interrupted save left beside ``path``, unless a writer is at work on it now."""
    target = pathlib.Path(os.fspath(path)).absolute()
    if not _guard.has_leftovers(target):
        return
    lock = _guard.try_acquire(target)
    if lock is None:
        return
    try:
        _guard.recover(target)
    except OSError:
        pass  # read what is there; the next save tidies under its own lock
    finally:
        lock.release()


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's header: format, leaves (path, expression, shape, dtype, mesh), meshes and the caller's meta."""
    where = _locate(path)
    if where.is_file():
        return npz_header(where)
    if "orbax-checkpoint-tmp" in where.name or not (where / "_CHECKPOINT_METADATA").is_file():
        raise EinshardError(
            f"{os.fspath(where)!r} is not a complete einshard checkpoint (no _CHECKPOINT_METADATA: "
            "an interrupted save, or another kind of directory)"
        )
    try:
        json.loads((where / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError) as err:
        raise EinshardError(f"{os.fspath(where)!r}: the checkpoint's metadata file is damaged: {err}") from None
    ocp = _orbax()
    try:
        custom = ocp.StandardCheckpointer().metadata(where).custom_metadata or {}
    except (ValueError, OSError, KeyError, TypeError) as err:
        raise EinshardError(f"{os.fspath(where)!r}: cannot read the checkpoint's metadata: {err}") from None
    header = custom.get("einshard")
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise EinshardError(
            f"{os.fspath(where)!r} is an orbax checkpoint without an einshard header (format {FORMAT!r})",
            hint="Restore it with orbax directly, or save it with einshard.checkpoint.save.",
        )
    return header


def _show_paths(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _match(where: pathlib.Path, header: dict[str, Any], like: Any) -> tuple[list[dict[str, Any]], Any, list[Any]]:
    """(saved entry of each leaf of ``like``, its treedef, its leaves), or an error naming the differing paths."""
    saved = {leaf["path"]: leaf for leaf in header["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    keys = [jax.tree_util.keystr(p) for p, _ in flat]
    missing = [k for k in keys if k not in saved]
    extra = [k for k in saved if k not in set(keys)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"the checkpoint has no leaf {_show_paths(missing)}")
        if extra:
            parts.append(f"it holds {_show_paths(extra)}, which the target tree lacks")
        raise EinshardError(
            f"checkpoint {os.fspath(where)!r} does not fit the target tree: " + "; ".join(parts),
            hint="Restore with like= of the structure that was saved (read_meta(path)['leaves'] lists its paths).",
        )
    for key, (_, leaf) in zip(keys, flat):
        want, got = tuple(saved[key]["shape"]), tuple(np.shape(leaf))
        if want != got:
            raise EinshardError(f"checkpoint leaf {key} has shape {want}, but the target tree expects {got}")
    return [saved[k] for k in keys], treedef, [leaf for _, leaf in flat]


def _saved_mesh(record: dict[str, Any], key: str) -> Mesh:
    """The saved mesh's shape, names and axis types, rebuilt on this run's devices."""
    names = tuple(a[0] for a in record["axes"])
    sizes = tuple(int(a[1]) for a in record["axes"])
    if math.prod(sizes) != jax.device_count():
        shown = ", ".join(f"{n!r}: {s}" for n, s in zip(names, sizes))
        raise EinshardError(
            f"leaf {key} was saved on the mesh ({shown}) of {math.prod(sizes)} devices, but this run has "
            f"{jax.device_count()}",
            hint="Pass mesh= (or restore inside `with jax.set_mesh(mesh):`) to lay it out on another mesh.",
        )
    types = tuple(getattr(AxisType, a[2]) for a in record["axes"])
    return jax.make_mesh(sizes, names, axis_types=types)


def _like_sharding(leaf: Any) -> jax.sharding.Sharding | None:
    """The sharding a ``like`` leaf asks for: a jax.Array's, or a ShapeDtypeStruct's ``sharding=``."""
    sh = getattr(leaf, "sharding", None) if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) else None
    return sh if isinstance(sh, jax.sharding.Sharding) else None


def _targets(
    entries: list[dict[str, Any]],
    meshes: list[dict[str, Any]],
    texts: list[str | None],
    like_leaves: list[Any],
    mesh: Mesh | None,
) -> list[jax.sharding.Sharding]:
    """The sharding of each leaf: a new expression, else the ``like`` leaf's sharding, else the saved expression.

    Expressions are read on ``mesh``, else the current mesh, else the leaf's saved mesh shape rebuilt here.
    """
    given = mesh if mesh is not None else current_concrete_mesh()
    rebuilt: dict[int, Mesh] = {}
    out: list[jax.sharding.Sharding] = []
    for entry, text, leaf in zip(entries, texts, like_leaves):
        key, shape = entry["path"], tuple(entry["shape"])
        own = _like_sharding(leaf) if text is None else None
        if own is not None:
            out.append(own)
            continue
        expression = text or entry["expression"]
        on = given
        index = entry.get("mesh")
        if on is None and index is not None and not meshes[index].get("anonymous"):
            if index not in rebuilt:
                rebuilt[index] = _saved_mesh(meshes[index], key)
            on = rebuilt[index]
        try:
            out.append(sharding(expression, shape, mesh=on))
        except EinshardError as err:
            raise EinshardError(
                f"at {key} (shape {shape}): {err.reason}", err.expression, err.column, err.hint
            ) from None
    return out


def restore(
    path: str | os.PathLike[str],
    like: Any = None,
    *,
    expressions: Any = None,
    mesh: Mesh | None = None,
    verify: bool = True,
) -> Any:
    """Read a checkpoint, every leaf laid out by its einshard expression.

    Under ``jax.distributed`` every process calls it; each reads only the
    chunks its own devices hold.

    Args:
        path: a checkpoint directory written by :func:`save` (or an ``.npz`` of the format before).
        like: the tree to restore into (arrays or ``jax.ShapeDtypeStruct``; leaves
            matched by path, shapes must agree; a dtype other than the saved
            one is cast to).  A leaf that carries a sharding (a jax.Array, or a
            ``ShapeDtypeStruct(..., sharding=)``) is restored with it unless
            ``expressions`` names a layout for it.  Default: the saved tree as nested dicts.
        expressions: new layouts: one expression, rules as ``einshard()`` takes
            them (a rule of None keeps the saved expression), or a tree of them
            like ``like``.  Default: the expressions saved with each leaf.
        mesh: the mesh for ``@`` expressions; default: the current mesh
            (``jax.set_mesh``), else the saved mesh's shape over this run's devices.
        verify: check every stored file (size, sha256) before reading and every
            leaf's values after (default); False skips both (trusted storage, a
            faster restore).  Checkpoints written before einshard stored
            checksums restore without them.
    """
    if not isinstance(verify, bool):
        raise EinshardError(f"restore(verify={verify!r}): verify must be True or False")
    if jax.process_index() == 0:
        _tidy(path)
    if jax.process_count() > 1:
        _sync(f"the restore of {os.fspath(path)!r}")
    where = _locate(path)
    header = read_meta(where)
    if like is None:
        like = _nested({e["path"]: e for e in header["leaves"]}, where)
    entries, treedef, like_leaves = _match(where, header, like)
    texts = _restore_texts(like, treedef, expressions, len(entries))
    if header["format"] == NPZ_FORMAT:
        return restore_npz(where, entries, treedef, texts, like_leaves, mesh)
    shardings = _targets(entries, header.get("meshes", []), texts, like_leaves, mesh)
    manifest = _integrity.read_manifest(where) if verify else None
    if verify and manifest is None and "checksums" in header:
        raise EinshardError(
            f"checkpoint {os.fspath(where)!r} was written with checksums, but its checksums file "
            f"{_integrity.MANIFEST!r} is missing: it is incomplete or was tampered with",
            hint="restore(..., verify=False) reads it unchecked.",
        )
    if manifest is not None:
        damaged = _integrity.damaged_files(where, manifest)
        if damaged:
            leaves = _damaged_leaves(where, entries, treedef, shardings, manifest)
            raise EinshardError(
                f"checkpoint {os.fspath(where)!r} is damaged: {_show_paths(damaged)} "
                f"({len(damaged)} of {len(manifest['files'])} files differ from the checksums written with it); "
                f"{leaves}",
                hint="Restore an earlier checkpoint; a damaged one is never read as if it were whole.",
            )
    # Read in the saved dtype (the digests are of the saved bits), cast to like's dtype after checking.
    saved = _read_arrays(where, entries, treedef, shardings)
    if manifest is not None:
        wrong = _wrong_leaves(entries, saved, manifest)
        if wrong:
            raise EinshardError(
                f"checkpoint {os.fspath(where)!r}: the values of {_show_paths(wrong)} differ from the checksums "
                "written with them (the files match theirs: the data changed as it was read)"
            )
    out = []
    for leaf, value in zip(like_leaves, _keys_restored(where, entries, like_leaves, saved)):
        want = getattr(leaf, "dtype", None)
        if want is None or _keys.is_typed_key(value) or want == value.dtype:
            out.append(value)
        else:
            out.append(value.astype(want))
    return jax.tree_util.tree_unflatten(treedef, out)


def _keys_restored(
    where: pathlib.Path, entries: list[dict[str, Any]], like_leaves: list[Any], saved: list[Any]
) -> list[Any]:
    """The read values with saved typed keys wrapped again; a key saved where ``like`` wants numbers (or the
    reverse) is an error naming the leaf, never a silent reinterpretation of its bits."""
    for entry, leaf in zip(entries, like_leaves):
        was_key, wants_key = _keys.KEY_IMPL in entry, _keys.is_typed_key(leaf)
        if getattr(leaf, "dtype", None) is not None and was_key != wants_key:
            saved_as = f"a PRNG key ({entry['dtype']})" if was_key else f"an array of {entry['dtype']}"
            raise EinshardError(
                f"checkpoint {os.fspath(where)!r}: leaf {entry['path']} was saved as {saved_as}, but like= has "
                f"{leaf.dtype} there",
                hint="Restore a typed key into a typed key (jax.random.key); use jax.random.key_data / wrap_key_data "
                "to convert between keys and their uint32 data.",
            )
    return [_keys.restored(e, v) for e, v in zip(entries, saved)]


def _read_arrays(
    where: pathlib.Path, entries: list[dict[str, Any]], treedef: Any, shardings: list[jax.sharding.Sharding]
) -> list[jax.Array]:
    """Every leaf read by orbax in its saved dtype and the given layout (each process reads only its chunks)."""
    target = [
        _keys.stored_struct(e, sh) or jax.ShapeDtypeStruct(tuple(e["shape"]), np.dtype(e["dtype"]), sharding=sh)
        for e, sh in zip(entries, shardings)
    ]
    ocp = _orbax()
    with _ORBAX_TURN:
        checkpointer = ocp.StandardCheckpointer()
        try:
            out = checkpointer.restore(where, jax.tree_util.tree_unflatten(treedef, target))
        except Exception as err:  # orbax and tensorstore raise bare Exceptions for unreadable data
            raise EinshardError(
                f"cannot restore the checkpoint at {os.fspath(where)!r}, its files are damaged or incomplete: "
                f"{_first_lines(err)}"
            ) from None
        finally:
            checkpointer.close()
    return list(treedef.flatten_up_to(out))


def _wrong_leaves(entries: list[dict[str, Any]], values: list[Any], manifest: dict[str, Any]) -> list[str]:
    got = _integrity.finish_digests(_integrity.start_digests(values))
    stored = manifest["leaves"]
    return [e["path"] for e, d in zip(entries, got) if stored.get(e["path"]) not in (None, d) and d is not None]


def _damaged_leaves(
    where: pathlib.Path,
    entries: list[dict[str, Any]],
    treedef: Any,
    shardings: list[jax.sharding.Sharding],
    manifest: dict[str, Any],
) -> str:
    """Which leaves the damage reaches (read anyway, for the error message only)."""
    try:
        wrong = _wrong_leaves(entries, _read_arrays(where, entries, treedef, shardings), manifest)
    except EinshardError:
        return "the damage makes the array data unreadable"
    except Exception:  # anything the damaged files make orbax raise: the files are already named
        return "the damage makes the checkpoint unreadable"
    if wrong:
        return f"the values of {_show_paths(wrong)} read from them are wrong"
    return "the values read from them still match their checksums (the damage is outside the array values)"


def _first_lines(err: BaseException) -> str:
    """The gist of an orbax/tensorstore error (whose full text repeats whole TensorStore specs)."""
    root = err.__cause__ if err.__cause__ is not None else err  # the tensorstore error names the file and leaf
    text = str(root).split("\n", 1)[0]
    return text if len(text) <= 500 else text[:500] + "..."


def _restore_texts(like: Any, treedef: Any, expressions: Any, n: int) -> list[str | None]:
    if expressions is None:
        return [None] * n
    if _is_expression_tree(expressions, treedef):
        return list(treedef.flatten_up_to(expressions))
    return list(leaf_expressions(like, expressions))


def _nested(saved: dict[str, dict[str, Any]], where: pathlib.Path) -> Any:
    """The saved tree as nested dicts of ShapeDtypeStructs (when no ``like`` is given), keyed as saved."""
    root: dict[str, Any] = {}
    for key, entry in saved.items():
        parts = _dict_keys(key)
        if parts is None:
            raise EinshardError(
                f"checkpoint {os.fspath(where)!r}: leaf {key} is not a path of dict keys; pass like= with its structure"
            )
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if _keys.KEY_IMPL in entry:
            node[parts[-1]] = _keys.key_struct(entry)
        else:
            node[parts[-1]] = jax.ShapeDtypeStruct(tuple(entry["shape"]), np.dtype(entry["dtype"]))
    return root


def _dict_keys(key: str) -> list[str] | None:
    """``"['a']['b']"`` -> ``['a', 'b']``; None for paths with other kinds of keys."""
    import ast

    if not key.startswith("[") or not key.endswith("]"):
        return None
    try:
        parts = [ast.literal_eval(p) for p in key[1:-1].split("][")]
    except (ValueError, SyntaxError):
        return None
    return parts if all(isinstance(p, str) for p in parts) else None
