"""Which primitive has which layout rule, and which test holds it against XLA: the data behind docs/coverage.md.

The primitives are the ones ``tools/list_primitives.py`` found by tracing the public functions of
jax.numpy, jax.nn, lax, optax, Flax and Equinox (``primitives.json``, committed).  A primitive with a
sub-jaxpr and no rule of its own (``jit``, ``remat2``, ``custom_jvp_call``, ``custom_vjp_call``) is walked
into by :func:`.registry.call_rule`.  ``python -m einshard._src.analysis.program.coverage`` rewrites
docs/coverage.md; tests/test_primitive_rules.py fails when it is stale or a listed primitive has no rule.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .registry import RULES  # complete: the package's __init__ imports every rules module

__all__ = ["CoverageRow", "CALLS", "TESTS", "primitives", "rows", "render", "DOCS"]

DATA = Path(__file__).with_name("primitives.json")
DOCS = Path(__file__).resolve().parents[4] / "docs" / "coverage.md"

# Call-like primitives: their body is walked with the operands' layouts (registry.call_rule).
CALLS = {"jit", "pjit", "remat2", "checkpoint", "custom_jvp_call", "custom_vjp_call", "closed_call", "core_call"}

_DIFF = "tests/test_primitive_rules.py"
_INDEXING = "tests/test_primitive_rules_indexing.py"
_CORE = "tests/test_primitive_rules_core.py"  # the core primitives' differential property tests
# The test that holds each rule against XLA's compiled HLO (rule function -> test).
TESTS: dict[str, str] = {
    "rules_ordering.split": f"{_DIFF} [split], tests/test_scan_carry_rules.py",
    "rules_ordering.rev": f"{_DIFF} [rev]",
    "rules_ordering.sort": f"{_DIFF} [sort]",
    "rules_ordering.top_k": f"{_DIFF} [top_k]",
    "rules_ordering.cumulative": f"{_DIFF} [cumulative]",
    "rules_ordering.arg_reduction": f"{_DIFF} [argmax]",
    "rules_ordering.stack": f"{_DIFF} [stack]",
    "rules_ordering.unstack": f"{_DIFF} [stack]",
    "rules_structural.pad": f"{_DIFF} [pad]",
    "rules_structural.slice_static": f"{_DIFF} [slice]",
    "rules_structural.slice_": f"{_DIFF} [dynamic_slice]",
    "rules_indexing.dynamic_update_slice": f"{_DIFF} [dynamic_slice], {_INDEXING} [dynamic_update_slice]",
    "rules_windows.conv_general_dilated": f"{_DIFF} [conv_general_dilated]",
    "rules_windows.reduce_window": f"{_DIFF} [reduce_window]",
    "rules_windows.select_and_scatter_add": f"{_DIFF} [reduce_window] (the max pool's gradient)",
    "rules_loops.cond": f"{_DIFF} [control]",
    "rules_loops.while_loop": f"{_DIFF} [control], tests/test_scan_carry_rules.py",
    "rules_structural.concatenate": f"{_INDEXING} [concatenate], {_DIFF} [split] (the gradient of split)",
    "rules_structural.elementwise": (
        f"{_INDEXING} [select_n, iota_mask, clamp, integer, mixed_elementwise], tests/test_explain_rules.py"
    ),
    "rules_structural.reduce": f"{_CORE} [reduce], tests/test_explain_rules.py (reductions over split axes)",
    "rules_structural.broadcast_in_dim": f"{_CORE} [broadcast_in_dim], tests/test_explain_rules.py",
    "rules_structural.reshape": f"{_CORE} [reshape]",
    "rules_structural.transpose": f"{_CORE} [transpose]",
    "rules_structural.squeeze": f"{_CORE} [squeeze]",
    "rules_structural.expand_dims": f"{_CORE} [squeeze] (expand_dims)",
    "rules_structural.constant": f"{_INDEXING} [iota_mask], tests/test_explain_corpus.py",
    "rules_structural.bitcast_convert_type": "tests/test_primitive_rules.py::test_coverage_rules_run",
    "rules_structural.no_data": "tests/test_primitive_rules.py::test_coverage_rules_run",
    "rules_indexing.dot_general": (
        f"{_CORE} [dot_general], tests/test_dot_consumer_sums.py, tests/test_analysis_vs_xla.py, "
        "tests/test_scan_carry_rules.py"
    ),
    "rules_indexing.gather": f"{_INDEXING} [gather], tests/test_explain_rules.py (lookups, take_along_axis)",
    "rules_indexing.scatter_add": f"{_INDEXING} [scatter] (and [gather]'s gradients), tests/test_explain_rules.py",
    "rules_indexing.scatter": f"{_INDEXING} [scatter], tests/test_explain_rules.py",
    "rules_control.scan": "tests/test_scan_carry_rules.py, tests/test_explain_corpus.py, tests/test_explain.py",
    "rules_linalg.tile": "tests/test_linalg_rules.py [tile]",
    "rules_linalg.matrix_op": "tests/test_linalg_rules.py [matrix]",
    "rules_linalg.fft": "tests/test_linalg_rules.py [fft]",
    "rules_control.constraint": (
        "tests/test_explain_rules.py (auto_axes), tests/test_dot_at_placement.py, tests/test_explain.py"
    ),
    "registry.call_rule": "tests/test_explain_corpus.py (jax.nn, optax and Flax wrap their bodies)",
    "rules_random.key_batch": "tests/test_prng_rules.py [split, bits, unwrap, dropout]",
    "rules_random.wrap": "tests/test_prng_rules.py [wrap]",
    "rules_random.fold_in": "tests/test_prng_rules.py [fold_in]",
}


@dataclass(frozen=True)
class CoverageRow:
    primitive: str
    rule: str  # "rules_module.function", "registry.call_rule", or "" when there is none
    test: str
    example: str  # one public function or training-step block that emits it
    sources: int  # how many traced functions emit it


def primitives() -> dict[str, dict[str, object]]:
    """The traced primitive list: name -> {'sources': count, 'example': one source}."""
    data: dict[str, dict[str, object]] = json.loads(DATA.read_text())["primitives"]
    return data


def rule_name(primitive: str) -> str:
    rule = RULES.get(primitive)
    if rule is not None:
        return f"{rule.__module__.rsplit('.', 1)[-1]}.{rule.__name__}"
    return "registry.call_rule" if primitive in CALLS else ""


def rows() -> list[CoverageRow]:
    out = []
    for name, info in sorted(primitives().items()):
        rule = rule_name(name)
        out.append(CoverageRow(name, rule, TESTS.get(rule, ""), str(info["example"]), int(str(info["sources"]))))
    return out


def render() -> str:
    """docs/coverage.md, generated."""
    table = rows()
    lines = [
        "# Primitive coverage of `einshard.explain`",
        "",
        "<!-- Generated by `python -m einshard._src.analysis.program.coverage`; tests/test_primitive_rules.py fails",
        "     when this file is stale. Do not edit by hand. -->",
        "",
        f"Every primitive that jax.numpy, jax.nn, lax, optax, Flax, Equinox and Keras 3 emitted when "
        f"`tools/list_primitives.py` traced their public functions and training-step building blocks, forward "
        f"and `jax.grad` ({len(table)} primitives), with the layout rule `explain` applies to it "
        "(`einshard/_src/analysis/program/`) and the test that holds that rule against XLA's compiled HLO. "
        "A primitive outside this list that has no rule is named in `report.unfollowed`.",
        "",
        "Rules marked approximate on an op (`OpReport.note` starts with `approximate:`) are the cases where "
        "XLA's partitioning turns on a heuristic the rule does not reproduce; the note says what may differ.",
        "",
        "| primitive | rule | test | emitted by (one of) |",
        "|---|---|---|---|",
    ]
    for r in table:
        rule = f"`{r.rule}`" if r.rule else "**none**"
        example = r.example if r.sources == 1 else f"{r.example} (+{r.sources - 1})"
        lines.append(f"| `{r.primitive}` | {rule} | {r.test or '—'} | {example} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    DOCS.write_text(render())
    print(f"wrote {DOCS}")
