"""The command line, run as a user runs it (subprocess)."""

import os
import subprocess
import sys

import pytest


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


@pytest.fixture(scope="module")
def demo_output() -> subprocess.CompletedProcess[str]:
    return _run("demo")


def test_demo_runs_every_layout_and_matches_single_device(demo_output):
    assert demo_output.returncode == 0, demo_output.stderr
    text = demo_output.stdout
    for name in ("dp", "tp", "hybrid", "einshard02"):
        assert f"== {name}:" in text
    assert text.count("result equals the single-device forward pass: yes") == 4
    assert "[x:128 y:256@model]" in text  # hybrid W1 in the user's axis names


def test_demo_bad_mesh_is_a_clear_error():
    out = _run("demo", "--mesh", "data=3,model=2")
    assert out.returncode == 2
    assert "--mesh" in out.stderr and "6 devices" in out.stderr
