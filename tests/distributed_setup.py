"""Start one process of a real multi-process run on this machine (simulated CPU devices, gloo), for test workers.

Call before anything imports JAX: the device count must be in XLA_FLAGS when the backend starts.
"""

from __future__ import annotations

import os
from typing import Any


def start(port: int, num_processes: int, process_id: int, local_devices: int, timeout: int = 60) -> Any:
    """Simulate ``local_devices`` CPU devices, join the run on 127.0.0.1:``port``, and return the jax module."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={local_devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"

    import jax

    # gloo is already the default CPU collectives in jax 0.10 and 0.12; say so explicitly
    # (without it cross-process computations have no transport).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout,
    )
    return jax
