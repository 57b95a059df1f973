"""Agreement between the processes of a ``jax.distributed`` run, in bounded time.

Multi-process placement and checkpoint saves exchange a short description of
what each process is about to do (leaf paths, shapes, dtypes, expressions,
mesh) through the distributed runtime's key-value store, before any data
move: one small round trip, no device collective.  A process that differs is
named, on every process; a process that does not arrive within the peer
timeout is named too (a wait on the store ends; a device collective with a
dead peer would not).

Every process must make the same sequence of checked calls (as with any
collective): each call of a kind gets the next number of that kind.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..core.mesh import MeshLike, current_concrete_mesh
from ..errors import EinshardError

_DEFAULT_TIMEOUT_S = 60.0
_timeout_s = _DEFAULT_TIMEOUT_S
_checked: contextvars.ContextVar[bool] = contextvars.ContextVar("einshard_agreement_checked", default=True)
_counters: dict[str, Iterator[int]] = {}
_counters_lock = threading.Lock()


def set_peer_timeout(seconds: float) -> None:
    """How long a process waits for the others (agreement checks, checkpoint saves) before an EinshardError."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds <= 0:
        raise EinshardError(f"set_peer_timeout(seconds={seconds!r}): seconds must be a finite number > 0")
    global _timeout_s
    _timeout_s = float(seconds)


def peer_timeout() -> float:
    """The seconds a process waits for the others (default 60; :func:`set_peer_timeout` changes it)."""
    return _timeout_s


@contextlib.contextmanager
def unchecked() -> Iterator[None]:
    """Skip the agreement check of multi-process placement inside the block (a hot loop whose inputs you trust).

    Every process must skip the same calls (a process that checks waits for
    the others, and names them after the peer timeout).  Checkpoint saves are
    always checked.
    """
    token = _checked.set(False)
    try:
        yield
    finally:
        _checked.reset(token)


def checking() -> bool:
    """Whether placement checks agreement here: several processes, and not inside :func:`unchecked`."""
    return jax.process_count() > 1 and _checked.get()


def _client() -> Any:
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise EinshardError("several processes but no jax.distributed client: call jax.distributed.initialize() first")
    return client


def _next(kind: str) -> int:
    with _counters_lock:
        counter = _counters.setdefault(kind, itertools.count())
        return next(counter)


def exchange(kind: str, value: str, what: str) -> list[str]:
    """Every process's ``value`` for this call of ``kind`` (index = process), or an EinshardError naming the absent.

    ``what`` says what the processes are doing, for the error.
    """
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return [value]
    client = _client()
    seq = _next(kind)
    base = f"einshard/{kind}/{seq}"
    client.key_value_set(f"{base}/{me}", value, allow_overwrite=True)
    deadline = time.monotonic() + _timeout_s
    out: list[str] = []
    for p in range(n):
        if p == me:
            out.append(value)
            continue
        wait_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            out.append(str(client.blocking_key_value_get(f"{base}/{p}", wait_ms)))
        except Exception:  # the runtime's DEADLINE_EXCEEDED (or its connection to a dead coordinator)
            absent = [q for q in range(n) if q != me and not _present(client, f"{base}/{q}")]
            raise EinshardError(
                f"process {me} waited {_timeout_s:g} s for process{'es' if len(absent) > 1 else ''} "
                f"{', '.join(map(str, absent or [p]))} to reach {what} (call {seq} of its kind); "
                "it did not arrive: it died, hangs, or runs a different sequence of einshard calls",
                hint="einshard.multihost.set_peer_timeout(seconds) sets this wait.",
            ) from None
    if seq > 0:
        # Everyone has set this round's key, so everyone has read the round before: drop ours of it.
        with contextlib.suppress(Exception):
            client.key_value_delete(f"einshard/{kind}/{seq - 1}/{me}")
    return out


def absent_processes(wait_s: float) -> list[int]:
    """After a failed collective: the processes that do not answer within ``wait_s`` (every live one calls this)."""
    n, me = jax.process_count(), jax.process_index()
    if n == 1:
        return []
    try:
        client = _client()
        base = f"einshard/alive/{_next('alive')}"
        client.key_value_set(f"{base}/{me}", "", allow_overwrite=True)
    except Exception:  # the runtime itself is gone
        return [p for p in range(n) if p != me]
    deadline = time.monotonic() + wait_s
    absent = []
    for p in range(n):
        if p == me:
            continue
        try:
            client.blocking_key_value_get(f"{base}/{p}", max(1, int((deadline - time.monotonic()) * 1000)))
        except Exception:
            absent.append(p)
    return absent


