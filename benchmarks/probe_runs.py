"""What the probes of models outside the corpus share (benchmarks/unseen_probe.py, benchmarks/keras_hub_probe.py):
measure each case by the corpus's comparison, merge the records into a JSON file by case id, and summarise them
per family.  Import it after the probe has put tests/ on ``sys.path`` (external_corpus lives there)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from external_corpus.compare import case_id, measure


def run(cases: Iterable[tuple[str, str, str, str]], out: Path, only: Sequence[str] = ()) -> dict[str, Any]:
    """Measure every case whose id contains one of ``only`` (all when empty); records merge into ``out`` by case
    id as each case ends.  A model JAX or XLA refuses (or a layout einshard refuses) is recorded, not fatal."""
    results: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    for case in cases:
        cid = case_id(*case)
        if only and not any(o in cid for o in only):
            continue
        t0 = time.process_time()
        try:
            record = measure(*case).to_dict()
        except Exception as e:  # noqa: BLE001 -- recorded, not fatal
            record = {"case": cid, "status": "build-error", "error": f"{type(e).__name__}: {e}"[:300]}
        record["cpu_s"] = round(time.process_time() - t0, 2)
        results[cid] = record
        print(cid, record["status"], record.get("misses", record.get("error")), record["cpu_s"], flush=True)
        out.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
    return results


def summary(results: dict[str, Any], families: Iterable[str]) -> str:
    """Per family: cases, matches, kinds and counts equal, bytes within 10%, peak within 25%, said so (incomplete or
    within the stated bound), silent, errors."""
    rows = ["family       cases match kinds bytes  peak said silent error"]
    for family in families:
        recs = [r for r in results.values() if r.get("family", r["case"].split("-")[1]) == family]
        misses = [" ".join(r.get("misses", ())) for r in recs]
        count = Counter(r["status"] for r in recs)
        rows.append(
            f"{family:12s} {len(recs):5d} {count['match']:5d} "
            f"{sum(bool(r.get('kinds_match')) for r in recs):5d} {sum('bytes:' not in m for m in misses):5d} "
            f"{sum('peak:' not in m for m in misses):5d} {count['said-so'] + count['incomplete']:4d} "
            f"{count['silent']:6d} {count['error'] + count['build-error']:5d}"
        )
    return "\n".join(rows)
