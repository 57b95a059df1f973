"""explain against the TPU compiler on the external corpus (issue 21): one table, shapes only, no TPU.

Every Auto-mesh case of tests/external_corpus (six families by three libraries, dp / tp / dp×tp / fsdp plus ep and
spatial, loss and grad) is laid out on a TPU slice described by libtpu (``--target``, 8 chips as the corpus' (4, 2)
mesh), compiled by the TPU compiler from ``ShapeDtypeStruct``s with shardings, and its collectives (kinds and
per-step counts, bytes sent per device) and ``memory_analysis()`` are set beside explain's prediction for the same
program.  The CPU compiler's numbers for the same case (benchmarks/results/external_table.json) are listed too, so
the table shows where the two compilers partition differently.

    python benchmarks/tpu_agreement.py [--target tpu:v5e:2x4] [--only SUBSTRING]

Needs libtpu (``pip install 'einshard[tpu]'``).  Writes benchmarks/results/tpu_agreement.{json,md} and the
generated section of docs/targets.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from external_corpus import MESH_AXES, MESH_SHAPE, specs_for  # noqa: E402
from external_corpus.cases import IDS  # noqa: E402
from external_corpus.compare import BYTES_TOLERANCE, MEMORY_TOLERANCE, mesh_of  # noqa: E402
from external_corpus.families import FAMILIES  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import einshard  # noqa: E402
from einshard._src.analysis.program import trace  # noqa: E402
from einshard.targets import libtpu_available, parse_target, target_mesh  # noqa: E402
from einshard.testing import hlo  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "targets.md"
START, END = (
    "<!-- tpu-agreement-table: start (benchmarks/tpu_agreement.py) -->",
    "<!-- tpu-agreement-table: end -->",
)


def _kinds(collectives: list[Any]) -> dict[str, int]:
    kinds: Counter[str] = Counter()
    for c in collectives:
        kinds[c.kind] += c.runs
    return dict(sorted(kinds.items()))


def _within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1.0)


def measure(family_name: str, strategy: str, mode: str, target: str, compiled: dict[str, Any] | None) -> dict[str, Any]:
    """One case: explain's prediction beside the TPU compiler's program for it (``compiled``: the TPU side of an
    earlier run, reused as it is when only explain changed)."""
    family = FAMILIES[family_name]()
    tpu = target_mesh(target, dict(zip(MESH_AXES, MESH_SHAPE)))
    cpu = mesh_of("auto")
    pexpr, bexpr = specs_for(family, strategy)

    def shapes_on(mesh: Any, exprs: Any, values: Any) -> Any:
        return jax.tree.map(
            lambda e, a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=einshard.sharding(e, a.shape, mesh=mesh)),
            exprs,
            values,
        )

    fn = jax.grad(family.loss) if mode == "grad" else family.loss
    sds_p, sds_b = shapes_on(tpu, pexpr, family.params), shapes_on(tpu, bexpr, family.batch)
    out_sh = jax.tree.map(lambda s: s.sharding, sds_p) if mode == "grad" else NamedSharding(tpu, P())
    if compiled is None:
        program = jax.jit(fn, out_shardings=out_sh).lower(sds_p, sds_b).compile()
        found = hlo.normalized(program.as_text())
        mem = program.memory_analysis()
        peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
        compiled = {
            "tpu_kinds": _kinds(found),
            "tpu_bytes": float(sum(c.sent_bytes * c.runs for c in found)),
            "tpu_peak": int(peak),
        }
    with jax.set_mesh(cpu):
        out_specs = [P()] if mode == "fwd" else [s.sharding.spec for s in jax.tree.leaves(sds_p)]
        # The target's profile: its tiling sizes the buffers of peak memory as the TPU compiler pads them.
        traced = trace(fn, family.params, family.batch, mesh=cpu, profile=parse_target(target).profile)
        report = traced.report((pexpr, bexpr), out_specs)
    explain_kinds: Counter[str] = Counter(
        c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1
    )
    explain_bytes = float(sum(c.bytes * op.repeat for op in report.ops for c in op.collectives))
    return {
        "family": family_name,
        "strategy": strategy,
        "mode": mode,
        "complete": report.complete,
        "explain_kinds": dict(sorted(explain_kinds.items())),
        **compiled,
        "kinds_match": dict(explain_kinds) == compiled["tpu_kinds"],
        "explain_bytes": explain_bytes,
        "bytes_match": _within(explain_bytes, compiled["tpu_bytes"], BYTES_TOLERANCE),
        "explain_peak": int(report.peak_bytes),
        "peak_match": _within(report.peak_bytes, compiled["tpu_peak"], MEMORY_TOLERANCE),
    }


def _words(kinds: dict[str, int]) -> str:
    return ", ".join(f"{n}×{k}" for k, n in sorted(kinds.items())) or "none"


def table(records: dict[str, Any], target: str) -> str:
    cpu = (
        json.loads((RESULTS / "external_table.json").read_text()) if (RESULTS / "external_table.json").exists() else {}
    )
    ok = [r for r in records.values() if "error" not in r]
    kinds = sum(r["kinds_match"] for r in ok)
    full = sum(r["kinds_match"] and r["bytes_match"] and r["peak_match"] for r in ok)
    same = sum(
        1 for cid, r in records.items() if "error" not in r and cpu.get(cid, {}).get("xla_kinds") == r["tpu_kinds"]
    )
    lines = [
        START,
        f"Target `{target}` (8 chips as a (data=4, model=2) mesh), the Auto-mesh cases of the external corpus, "
        f"shapes only, compiled by libtpu on a CPU machine. explain names the TPU compiler's collective kinds and "
        f"counts in **{kinds} of {len(ok)}**; kinds, bytes within 10% and peak memory within 25% together in "
        f"**{full} of {len(ok)}**; the TPU and the CPU compiler chose the same collectives in {same} of {len(ok)}."
        + (
            f" {len(records) - len(ok)} cases did not compile for the target (listed)."
            if len(ok) < len(records)
            else ""
        ),
        "",
        "| case | explain | TPU compiler | CPU compiler | bytes explain/TPU | peak explain/TPU |",
        "|---|---|---|---|---|---|",
    ]
    for cid, r in sorted(records.items()):
        if "error" in r:
            lines.append(f"| `{cid}` | — | did not compile: {r['error'][:80]} | | | |")
            continue
        cpu_kinds = cpu.get(cid, {}).get("xla_kinds")
        mark = "" if r["kinds_match"] else " ✗"
        lines.append(
            f"| `{cid}` | {_words(r['explain_kinds'])}{mark} | {_words(r['tpu_kinds'])} | "
            f"{_words(cpu_kinds) if cpu_kinds is not None else '—'} | "
            f"{r['explain_bytes'] / max(r['tpu_bytes'], 1.0):.2f} | {r['explain_peak'] / max(r['tpu_peak'], 1):.2f} |"
        )
    lines.append(END)
    return "\n".join(lines)


def write_doc(text: str) -> None:
    doc = DOC.read_text()
    if START in doc:
        head, rest = doc.split(START, 1)
        doc = head + text + rest.split(END, 1)[1]
    else:
        doc = doc.rstrip("\n") + "\n\n## explain against the TPU compiler\n\n" + text + "\n"
    DOC.write_text(doc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tpu:v5e:2x4")
    ap.add_argument("--only", default=None)
    ap.add_argument("--doc-only", action="store_true", help="regenerate the docs section from the JSON")
    ap.add_argument(
        "--explain-only", action="store_true", help="redo explain's side only; the TPU compiler's from the JSON"
    )
    a = ap.parse_args()
    out = RESULTS / "tpu_agreement.json"
    if a.doc_only:
        records = json.loads(out.read_text())
    else:
        if not libtpu_available():
            sys.exit("libtpu is not installed: pip install 'einshard[tpu]'")
        previous = json.loads(out.read_text()) if out.exists() else {}
        records = previous if a.only else {}
        for cid, (family, strategy, mode, kind) in IDS.items():
            if kind != "auto" or (a.only and a.only not in cid):
                continue
            try:
                before = previous.get(cid, {})
                keep = {k: before[k] for k in ("tpu_kinds", "tpu_bytes", "tpu_peak")} if "tpu_kinds" in before else None
                if a.explain_only and keep is None:
                    continue  # no TPU numbers recorded for it: --explain-only compiles nothing (a full run does)
                records[cid] = measure(family, strategy, mode, a.target, keep if a.explain_only else None)
            except Exception as e:  # noqa: BLE001 -- a case the TPU compiler refuses is listed, not fatal
                records[cid] = {"family": family, "error": f"{type(e).__name__}: {e}"[:300]}
            r = records[cid]
            print(cid, r.get("kinds_match", r.get("error")), flush=True)
            out.write_text(json.dumps(records, indent=1, sort_keys=True))
    text = table(records, a.target)
    (RESULTS / "tpu_agreement.md").write_text(text + "\n")
    write_doc(text)


if __name__ == "__main__":
    main()
