"""Run a test on another number of simulated devices, in a subprocess.

JAX fixes the device count when it starts, so a test that needs N devices
calls ``rerun_on(N, request)``: on N devices it returns False and the test
goes on; otherwise it runs that same test in a fresh pytest process with
``--xla_force_host_platform_device_count=N`` (the root conftest keeps a count
the caller set), asserts that it passed, and returns True.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def device_env(n: int, **extra: str) -> dict[str, str]:
    """The environment of a child process that sees ``n`` simulated CPU devices."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={n}".strip())
    env.update(extra)
    return env


def run_pytest(n: int, *args: str, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run pytest with ``args`` on ``n`` devices; fail with its output unless it passes."""
    # The parent chose what runs: the child takes every marker (the default run leaves 'slow' tests out).
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:randomly",
        "-m",
        "slow or not slow",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=device_env(n, **extra), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"on {n} devices: {' '.join(args)}\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert " passed" in proc.stdout, proc.stdout[-2000:]
    return proc


def rerun_on(n: int, request) -> bool:  # type: ignore[no-untyped-def]
    """True if the test was run (and passed) in a subprocess on ``n`` devices; False if this process has ``n``."""
    if jax.device_count() == n:
        return False
    run_pytest(n, request.node.nodeid)
    return True
