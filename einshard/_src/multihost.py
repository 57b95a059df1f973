"""Settings of the agreement checks between the processes of a ``jax.distributed`` run.

Under several processes, ``einshard(x, expr)`` (with ``process_local`` True
or False) and ``einshard.checkpoint.save`` first check that every process
passes the same leaf paths, shapes, dtypes, expressions and mesh (one small
exchange through the distributed runtime's key-value store), and a process
that does not arrive within :func:`peer_timeout` seconds is named in an
``EinshardError``.

* :func:`set_peer_timeout` — how long to wait for the other processes.
* :func:`unchecked` — a context manager that skips the placement check
  (every process must skip the same calls), for a hot loop.
"""

from ._placement.agreement import peer_timeout, set_peer_timeout, unchecked

__all__ = ["peer_timeout", "set_peer_timeout", "unchecked"]