def _present(client: Any, key: str) -> bool:
    try:
        client.key_value_try_get(key)
    except Exception:
        return False
    return True


def agree(kind: str, record: Any, what: str, describe_difference: Callable[[Any, Any], str]) -> None:
    """Refuse, on every process, unless every process passes an equal ``record`` (JSON-able).

    ``describe_difference(mine, theirs)`` says how two records differ (for the error).
    """
    text = json.dumps(record, sort_keys=True)
    values = exchange(kind, text, what)
    me = jax.process_index()
    differing = [p for p, v in enumerate(values) if v != values[0]]
    if not differing:
        return
    first = differing[0]
    detail = describe_difference(json.loads(values[0]), json.loads(values[first]))
    raise EinshardError(
        f"the processes disagree on {what}: process 0 and process {first} differ: {detail}"
        + (f" (this is process {me})" if me not in (0, first) else ""),
        hint="Every process must make the same call with the same shapes, dtypes and expressions.",
    )


def first_difference(a: Sequence[Any], b: Sequence[Any], label: Callable[[Any], str]) -> str:
    """The first entry where two lists of records differ, shown with ``label``."""
    for x, y in zip(a, b):
        if x != y:
            return f"{label(x)} against {label(y)}"
    if len(a) != len(b):
        return f"{len(a)} entries against {len(b)}"
    return "their records differ"


# ---------------------------------------------------------------------------
# Placement of host data under several processes


def _leaf_record(path: str, leaf: Any, text: str) -> dict[str, Any]:
    try:
        dtype = str(leaf.dtype) if hasattr(leaf, "dtype") else str(np.result_type(leaf))
    except (TypeError, ValueError):
        dtype = type(leaf).__name__
    return {"path": path, "shape": [int(d) for d in np.shape(leaf)], "dtype": dtype, "expression": text}


def _mesh_record(mesh: MeshLike | None) -> Any:
    if mesh is None:
        mesh = current_concrete_mesh()
    if mesh is None:
        return None
    shape = getattr(mesh, "shape", None)
    if not isinstance(shape, Mapping):
        return repr(mesh)
    types = [getattr(t, "name", str(t)) for t in getattr(mesh, "axis_types", ())] or [None] * len(shape)
    return [[str(name), int(size), kind] for (name, size), kind in zip(shape.items(), types)]


def check_placement(x: Any, rules: Any, mesh: MeshLike | None, process_local: bool) -> None:
    """Every process places the same paths, shapes, dtypes and expressions on the same mesh (one exchange).

    With ``process_local=True`` the shapes compared are the process-local
    slices, which must be equal; with False, the global arrays.
    """
    from ..tree_rules import leaf_expressions

    if isinstance(rules, str) and not isinstance(rules, Mapping) and _is_leaf_array(x):
        records = [_leaf_record("", x, rules)]
    else:
        flat, _ = jax.tree_util.tree_flatten_with_path(x)
        texts = leaf_expressions(x, rules)
        records = [
            _leaf_record(jax.tree_util.keystr(p), leaf, text)
            for (p, leaf), text in zip(flat, texts)
            if text is not None
        ]
    record = {"process_local": process_local, "mesh": _mesh_record(mesh), "leaves": records}
    kind = "process-local" if process_local else "global"

    def differ(a: dict[str, Any], b: dict[str, Any]) -> str:
        if a["mesh"] != b["mesh"]:
            return f"mesh {a['mesh']} against {b['mesh']}"
        if a["process_local"] != b["process_local"]:
            return f"process_local={a['process_local']} against {b['process_local']}"
        return first_difference(
            a["leaves"],
            b["leaves"],
            lambda e: f"{e['path'] or 'the array'}: shape {tuple(e['shape'])} {e['dtype']} {e['expression']!r}",
        )

    agree("placement", record, f"the {kind} data to place", differ)


def _is_leaf_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))
