"""The placement benchmark script runs and writes its results; the docs page's markers are handled strictly.

Nothing here asserts a speed (speed belongs to the benchmark's own report):
it checks that the script keeps working as the library changes.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses: CI runs these with -m slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_placement.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_placement", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    readme = out / "benchmarks.md"
    readme.write_text("# t\n\nabove\n<!-- bench:placement:start -->\nold table\n<!-- bench:placement:end -->\nbelow\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--size", "256", "--out", str(out), "--update-docs",
         "--page", str(readme)],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return out, readme


def test_quick_run_writes_json_and_markdown(quick_run):
    out, _ = quick_run
    results = json.loads((out / "placement.json").read_text())
    assert results["quick"] is True
    assert results["machine"]["device_count"] >= 1 and results["machine"]["jax"]
    labels = [r["label"] for r in results["placement"]]
    assert any("host numpy" in label for label in labels) and any("reshard" in label for label in labels)
    assert any(label.startswith("pytree") for label in labels)
    for row in results["placement"]:
        assert len(row["einshard_s"]) == len(row["baseline_s"]) >= 5
        assert row["ratio"] > 0 and all(t > 0 for t in row["einshard_s"] + row["baseline_s"])
    for row in results["parse"]["rows"]:
        assert all(t > 0 for t in row["parse_first_s"] + row["parse_cached_s"])
    table = (out / "placement.md").read_text()
    assert "| Input | Expression | einshard | device_put | Ratio | Added |" in table
    assert "Quick run" in table


def test_update_docs_replaces_only_between_the_markers(quick_run):
    out, readme = quick_run
    text = readme.read_text()
    assert text.startswith("# t\n\nabove\n<!-- bench:placement:start -->\n")
    assert text.endswith("<!-- bench:placement:end -->\nbelow\n")
    assert "old table" not in text
    assert (out / "placement.md").read_text().strip() in text


@pytest.mark.parametrize(
    "content",
    [
        "no markers at all\n",
        "<!-- bench:placement:end -->\n<!-- bench:placement:start -->\n",
        "<!-- bench:placement:start -->\n<!-- bench:placement:end -->\n<!-- bench:placement:start -->\n",
    ],
    ids=["missing", "reversed", "twice"],
)
def test_update_docs_fails_clearly_without_proper_markers(bench, tmp_path, content):
    readme = tmp_path / "benchmarks.md"
    readme.write_text(content)
    with pytest.raises(SystemExit, match="bench:placement"):
        bench._update_page(readme, "table")
    assert readme.read_text() == content


def test_missing_markers_fail_before_measuring(tmp_path):
    readme = tmp_path / "benchmarks.md"
    readme.write_text("nothing\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--update-docs", "--page", str(readme), "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "<!-- bench:placement:start -->" in proc.stderr
    assert not (tmp_path / "placement.json").exists()
