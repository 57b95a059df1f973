"""Session 16's probe: explain against XLA on models the external corpus did not hold (issue 20).

Families: tests/external_corpus/unseen_models.py (registered in the corpus: external_corpus.families / cases).  Each case is measured by the corpus's own comparison
(external_corpus.compare.measure: kinds and counts exact, bytes within 10%, peak within 25%) and its status
recorded ('match', 'incomplete', 'said-so', 'silent', 'error').  Usage::

    python benchmarks/unseen_probe.py [--only SUBSTRING ...] [--out benchmarks/results/unseen_probe.json]

Results merge into the JSON by case id, so a run with --only updates only its cases.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("KERAS_BACKEND", "jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import probe_runs  # noqa: E402
from external_corpus import unseen_models  # noqa: E402

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
    results = probe_runs.run(cases(), Path(args.out), args.only)
    print(probe_runs.summary(results, unseen_models.FAMILIES))


if __name__ == "__main__":
    main()
