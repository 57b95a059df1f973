"""What the demo prints: every parameter's layout, what XLA compiled, the final comparison table and the plot."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .trainer import RunResult, Trainer

__all__ = ["kib", "layout_rows", "compiled_summary", "print_plan", "matches_reference", "final_table", "write_plot"]


def kib(n: float) -> str:
    """Bytes as KiB, or MiB from 1 MiB up."""
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.1f} KiB"


def layout_rows(trainer: Trainer) -> list[tuple[str, str, str, str, int]]:
    """(path, shape, expression, typed layout, bytes per device) for every parameter."""
    import jax

    import einshard

    from ..models.transformer import AXES

    rows = []
    flat_exprs = jax.tree_util.tree_leaves(trainer.param_expressions)
    flat = jax.tree_util.tree_flatten_with_path(trainer.state["params"])[0]
    for (path, arr), expr in zip(flat, flat_exprs):
        typed = einshard.layout(expr, arr.shape, mesh=trainer.mesh)
        names = AXES.get(jax.tree_util.keystr(path), "").split()
        if len(names) == len(typed.axes) and any(a.startswith("...") for a in typed.axes):
            typed = dataclasses.replace(typed, axes=tuple(names))  # '...' axes shown by the model's names
        nbytes = typed.bytes_per_device(arr.dtype.itemsize)
        shape = "x".join(map(str, arr.shape))
        rows.append((jax.tree_util.keystr(path), shape, expr, str(typed), nbytes))
    return rows


def compiled_summary(compiled: Any) -> list[str]:
    """What XLA compiled for one step: the collectives it runs and memory per device (measured, not predicted).

    The collectives are counted as ``explain`` counts them (einshard.testing.hlo): a combined tuple op once per
    operand, a loop body once per iteration, CPU's all-reduce + dynamic-slice as a reduce-scatter; so the two
    totals printed by the demo compare directly.
    """
    from einshard.testing import hlo  # imported here: --help imports no JAX

    lines = []
    try:
        text = compiled.as_text()
    except Exception:  # some backends cannot print their executable
        text = ""
    runs: dict[str, int] = {}
    for c in hlo.normalized(text):
        runs[c.kind] = runs.get(c.kind, 0) + c.runs
    shown = ", ".join(f"{n} {kind}" for kind, n in sorted(runs.items())) or "none"
    total = f" ({sum(runs.values())} in all)" if len(runs) > 1 else ""
    lines.append(
        f"collectives XLA runs per step: {shown}{total} (counted as explain counts them: a combined op per operand, "
        "a loop body per iteration)"
    )
    try:
        mem = compiled.memory_analysis()
    except Exception:
        mem = None
    if mem is not None:
        lines.append(
            "memory per device (XLA): arguments "
            f"{kib(mem.argument_size_in_bytes)}, outputs {kib(mem.output_size_in_bytes)}, "
            f"temporaries {kib(mem.temp_size_in_bytes)}"
        )
    return lines


def print_plan(trainer: Trainer, say: Callable[[str], None]) -> None:
    """The plan of one layout, printed before training.

    Today: the mesh, every parameter's layout with its bytes per device, and
    what XLA compiled for the step.  When the analyzer is part of einshard
    (``einshard.explain``), its per-step plan (collectives per layer, bytes,
    FLOPs, estimated time) is printed here too.
    """
    import einshard

    mesh = ", ".join(f"{k}={v}" for k, v in trainer.mesh_sizes.items())
    say(f"mesh: {mesh}   batch: {trainer.preset.batch!r}  ({trainer.batch} x {trainer.cfg.seq + 1} tokens)")
    rows = layout_rows(trainer)
    w_path = max(len(r[0]) for r in rows)
    w_shape = max(len(r[1]) for r in rows)
    w_expr = max(len(repr(r[2])) for r in rows)
    w_typed = max(len(r[3]) for r in rows)
    say(f"  {'parameter':<{w_path}}  {'shape':<{w_shape}}  {'expression':<{w_expr}}  {'layout':<{w_typed}}  per device")
    for path, shape, expr, typed, nbytes in rows:
        say(f"  {path:<{w_path}}  {shape:<{w_shape}}  {expr!r:<{w_expr}}  {typed:<{w_typed}}  {kib(nbytes):>10}")
    weights, state = trainer.bytes_per_device()
    full = sum(_full_bytes(r[1]) for r in rows)
    say(f"  weights per device: {kib(weights)} of {kib(full)} ({weights / full:.0%}); with AdamW state: {kib(state)}")
    plan = getattr(trainer.step_fn, "plan", None)
    if plan is not None:  # an explicit program describes itself (rings, pipeline schedule)
        for line in plan(trainer.state, trainer.place_batch(trainer.step_index)):
            say("  " + line)
    explain = getattr(einshard, "explain", None)
    if explain is not None:
        say(str(explain(trainer.step_fn, trainer.state, trainer.place_batch(trainer.step_index))))
    for line in compiled_summary(trainer.compile(say)):
        say("  " + line)


def _full_bytes(shape_text: str) -> int:
    return math.prod(int(s) for s in shape_text.split("x")) * 4


def matches_reference(res: RunResult, ref: RunResult) -> tuple[bool, float]:
    """Whether ``res``'s losses agree with the reference's to float32 rounding, and the largest difference."""
    n = min(len(res.losses), len(ref.losses))
    if n == 0:
        return True, 0.0
    diff = max(abs(a - b) for a, b in zip(res.losses[:n], ref.losses[:n]))
    # Sharded sums add in another order: agreement to float32 rounding, grown a little by the optimizer.
    return diff <= 1e-4 * max(1.0, max(abs(x) for x in ref.losses[:n])), diff


def final_table(results: list[RunResult], reference: RunResult | None) -> list[str]:
    """One row per layout: mesh, memory per device, compile time, speed, loss, agreement with one device."""
    rows = [("layout", "mesh", "weights/dev", "+AdamW/dev", "compile", "tokens/s", "steps", "loss", "vs 1 device")]
    for r in ([reference] if reference else []) + results:
        last = f"{r.losses[-1]:.4f}" if r.losses else "-"
        if reference is None or r is reference:
            versus = "-"
        else:
            ok, diff = matches_reference(r, reference)
            versus = f"{'same' if ok else 'DIFFERS'} ({diff:.0e})"
        rows.append(
            (
                r.name,
                ",".join(f"{k}={v}" for k, v in r.mesh.items()),
                kib(r.param_bytes),
                kib(r.state_bytes),
                f"{r.compile_s:.1f}s",
                f"{r.tokens_per_s:,.0f}",
                f"{r.first_step + len(r.losses)}" + (" (stopped)" if r.interrupted else ""),
                last,
                versus,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def write_plot(path: str, results: list[RunResult], reference: RunResult | None) -> str:
    """Loss curves and per-parameter bytes per device, one line/bar group per layout (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot: matplotlib is not installed (pip install 'einshard[plot]'); {path} not written"
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in ([reference] if reference else []) + results:
        steps = range(r.first_step + 1, r.first_step + len(r.losses) + 1)
        left.plot(list(steps), r.losses, label=r.name, linestyle="--" if r is reference else "-")
    left.set_xlabel("step")
    left.set_ylabel("loss (nats/byte)")
    left.set_title("training loss")
    left.legend()
    names = list(results[0].per_param_bytes) if results else []
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        right.bar(
            [j + i * width for j in range(len(names))],
            [r.per_param_bytes[n] / 1024 for n in names],
            width,
            label=r.name,
        )
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(names))])
    right.set_xticklabels([n.replace("['", "").replace("']", ".").rstrip(".") for n in names], rotation=70, fontsize=7)
    right.set_ylabel("KiB per device")
    right.set_title("parameter bytes per device")
    right.legend()
    fig.tight_layout()
    fig.savefig(path)
    return f"plot written to {path}"
