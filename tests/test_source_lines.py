"""Which frame a finding points at: the user's line, not a library's, wherever the library was installed.

check_explicit and explain name the source line of an op (``model.py:12 (f)``): the innermost frame that is
neither JAX nor an installed library.  Libraries installed outside site-packages (``pip install --target`` on
PYTHONPATH, as a GPU image or a Bazel tree does) are libraries too; the user's own folder is not.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from einshard._src.analysis import explicit


@pytest.fixture
def target_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder laid out as `pip install --target` leaves it: a package and its .dist-info, on sys.path."""
    folder = tmp_path / "site"
    (folder / "vendored_lib").mkdir(parents=True)
    (folder / "vendored_lib" / "__init__.py").write_text("def matmul(x, y):\n    return x @ y\n")
    info = folder / "vendored_lib-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vendored-lib\nVersion: 1.0\n")
    (info / "RECORD").write_text("")
    monkeypatch.syspath_prepend(str(folder))
    importlib.invalidate_caches()
    explicit._installed_roots.cache_clear()
    yield folder
    explicit._installed_roots.cache_clear()


def test_a_library_installed_with_pip_target_is_a_library(target_install: Path) -> None:
    lib_file = str(target_install / "vendored_lib" / "__init__.py")
    assert explicit._is_library(lib_file)
    assert explicit._short_path(lib_file) == "vendored_lib/__init__.py"


def test_the_users_own_files_are_theirs(target_install: Path, tmp_path: Path) -> None:
    own = tmp_path / "model.py"
    own.write_text("")
    assert not explicit._is_library(str(own))
    assert not explicit._is_library(__file__)


def test_a_finding_points_at_the_users_line_through_a_target_installed_library(target_install: Path) -> None:
    import jax
    import jax.numpy as jnp

    import einshard

    vendored = importlib.import_module("vendored_lib")
    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def step(w, x):
        return vendored.matmul(x, w)  # the library's matmul, called from this line

    w = jax.ShapeDtypeStruct((16, 8), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P("data", None)))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=jax.NamedSharding(mesh, jax.P(None, "model")))
    report = einshard.check_explicit(step, w, x)
    assert report.findings, "the contracted axis is split over data on one side, model on the other: JAX refuses it"
    assert all(Path(__file__).name in f.where for f in report.findings), [f.where for f in report.findings]
    sys.modules.pop("vendored_lib", None)
