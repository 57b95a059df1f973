"""Session 16's probe: explain against XLA on models the external corpus did not hold (issue 20).

Families: tests/external_corpus/unseen_models.py (registered in the corpus: external_corpus.families / cases).  Each case is measured by the corpus's own comparison
(external_corpus.compare.measure: kinds and counts exact, bytes within 10%, peak within 25%) and its status
recorded ('match', 'incomplete', 'said-so', 'silent', 'error').  Usage::

    python benchmarks/unseen_probe.py [--only SUBSTRING ...] [--out benchmarks/results/unseen_probe.json]

Results merge into the JSON by case id, so a run with --only updates only its cases.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from external_corpus import unseen_models  # noqa: E402
from external_corpus.compare import case_id, measure  # noqa: E402

STRATEGIES = ("dp", "tp", "dp_tp", "fsdp")


def cases() -> list[tuple[str, str, str, str]]:
    out = []
    for family in unseen_models.FAMILIES:
        modes = ("fwd", "grad") + (("step",) if family in unseen_models.STEP_FAMILIES else ())
        out += [(family, s, m, k) for s in STRATEGIES for m in modes for k in ("auto", "explicit")]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/unseen_probe.json"))
    args = ap.parse_args()
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    for case in cases():
        cid = case_id(*case)
        if args.only and not any(o in cid for o in args.only):
            continue
        t0 = time.process_time()
        try:
            record = measure(*case).to_dict()
        except Exception as e:  # noqa: BLE001 -- a model JAX or XLA refuses is recorded, not fatal
            record = {"case": cid, "status": "build-error", "error": f"{type(e).__name__}: {e}"[:300]}
        record["cpu_s"] = round(time.process_time() - t0, 2)
        results[cid] = record
        print(cid, record["status"], record.get("misses", record.get("error")), record["cpu_s"], flush=True)
        out.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
    print(summary(results))


def summary(results: dict) -> str:
    """Per family: how many cases match, how many whose kinds and counts match, bytes within 10%, peak within 25%,
    said so (incomplete or within the stated bound), silent and errors."""
    rows = ["family       cases match kinds bytes  peak said silent error"]
    for family in unseen_models.FAMILIES:
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


if __name__ == "__main__":
    main()
