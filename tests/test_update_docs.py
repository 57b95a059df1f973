"""Every results table reaches a docs page: benchmarks/update_docs.py finds a marker pair for each one.

A results file whose script writes it into another page itself is named in ``WRITTEN_ELSEWHERE``; that page must
then hold the table's own block.  Nothing is measured or written here.
"""

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "update_docs.py"


def _update_docs():
    spec = importlib.util.spec_from_file_location("update_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_results_table_has_its_markers_in_the_benchmarks_page() -> None:
    module = _update_docs()
    page = module.PAGE.read_text()
    for table in sorted(module.RESULTS.glob("*.md")):
        if table.stem in module.WRITTEN_ELSEWHERE:
            continue
        # update() raises SystemExit naming the table where its marker pair is missing or doubled.
        page = module.update(page, table.stem, table.read_text())
    marked = set(re.findall(r"<!-- bench:([\w-]+):start -->", page))
    assert marked == {p.stem for p in module.RESULTS.glob("*.md")} - set(module.WRITTEN_ELSEWHERE)


def test_tables_written_elsewhere_are_in_their_page() -> None:
    module = _update_docs()
    for name, where in module.WRITTEN_ELSEWHERE.items():
        page = ROOT / where.split(" ")[0]
        body = (module.RESULTS / f"{name}.md").read_text().split("\n", 2)[2].strip()
        assert body.splitlines()[0] in page.read_text(), f"{name}'s table is not in {page}"
