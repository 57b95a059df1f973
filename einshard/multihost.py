"""Settings of the agreement checks between the processes of a ``jax.distributed`` run (docs/multihost.md)."""

from ._src.multihost import peer_timeout, set_peer_timeout, unchecked

__all__ = ["peer_timeout", "set_peer_timeout", "unchecked"]
