"""``einshard analyze`` through a real subprocess (``python -m einshard``)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses: CI runs these with -m slow

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXPR = "b x@data, x y@model -> b y"
ARGS = ["--mesh", "data=4,model=2", "--sizes", "b=1024,x=4096,y=16384", "--dtype", "bf16", "--profile", "h100"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
    )
    return subprocess.run(
        [sys.executable, "-m", "einshard", "analyze", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_explain_prints_the_plan_plain_and_rich():
    plain = run(EXPR, *ARGS, "--plain")
    assert plain.returncode == 0, plain.stderr
    for word in ("strategy", "2-D TP", "all-reduce", "bf16[1024,4096@data]", "alternatives", "h100"):
        assert word in plain.stdout
    fancy = run(EXPR, *ARGS)  # rich when installed, plain otherwise: the same facts either way
    assert fancy.returncode == 0, fancy.stderr
    for word in ("all-reduce", "bf16[4096,16384@model]", "[slice op2]"):
        assert word in fancy.stdout


def test_explain_json():
    out = run(EXPR, *ARGS, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["collectives"][0]["kind"] == "all-reduce" and plan["mesh"] == {"data": 4, "model": 2}
    assert plan["alternatives"] and plan["dtype"] == "bf16"


def test_explain_errors_exit_2_with_the_reason():
    out = run("b x@data, x y@modle -> b y", *ARGS)
    assert out.returncode == 2 and "Did you mean 'model'" in out.stderr and "^" in out.stderr
    out = run(EXPR, "--mesh", "data:4", "--sizes", "b=1,x=4,y=2")
    assert out.returncode == 2 and "name=size" in out.stderr
