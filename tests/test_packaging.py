"""The grammar travels inside the wheel: a non-editable install parses and places without the source tree."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap
import zipfile

import pytest
from device_count import ROOT, device_env

pytestmark = pytest.mark.slow  # subprocesses: CI runs these with -m slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = out.glob("einshard-*.whl")
    return built


def test_wheel_carries_the_grammar(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "einshard/grammar/einshard.lark" in names
    assert "einshard/_src/parsing.py" in names  # the code, under the private tree
    assert "einshard/placement.py" in names  # its public face
    assert "einshard/_src/analysis/program/primitives.json" in names  # explain's coverage data travels too
    packaged = zipfile.ZipFile(wheel).read("einshard/grammar/einshard.lark").decode()
    assert packaged == (ROOT / "grammar" / "einshard.lark").read_text(encoding="utf-8")


def test_unpacked_wheel_parses_and_places_from_elsewhere(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = textwrap.dedent(
        """
        import pathlib, sys
        import einshard, jax, numpy as np
        from einshard.placement import parse_einsum
        site = pathlib.Path(sys.argv[1]).resolve()
        # The installed copy, not the source tree (which is not on the path).
        assert pathlib.Path(einshard.__file__).resolve().parent == site / "einshard", einshard.__file__
        assert not (site / "grammar").exists()
        assert str(einshard.placement.parse("a b -> a2* b")) == "a b -> a2* b"
        assert str(parse_einsum("b x@data, x y -> b y {U:data}")) == "b x@data, x y -> b y {U:data}"
        assert einshard.spec("b ... -> b@data ...", (8, 2, 3)) == jax.sharding.PartitionSpec("data", None, None)
        y = einshard.einshard(np.arange(32.0).reshape(8, 4), "a b -> a4 b")
        assert y.sharding.shard_shape((8, 4)) == (2, 4)
        try:
            einshard._src.parsing.parse("a b -> a (b)")
        except einshard.EinshardError as e:
            assert "^" in str(e)
        else:
            raise AssertionError("no syntax error")
        print("wheel ok")
        """
    )
    env = device_env(4, PYTHONPATH=str(site))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(site)], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "wheel ok" in proc.stdout
