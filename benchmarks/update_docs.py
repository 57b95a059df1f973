"""Copy every benchmark table (benchmarks/results/NAME.md) into README.md.

The README holds each table between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; this script replaces what is between them with
the file the benchmark script wrote, so the README's numbers are always the
ones a script measured.  A results file without markers, or markers without a
results file, is an error.

    python benchmarks/update_readme.py            # after running the bench_*.py scripts
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def _demote(text: str) -> str:
    """Headings in a results file sit under the README's '### ...' heading: push them three levels down."""
    return "\n".join("###" + line if re.match(r"#{1,3} ", line) else line for line in text.splitlines())


def update(readme: str, name: str, table: str) -> str:
    table = _demote(table)
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    if readme.count(start) != 1 or readme.count(end) != 1 or readme.index(start) > readme.index(end):
        raise SystemExit(f"README.md needs exactly one {start} ... {end} pair for benchmarks/results/{name}.md")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{start}\n{table.strip()}\n{end}", readme)


def main() -> int:
    path = ROOT / "README.md"
    readme = path.read_text()
    names = sorted(p.stem for p in RESULTS.glob("*.md"))
    for name in names:
        readme = update(readme, name, (RESULTS / f"{name}.md").read_text())
    orphans = set(re.findall(r"<!-- bench:([\w-]+):start -->", readme)) - set(names)
    if orphans:
        raise SystemExit(f"README.md has markers with no results file: {', '.join(sorted(orphans))}")
    path.write_text(readme)
    print(f"README.md: {len(names)} benchmark tables updated ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
