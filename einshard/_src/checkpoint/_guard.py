"""One writer per checkpoint path, and the recovery of what an interrupted save or swap left behind.

Every save stages the new checkpoint in ``PATH.einshard-next`` and renames it
to ``PATH`` once it is complete (``overwrite=True``: the old one is first set
aside as ``PATH.einshard-previous``, then removed).  While it does, it holds an
exclusive ``flock`` on ``PATH.einshard-lock``, which names its owner (pid,
host, thread).  The kernel drops the lock when the owner dies (kill -9
included), so a lock is never stale, and a second writer (another thread of
this process, or another process) is refused at once, never queued.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import json
import os
import pathlib
import shutil
import socket
import threading
import time
from dataclasses import dataclass

from ..errors import EinshardError
from ._integrity import is_complete

NEXT = ".einshard-next"
PREVIOUS = ".einshard-previous"
LOCK = ".einshard-lock"


def sibling(path: pathlib.Path, suffix: str) -> pathlib.Path:
    return path.with_name(path.name + suffix)


@dataclass(frozen=True)
class WriterLock:
    """The exclusive right to write ``path`` (an open, flock-ed lock file)."""

    path: pathlib.Path
    fd: int

    def release(self) -> None:
        # Unlink before unlocking: a writer that opened the old file then finds it gone (inode check) and retries.
        try:
            os.unlink(sibling(self.path, LOCK))
        except FileNotFoundError:
            pass
        os.close(self.fd)


def _owner_text() -> str:
    return json.dumps(
        {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "thread": threading.current_thread().name,
            "since": time.time(),
        }
    )


def _describe_owner(lock_file: pathlib.Path) -> str:
    try:
        owner = json.loads(lock_file.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(owner["since"])))
        same = owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()
        where = f"thread {owner.get('thread')!r} of this process" if same else f"process {owner.get('pid')}"
        return f"{where} on host {owner.get('host')!r}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another writer (its lock file names no owner yet)"


def _open_locked(lock_file: pathlib.Path) -> int | None:
    """An open descriptor holding the exclusive flock on ``lock_file``, or None if another writer holds it."""
    for _ in range(100):  # a release between our open and flock replaces the file: retry on the new one
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return None
            raise
        try:
            same = os.stat(lock_file).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
    raise EinshardError(f"cannot take the lock {os.fspath(lock_file)!r}: it keeps being replaced")


def acquire(path: pathlib.Path) -> WriterLock:
    """The writer lock on ``path``, or an EinshardError naming the writer that holds it (never waits)."""
    lock_file = sibling(path, LOCK)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_locked(lock_file)
    except OSError as err:
        raise EinshardError(f"cannot create the lock file {os.fspath(lock_file)!r}: {err}") from None
    if fd is None:
        raise EinshardError(
            f"another save is writing the checkpoint at {os.fspath(path)!r}: {_describe_owner(lock_file)} "
            f"holds {os.fspath(lock_file)!r}",
            hint="One writer per path: wait for that save to finish, or save to another path.",
        )
    os.ftruncate(fd, 0)
    os.write(fd, _owner_text().encode())
    return WriterLock(path, fd)


def try_acquire(path: pathlib.Path) -> WriterLock | None:
    """The writer lock if nobody writes ``path`` now, else None (for a reader's clean-up)."""
    try:
        fd = _open_locked(sibling(path, LOCK))
    except (OSError, EinshardError):
        return None
    return None if fd is None else WriterLock(path, fd)


def _remove(path: pathlib.Path) -> None:
    """Remove a directory tree, or a file or link in its place (what a careless caller left at the path)."""
    if path.is_symlink() or path.is_file():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def has_leftovers(path: pathlib.Path) -> bool:
    """Whether anything a save leaves beside ``path`` while it runs is there (staging, set aside, a lock file)."""
    return any(path.parent.glob(glob.escape(path.name) + ".einshard-*"))


def remove_staging(path: pathlib.Path, settle_s: float = 0.0) -> None:
    """Remove ``PATH.einshard-next`` and orbax's temporary directories for it (the caller holds the lock).

    ``settle_s`` > 0: after a failed save, remove again whatever a straggling
    background write re-creates, until nothing has come back for that long (at most 5 s).
    """
    staged = sibling(path, NEXT)
    end = time.monotonic() + 5.0
    quiet_since = time.monotonic()
    while True:
        leftovers = [staged, *path.parent.glob(f"{glob.escape(staged.name)}.orbax-checkpoint-tmp*")]
        if any(p.exists() for p in leftovers):
            quiet_since = time.monotonic()
        for leftover in leftovers:
            _remove(leftover)
        now = time.monotonic()
        if settle_s <= 0 or now - quiet_since >= settle_s or now >= end:
            return
        time.sleep(0.02)


def recover(path: pathlib.Path) -> None:
    """Put right what an interrupted save or swap left beside ``path`` (the caller holds the lock).

    The swap is: ``PATH -> PATH.einshard-previous``, ``PATH.einshard-next -> PATH``,
    remove ``PATH.einshard-previous``.  Interrupted after the first rename, the
    new checkpoint is complete in ``.einshard-next`` (its checksums file is
    written last): it is renamed in.  If it is not complete, the previous one
    goes back.  With ``PATH`` in place, what is set aside or staged is stale.
    """
    previous, staged = sibling(path, PREVIOUS), sibling(path, NEXT)
    if not path.exists():
        if staged.is_dir() and is_complete(staged):
            os.rename(staged, path)  # interrupted between the swap's two renames, or just before the last one
        elif previous.is_dir():
            os.rename(previous, path)
    _remove(previous)
    remove_staging(path)


def swap_in(staged: pathlib.Path, path: pathlib.Path) -> None:
    """Make the complete checkpoint at ``staged`` the one at ``path`` (the caller holds the lock)."""
    previous = sibling(path, PREVIOUS)
    if path.exists() or path.is_symlink():
        _remove(previous)
        os.rename(path, previous)
    os.rename(staged, path)
    _remove(previous)
