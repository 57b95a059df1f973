"""Copy every benchmark table (benchmarks/results/NAME.md) into docs/benchmarks.md.

The page holds each table between ``<!-- bench:NAME:start -->`` and
``<!-- bench:NAME:end -->``; this script replaces what is between them with
the file the benchmark script wrote, so the page's numbers are always the
ones a script measured.  A results file without markers, or markers without a
results file, is an error.

    python benchmarks/update_docs.py            # after running the bench_*.py scripts
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
# Tables whose benchmark script writes them into another page itself (between that page's own markers): the
# results file is kept for the record and left alone here.
WRITTEN_ELSEWHERE = {"external_large": "docs/planner.md (benchmarks/bench_external.py --scale large)"}


def _demote(text: str) -> str:
    """Headings in a results file sit under the page's '## ...' section heading: push them two levels down."""
    return "\n".join("##" + line if re.match(r"#{1,4} ", line) else line for line in text.splitlines())


def update(page: str, name: str, table: str) -> str:
    """``page`` with the text between NAME's markers replaced by ``table`` (its headings demoted)."""
    table = _demote(table)
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    if page.count(start) != 1 or page.count(end) != 1 or page.index(start) > page.index(end):
        raise SystemExit(f"{PAGE.name} needs exactly one {start} ... {end} pair for benchmarks/results/{name}.md")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: f"{start}\n{table.strip()}\n{end}", page)


def main() -> int:
    page = PAGE.read_text()
    names = sorted(p.stem for p in RESULTS.glob("*.md") if p.stem not in WRITTEN_ELSEWHERE)
    for name in names:
        page = update(page, name, (RESULTS / f"{name}.md").read_text())
    orphans = set(re.findall(r"<!-- bench:([\w-]+):start -->", page)) - set(names)
    if orphans:
        raise SystemExit(f"{PAGE.name} has markers with no results file: {', '.join(sorted(orphans))}")
    PAGE.write_text(page)
    print(f"docs/benchmarks.md: {len(names)} benchmark tables updated ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
