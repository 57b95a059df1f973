"""What ``einshard.plan`` returns: the chosen rules, their costs, the runners-up, and why."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from ..analysis.cost import human_bytes, human_time
from ..analysis.program import ProgramReport
from ..core.mesh import MeshLike

__all__ = ["Alternative", "LayoutPlan"]


@dataclass(frozen=True)
class Alternative:
    """A costed assignment: its rules and what ``explain`` says it costs."""

    label: str
    rules: dict[str, str]
    data_rules: tuple[dict[str, str | None], ...]
    time_s: float
    memory_bytes: int
    comm_bytes: float
    fits: bool
    compute_s: float = 0.0  # of time_s, the compute (the rest is communication)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"data_rules": [dict(r) for r in self.data_rules]}

    def line(self) -> str:
        fit = "" if self.fits else "  (over budget)"
        return (
            f"{self.label:<34} {human_time(self.time_s):>10}/step (compute {human_time(self.compute_s)})  "
            f"{human_bytes(self.memory_bytes):>10}/device  {human_bytes(self.comm_bytes):>10} sent{fit}"
        )


@dataclass(frozen=True)
class LayoutPlan:
    """What ``einshard.plan`` chose, what it costs, and why.

    Attributes:
        rules: ordered mapping path pattern → expression for the parameters:
            ``einshard.einshard(params, result.rules, mesh=mesh)``.
        data_rules: one such mapping per data argument (``einshard(batch, result.data_rules[0], mesh=mesh)``).
        time_s, memory_bytes, comm_bytes: the choice's step time, memory per device
            (peak + optimizer state) and bytes sent per device.
        fits: whether ``memory_bytes`` is within the budget (True when there is none).
        warning: why the result does not fit, else ''.
        alternatives: the runners-up, best first, and the presets (``dp``, ``fsdp``, and yours).
        explanation: why this choice, in words.
        report: the :class:`~einshard.analysis.program.ProgramReport` of the choice.
        strategies: a short strategy name per parameter group (and ``batch``).
        method: ``'exhaustive'`` or ``'coordinate descent'``; evaluated: how many assignments were costed.
        verification: when ``plan(verify=k)`` compiled candidates (or the model was incomplete), each one's
            predicted and compiled numbers (:class:`~einshard.planner.verify.Verified`), the chosen marked; on
            a mesh with Explicit axes a layout JAX refuses is marked ``refused`` (its compiled numbers are then
            those of the same layout on Auto axes) and ranked after those it accepts.
        needs_auto_axes: where JAX refuses the chosen layout on the mesh's Explicit axes (it refused every
            verified candidate, or the unverified choice): its error and the user's line; the step, run as
            written, raises there, and runs the layout only under ``jax.sharding.auto_axes``.  '' otherwise.
            For a pipeline choice, the step as written with its layout (a scan over stage-split layers is
            refused so); the pipeline itself is :func:`einshard.pipeline`'s program.
        pipeline: when the choice is a pipeline (``plan(pipeline=PipelineSearch(...))``), its
            :class:`~.pipelines.PipelineCost` (schedule, micro-batches, bubble, activation bytes;
            ``pipeline.candidate.pipeline_kwargs()`` for :func:`einshard.pipeline`); ``report`` is then
            the data-parallel costing the schedule model started from.  None otherwise.
    """

    rules: dict[str, str]
    data_rules: tuple[dict[str, str | None], ...]
    time_s: float
    memory_bytes: int
    comm_bytes: float
    fits: bool
    warning: str
    alternatives: tuple[Alternative, ...]
    explanation: str
    report: ProgramReport = field(repr=False)
    strategies: dict[str, str] = field(default_factory=dict)
    objective: str = "training"
    memory_budget: int | None = None
    method: str = "exhaustive"
    evaluated: int = 0
    space: int = 0
    planning_s: float = 0.0
    compute_s: float = 0.0
    pipeline: Any = None
    verification: tuple[Any, ...] = ()  # einshard.planner.verify.Verified: predicted vs compiled, per candidate
    # JAX's refusal of the chosen layout on the mesh's Explicit axes ('' where it types the step, or the mesh has
    # none): the step runs it only under jax.sharding.auto_axes; the first line of str() says so.
    needs_auto_axes: str = ""

    def place(self, params: Any, *data: Any, mesh: MeshLike | None = None, axis_rules: Any = None) -> tuple[Any, ...]:
        """``(params, *data)`` laid out by the plan's rules (``einshard.einshard`` on each; ``axis_rules`` for
        logical names in a preset's rules)."""
        from ..placement import einshard

        placed = [einshard(params, self.rules, mesh=mesh, axis_rules=axis_rules)]
        placed += [einshard(x, rules, mesh=mesh, axis_rules=axis_rules) for x, rules in zip(data, self.data_rules)]
        return tuple(placed)

    def to_keras(self, params: Any, mesh: MeshLike) -> Any:
        """The parameters' layouts as a ``keras.distribution.LayoutMap`` (one exact key per variable path, as
        :func:`einshard.interop.keras_params` names them) for ``ModelParallel``."""
        from ..interop import to_keras

        return to_keras(self.rules, params, mesh)

    def to_flax(self, params: Any, mesh: MeshLike) -> Any:
        """The parameters' layouts as Flax logical rules plus per-variable names
        (:class:`einshard.interop.LogicalLayout`: ``.flax_rules()``, ``.names``)."""
        from ..interop import to_logical

        return to_logical(self.rules, params, mesh)

    def to_maxtext(self, params: Any, mesh: MeshLike) -> dict[str, Any]:
        """The parameters' layouts as MaxText data: ``{'logical_axis_rules': [...], 'logical_axes': {...}}``."""
        return self.to_flax(params, mesh).maxtext()  # type: ignore[no-any-return]

    def save_rules(self, path: str, mesh: dict[str, int] | None = None) -> None:
        """Write the choice as a rules file: ``{"params": {pattern: expression}, "batch": expression, "mesh": sizes}``.

        ``einshard demo --rules PATH`` reads it; ``einshard.einshard(params, json.load(f)["params"])``
        places parameters with it.  ``batch`` is the first data argument's expression when it is
        one array.
        """
        out: dict[str, Any] = {"params": self.rules}
        if self.data_rules and len(self.data_rules[0]) == 1:
            (expr,) = self.data_rules[0].values()
            if expr is not None:
                out["batch"] = expr
        if mesh is not None:
            out["mesh"] = dict(mesh)
        with open(path, "w") as f:
            json.dump(out, f, indent=2)
            f.write("\n")

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": dict(self.rules),
            "data_rules": [dict(r) for r in self.data_rules],
            "time_s": self.time_s,
            "memory_bytes": self.memory_bytes,
            "comm_bytes": self.comm_bytes,
            "fits": self.fits,
            "warning": self.warning,
            "objective": self.objective,
            "memory_budget": self.memory_budget,
            "strategies": dict(self.strategies),
            "method": self.method,
            "evaluated": self.evaluated,
            "space": self.space,
            "planning_s": self.planning_s,
            "compute_s": self.compute_s,
            "alternatives": [a.to_dict() for a in self.alternatives],
            "explanation": self.explanation,
            "profile": getattr(self.report.profile, "name", str(self.report.profile)),
            "complete": self.report.complete,
            "unfollowed_at": list(self.report.unfollowed_at),
            "verification": [v.to_dict() for v in self.verification],
            "needs_auto_axes": self.needs_auto_axes,
        }

    def __str__(self) -> str:
        budget = human_bytes(self.memory_budget) if self.memory_budget is not None else "none"
        profile = getattr(self.report.profile, "name", self.report.profile)
        checked = f", verified with {_compiler(self.verification)}" if self.verification else ""
        if not self.report.complete:
            checked = f", INCOMPLETE model (no layout rule for {', '.join(self.report.unfollowed)}){checked}"
        lines = [
            f"plan ({self.objective}, budget {budget}, profile {profile}{checked}): {human_time(self.time_s)}/step, "
            f"{human_bytes(self.memory_bytes)}/device, {human_bytes(self.comm_bytes)} sent/device"
            + ("" if self.fits else "  ** DOES NOT FIT **")
            + _compiled_summary(self.verification)
            + (
                "  ** NEEDS jax.sharding.auto_axes: JAX refuses this layout on the mesh's Explicit axes (why:) **"
                if self.needs_auto_axes
                else ""
            ),
            "rules:",
        ]
        width = max([len(p) for p in self.rules] + [10])
        for pattern, expr in self.rules.items():
            lines.append(f"  {pattern:<{width}}  {expr!r}")
        for i, data in enumerate(self.data_rules):
            for pattern, data_expr in data.items():
                lines.append(f"  data[{i}] {pattern:<{max(width - 8, 2)}}  {data_expr!r}")
        lines.append("why:")
        lines += ["  " + ln for ln in self.explanation.splitlines()]
        if self.alternatives:
            lines.append("alternatives:")
            lines += ["  " + a.line() for a in self.alternatives]
        if self.verification:
            lines.append(f"verified with {_compiler(self.verification)} (predicted -> compiled; * the plan):")
            lines += ["  " + v.line() for v in self.verification]
        lines.append(
            f"searched {self.evaluated} of {self.space} assignments ({self.method}) in {self.planning_s:.2f} s"
        )
        return "\n".join(lines)


def _compiler(verification: tuple[Any, ...]) -> str:
    """Whose compiler checked the candidates: XLA on this machine's devices, or a target's (the TPU compiler)."""
    return next((v.compiler for v in verification if v.compiler), "XLA")


def _compiled_summary(verification: tuple[Any, ...]) -> str:
    """The chosen candidate's compiled numbers, for the first line of a verified plan."""
    chosen = next((v for v in verification if v.chosen), None)
    if chosen is None:
        return ""
    on = " on Auto axes" if getattr(chosen, "refused", "") else ""  # not the Explicit mesh's program: said so
    return (
        f"  (compiled{on}: {human_time(chosen.compiled_time_s)}/step, {human_bytes(chosen.compiled_memory)}/device, "
        f"{human_bytes(chosen.compiled_comm_bytes)} sent/device)"
    )
