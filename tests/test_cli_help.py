"""``einshard --help`` starts no JAX, and the names its help lists are the library's own."""

import subprocess
import sys

from einshard.analysis import PROFILES
from einshard_apps import arguments
from einshard_apps.cli import main
from einshard_apps.presets import PRESETS


def test_help_imports_neither_jax_nor_the_library():
    code = (
        "import sys\n"
        "from einshard_apps.cli import main\n"
        "for argv in (['--help'], ['--version'], ['demo', '--help'], ['analyze', '--help'], ['explain', '--help'], ['show', '--help'], ['plan', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "loaded = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.') or m == 'einshard')\n"
        "print('LOADED', loaded)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "LOADED []" in proc.stdout, proc.stdout[-2000:]


def test_the_help_lists_the_library_names():
    assert tuple(PRESETS) == arguments.PRESET_NAMES
    assert tuple(sorted(PROFILES)) == tuple(sorted(arguments.PROFILE_NAMES))


def test_help_lists_the_commands(capsys):
    try:
        main(["--help"])
    except SystemExit as stop:
        assert stop.code == 0
    out = capsys.readouterr().out
    assert all(c in out for c in ("demo", "analyze", "show", "plan"))


def test_the_old_explain_verb_runs_analyze_and_says_so(capsys):
    try:
        main(["explain", "--help"])
    except SystemExit as stop:
        assert stop.code == 0
    captured = capsys.readouterr()
    assert "'explain' is now 'analyze'" in captured.err
    assert "annotated einsum" in captured.out


def test_version_prints_the_package_version(capsys):
    import einshard

    try:
        main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out.strip() == f"einshard {einshard.__version__}"


def test_help_names_every_demo_layout_and_no_unfilled_link(capsys):
    try:
        main(["--help"])
    except SystemExit:
        pass
    out = capsys.readouterr().out
    assert "https://github.com/ " not in out and "https://github.com/)" not in out
    demo_line = " ".join(out.split("demo", 1)[1].split("analyze", 1)[0].split())
    assert all(name in demo_line for name in PRESETS), demo_line
