"""Docs are code: every Python block of README.md and docs/*.md runs as pasted, in order, in a fresh interpreter.

Each page runs in its own process with JAX's device flags removed from the environment, so a page works only if
its first block sets up the simulated devices itself, as a laptop user would (the pages say so in their prose).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks(text: str) -> list[str]:
    """The ```python fenced blocks of a Markdown page, in order."""
    return [b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def _page_script(page: pathlib.Path) -> str:
    parts = []
    for i, block in enumerate(python_blocks(page.read_text())):
        parts.append(f"# --- {page.name}, block {i + 1}\n{block}")
    return "\n".join(parts)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text())], ids=lambda p: p.name)
def test_every_python_block_runs_as_pasted(page, tmp_path):
    script = tmp_path / f"{page.stem}_blocks.py"
    script.write_text(_page_script(page))
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"{page.name}'s Python blocks failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def test_the_block_reader_finds_every_block():
    text = "intro\n```python\na = 1\n```\nprose\n```bash\nls\n```\n```python\nb = a + 1\n```\n"
    assert python_blocks(text) == ["a = 1\n", "b = a + 1\n"]


@pytest.mark.slow
def test_the_multihost_page_runs_in_two_processes(tmp_path):
    """docs/multihost.md's program, started twice as the page says (2 processes x 4 CPU devices, gloo)."""
    import socket

    program = python_blocks((ROOT / "docs" / "multihost.md").read_text())[0]
    script = tmp_path / "multihost_example.py"
    script.write_text(program)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    base["PYTHONPATH"] = str(ROOT) + os.pathsep + base.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env={**base, "PID": str(pid), "PORT": str(port)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, f"{out}\n{err[-4000:]}"
    losses = [out.strip().rsplit(" ", 1)[-1] for out, _ in outs]
    assert losses[0] == losses[1], outs
    assert "process 0" in outs[0][0] and "process 1" in outs[1][0]
