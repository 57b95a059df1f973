"""The README's commands are the ones CI runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = _bash_blocks(readme)
    assert len(blocks) >= 2, "the README must show the main-job command and the test command"
    test_command = next(b for b in blocks if "pytest" in b)
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci.splitlines(), f".ci/run must run the README's test command verbatim: {test_command}"


def test_readme_main_command_runs_the_demo():
    readme = (ROOT / "README.md").read_text()
    main_command = _bash_blocks(readme)[0]
    assert main_command.endswith("einshard demo")
