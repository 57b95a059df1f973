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
from typing import Any

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
    ("show", "a -> a@x", "--shape", "8", "--mesh", "x=2,y=4"): [  # docs/demo.md: "ends with ..."
        "copies: each block is on 4 devices over y(4); replication groups: {0-3} {4-7}",
    ],
}


def _command_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_command(args: list[str], cwd: pathlib.Path, shown: str) -> subprocess.CompletedProcess[str]:
    """``python -m einshard ARGS`` on 8 simulated devices in ``cwd``; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "einshard", *args],
        cwd=cwd,
        env=_command_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"{shown} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("where, args", DOC_COMMANDS, ids=[f"{w} einshard {' '.join(a)}"[:90] for w, a in DOC_COMMANDS])
def test_every_cli_line_runs(where, args, tmp_path):
    shown = f"{where}: einshard {shlex.join(args)}"
    proc = _run_command(args, tmp_path, shown)
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


# -- commands written inline in the prose (`einshard ...` in backticks) -------------------------------------------

_FENCED = re.compile(r"^```.*?^```", flags=re.S | re.M)
_SYNOPSIS = re.compile(r"[\[\]<>|]|\.\.\.")  # optional parts, placeholders, alternatives, "and so on"


def inline_commands(text: str) -> list[str]:
    """Every inline code span of a page that starts with ``einshard``, whitespace (line breaks) collapsed."""
    return [" ".join(span.split()) for span in re.findall(r"`(einshard(?:\s[^`]*)?)`", _FENCED.sub("", text))]


def is_synopsis(command: str) -> bool:
    """A command written with synopsis notation ([optional], <placeholder>, a|b, ...) outside quotes."""
    return bool(_SYNOPSIS.search(re.sub(r"'[^']*'", "''", command)) or re.search(r"<\w[\w -]*>", command))


def _parser(verb: str | None) -> Any:
    import argparse

    from einshard_apps import arguments, cli

    parser = argparse.ArgumentParser(prog=f"einshard {verb or ''}".strip(), add_help=True)
    if verb is not None:
        getattr(arguments, cli.RENAMED.get(verb, verb).replace("-", "_"))(parser)
    return parser


def _verb(words: list[str]) -> str | None:
    from einshard_apps import cli

    first = words[0] if words else ""
    return first if first in cli.COMMANDS or first in cli.RENAMED else None


def complete(args: list[str]) -> bool:
    """Whether the command line parses: a verb, arguments, every required value (else it is a mention)."""
    import contextlib
    import io

    verb = _verb(args)
    if verb is None or len(args) == 1:  # a verb alone names the command in the prose
        return False
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            _parser(verb).parse_args(args[1:])
        except SystemExit:
            return False
    return True


def _inline_runs() -> list[tuple[str, list[list[str]]]]:
    """Per page, the inline commands to run in order in one directory (a later one may read a file an earlier
    one wrote): complete ones, not synopses; a page whose every such command ran before is left out."""
    seen = {tuple(a) for _, a in DOC_COMMANDS}
    out = []
    for page in PAGES:
        runs = [shlex.split(c)[1:] for c in inline_commands(page.read_text()) if not is_synopsis(c)]
        page_runs = list(dict.fromkeys(tuple(a) for a in runs if complete(a)))
        if not set(page_runs) <= seen:  # a page repeating only commands run before (same order, files) is not rerun
            out.append((page.name, [list(a) for a in page_runs]))
        seen |= set(page_runs)
    return out


def test_every_inline_command_names_a_real_verb_and_real_flags():
    """Synopses and mentions in the prose (``einshard demo [--mesh data=4,model=2]``, ``einshard demo --rules``)
    can't run, but each verb and ``--flag`` they name must exist: a renamed flag would leave the prose wrong."""
    seen = 0
    for page in PAGES:
        for command in inline_commands(page.read_text()):
            words = [w.strip("[]'") for w in re.sub(r"'[^']*'", "x", command).split()[1:]]
            verb = _verb(words)
            assert verb is not None or not words or words[0] in ("...", "--help"), f"{page.name}: {command}"
            known = {o for action in _parser(verb)._actions for o in action.option_strings}
            for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                assert flag in known, f"{page.name}: `{command}` names {flag}, which einshard {verb} does not take"
                seen += 1
    assert seen >= 10


def test_the_inline_reader():
    text = (
        "Run `einshard show 'a -> a@x' --shape 8 --mesh x=2,y=4`, or `einshard plan --mesh\ndata=8 --rules-out r.json`"
        " then `einshard demo --rules r.json`; `einshard demo [--layout dp|tp]` and `einshard demo --rules` are not"
        " commands, nor `einshard plan` or `einshard analyze '<einsum>'`.\n```bash\neinshard demo --steps 2\n```\n"
    )
    commands = inline_commands(text)
    assert commands[1] == "einshard plan --mesh data=8 --rules-out r.json"
    assert [is_synopsis(c) for c in commands] == [False, False, False, True, False, False, True]
    assert [complete(shlex.split(c)[1:]) for c in commands if not is_synopsis(c)] == [True, True, True, False, False]
    assert "einshard demo --steps 2" not in commands


INLINE_RUNS = _inline_runs()


@pytest.mark.slow
@pytest.mark.parametrize("page, runs", INLINE_RUNS, ids=[p for p, _ in INLINE_RUNS])
def test_inline_commands_run_in_page_order(page, runs, tmp_path):
    for args in runs:
        shown = f"{page} (inline): einshard {shlex.join(args)}"
        proc = _run_command(args, tmp_path, shown)
        assert "Traceback" not in proc.stderr, f"{shown}:\n{proc.stderr[-4000:]}"
        if args[0] == "demo":
            assert "loss matches the single-device run: yes" in proc.stdout, proc.stdout[-3000:]
        for promise in PROMISES.get(tuple(args), []):
            assert re.search(promise, proc.stdout) or promise in proc.stdout, f"{shown}: no {promise!r} in its output"


def test_the_inline_commands_that_run_are_found():
    """The README's plan-then-demo pair and the show examples are run (none silently classed as a mention)."""
    runs = {tuple(a) for _, rs in INLINE_RUNS for a in rs}
    verbs = [a[0] for a in runs]
    assert {"plan", "demo", "show"} <= set(verbs), runs
    assert any(a[:1] == ("demo",) and "--rules" in a for a in runs)


def test_the_docs_have_cli_lines_to_run():
    """The command reader finds the docs' command lines: demo, analyze and show (none silently skipped)."""
    verbs = {args[0] for _, args in DOC_COMMANDS}
    assert {"demo", "analyze", "show"} <= verbs, DOC_COMMANDS
    assert all(args[0] in ("demo", "analyze", "show", "plan", "explain", "check-explicit") for _, args in DOC_COMMANDS)


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


# -- the pages link up -------------------------------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(text: str) -> list[str]:
    """The targets of a page's Markdown links that point into the repository (no scheme, no bare anchor)."""
    prose = re.sub(r"`[^`]*`", "", _FENCED.sub("", text))  # code (``x.at[i](...)``) is not a link
    return [t for t in _LINK.findall(prose) if not re.match(r"[a-z]+:|#", t)]


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = {t.split("#")[0] for t in relative_links(index)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    assert pages <= listed, f"docs/index.md does not list {sorted(pages - listed)}"
    assert "docs/index.md" in relative_links((ROOT / "README.md").read_text())


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_that_exists(page):
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t.split("#")[0]).exists()]
    assert not missing, f"{page.name} links to {missing}"
