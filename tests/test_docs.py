"""Docs are code: every Python block of README.md and docs/*.md runs as pasted, in order, in a fresh interpreter,
and every ``einshard ...`` command line of their shell blocks runs too.

Each page runs in its own process with JAX's device flags removed from the environment, so a page works only if
its first block sets up the simulated devices itself, as a laptop user would (the pages say so in their prose).
A command line runs as ``python -m einshard ...`` with 8 simulated CPU devices (what ``einshard demo`` picks by
itself without an accelerator), in a fresh directory.
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
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


SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
SEPARATORS = {"&&", "||", ";", "&", "|"}


def shell_blocks(text: str) -> list[str]:
    """The ```bash / ```sh / ```shell / ```console fenced blocks of a Markdown page, in order."""
    langs = "|".join(SHELL_LANGUAGES)
    return re.findall(rf"^```(?:{langs})\n(.*?)^```", text, flags=re.S | re.M)


def einshard_commands(block: str) -> list[list[str]]:
    """The arguments of every ``einshard ...`` (or ``python -m einshard ...``) command in a shell block.

    Lines continued with a backslash are joined, a console's ``$ `` prompt and ``# comments`` dropped, and each
    line split at ``&&``, ``;``, ``|`` and ``&``, so ``pip install ... && .venv/bin/einshard demo`` gives
    ``['demo']``.  Leading ``NAME=value`` settings and a path before the program (``.venv/bin/``) are ignored.
    """
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.strip()
        if line.startswith("$ "):
            line = line[2:]
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token not in SEPARATORS:
                command.append(token)
                continue
            while command and re.fullmatch(r"[A-Za-z_]\w*=.*", command[0]):
                command.pop(0)
            program = command[0].rsplit("/", 1)[-1] if command else ""
            if program == "einshard":
                out.append(command[1:])
            elif re.fullmatch(r"python[\d.]*", program) and command[1:3] == ["-m", "einshard"]:
                out.append(command[3:])
            command = []
    return out


def _doc_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments) for every distinct einshard command in the docs, first occurrence first."""
    seen: dict[tuple[str, ...], str] = {}
    for page in PAGES:
        text = page.read_text()
        for block in shell_blocks(text):
            line = text[: text.index(block)].count("\n") + 1
            for args in einshard_commands(block):
                seen.setdefault(tuple(args), f"{page.name}:{line}")
    return [(where, list(args)) for args, where in seen.items()]


DOC_COMMANDS = _doc_commands()

# What the pages promise a command prints, beyond running cleanly (README / docs/demo.md describe this output).
PROMISES: dict[tuple[str, ...], list[str]] = {
    ("demo",): [  # the README's main job, as written: every preset, the default 20 steps
        "8 cpu devices",
        "'l d h k -> l d h@model k'",
        "[l:2 d:64 h:8@model k:8]",
        "collectives XLA runs per step:",
        r"w_in\s+'r@model d, d f@model -> r f@model'\s+allgather_einsum per layer",
        "bubble: 20% of stage-iterations idle",
    ],
}


def _command_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.mark.slow
@pytest.mark.parametrize("where, args", DOC_COMMANDS, ids=[f"{w} einshard {' '.join(a)}"[:90] for w, a in DOC_COMMANDS])
def test_every_cli_line_runs(where, args, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "einshard", *args],
        cwd=tmp_path,
        env=_command_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    shown = f"{where}: einshard {shlex.join(args)}"
    assert proc.returncode == 0, f"{shown} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip(), f"{shown} printed nothing"
    assert "Traceback" not in proc.stderr, f"{shown}:\n{proc.stderr[-4000:]}"
    if args and args[0] == "demo":  # every layout trained matches the single-device reference
        sections = proc.stdout.count("\n== ") - ("--no-check" not in args)
        assert sections >= 1
        assert proc.stdout.count("loss matches the single-device run: yes") == sections, proc.stdout[-3000:]
    if args[:1] == ["demo"] and not {"--layout", "--rules"} & set(args):  # every preset, in the final table
        from einshard_apps.presets import PRESETS

        assert all(f"\n== {name}:" in proc.stdout for name in PRESETS), proc.stdout[-3000:]
        assert proc.stdout[proc.stdout.index("layout    mesh") :].count("same (") == len(PRESETS)
    for promise in PROMISES.get(tuple(args), []):
        assert re.search(promise, proc.stdout) or promise in proc.stdout, f"{shown}: no {promise!r} in its output"


def test_the_docs_have_cli_lines_to_run():
    """The command reader finds the docs' command lines: demo, analyze and show (none silently skipped)."""
    verbs = {args[0] for _, args in DOC_COMMANDS}
    assert {"demo", "analyze", "show"} <= verbs, DOC_COMMANDS
    assert all(args[0] in ("demo", "analyze", "show", "plan", "explain") for _, args in DOC_COMMANDS)


def test_the_command_reader():
    text = (
        "```bash\npython3 -m venv .venv && .venv/bin/pip install -q -e '.[cli]' && .venv/bin/einshard demo --steps 2\n```\n"
        "```console\n$ einshard show 'b d -> b@data d' --shape 8,4 \\\n    --mesh data=8   # a comment\n```\n"
        "```sh\nPID=0 python -m einshard plan --mesh data=8 & python -m pytest -q\n```\n"
        "```python\neinshard('x')\n```\n"
    )
    commands = [c for block in shell_blocks(text) for c in einshard_commands(block)]
    assert commands == [
        ["demo", "--steps", "2"],
        ["show", "b d -> b@data d", "--shape", "8,4", "--mesh", "data=8"],
        ["plan", "--mesh", "data=8"],
    ]


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
