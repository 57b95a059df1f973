"""The command line, run as a user runs it (subprocess)."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses: CI runs these with -m slow


def _run(*args: str, devices: int = 8) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run(
        [sys.executable, "-m", "einshard", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_help_teaches_the_syntax():
    out = _run("--help")
    assert out.returncode == 0
    assert "x y -> x y@model" in out.stdout and "demo" in out.stdout


def test_no_command_is_an_error():
    assert _run().returncode == 2


def test_help_lists_the_commands():
    out = _run("--help")
    assert "demo" in out.stdout and "show" in out.stdout


def test_demo_bad_mesh_is_a_clear_error():
    out = _run("demo", "--mesh", "data=3,model=2")
    assert out.returncode == 2
    assert "--mesh" in out.stderr and "6 devices" in out.stderr
