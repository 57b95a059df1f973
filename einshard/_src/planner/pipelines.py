"""Pipeline candidates: the stacked layers split over a stage axis, run by a schedule, costed with its schedule model.

A pipeline layout is not a sharding ``jax.jit`` runs: it is
:func:`einshard.pipeline`'s program.  So it is its own candidate kind with its
own scoring, fed only by :func:`einshard.pipeline_info`'s public numbers
(bubble fraction, activation bytes, micro-batch shape) and by the
data-parallel costing of the same step (its FLOPs and live activations):

* **compute** per device: the step's FLOPs with the batch over the data axes,
  the stacked layers' share divided over the ``S`` stages, stretched by the
  schedule's idle share (``bubble_fraction``); the rest (embedding, head) is
  charged in full (it runs on its own stage, never in parallel with itself);
* **communication**: one collective-permute of a micro-batch per iteration,
  forward and backward, and one (combined) all-reduce of the stage's
  gradients over the data axes;
* **memory** per device: the stage's parameters and gradients (the stacked
  share over ``S``; the rest whole), optimizer state, and the schedule's
  activation bytes scaled by what one stashed layer input costs in live
  activations (read from the data-parallel costing: ``activation_factor``).

Schedules: ``gpipe``, ``circular`` (``repeats`` rounds), ``1f1b`` and
``interleaved`` (1F1B with ``repeats`` virtual stages).  A candidate the
lowering refuses (counts that do not divide) is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._checks import check_int, check_int_sequence, describe_value
from .._compat import dtype_itemsize
from ..errors import EinshardError

__all__ = [
    "Schedule",
    "SCHEDULES",
    "PipelineSearch",
    "PipelineCandidate",
    "PipelineModel",
    "PipelineCost",
    "pipeline_candidates",
    "score_pipeline",
]

Schedule = Literal["gpipe", "circular", "1f1b", "interleaved"]
SCHEDULES: tuple[Schedule, ...] = ("gpipe", "circular", "1f1b", "interleaved")


@dataclass(frozen=True)
class PipelineSearch:
    """Asks ``plan`` to cost pipeline layouts too (``plan(..., pipeline=PipelineSearch(hidden))``).

    Attributes:
        hidden: the activation one stacked layer maps to itself, for the whole batch
            (``jax.ShapeDtypeStruct((batch, seq, d_model), dtype)``).
        schedules: which schedules to cost.
        microbatches: micro-batch counts to try (per data-parallel replica).
        repeats: rounds (``circular``) or virtual stages (``interleaved``).
    """

    hidden: Any
    schedules: tuple[Schedule, ...] = SCHEDULES
    microbatches: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 2

    def __post_init__(self) -> None:
        shape = getattr(self.hidden, "shape", None)
        if shape is None or len(shape) < 1 or not hasattr(self.hidden, "dtype"):
            raise EinshardError(
                f"PipelineSearch(hidden=...) needs an array shape with a leading batch axis, got {self.hidden!r}"
            )
        where = "PipelineSearch"
        if not isinstance(self.schedules, (tuple, list)) or not self.schedules:
            raise EinshardError(
                f"{where}: schedules= takes a tuple of schedule names, got {describe_value(self.schedules)}"
            )
        bad = [s for s in self.schedules if not isinstance(s, str) or s not in SCHEDULES]
        if bad:
            raise EinshardError(f"{where}: schedules= names an unknown schedule {bad[0]!r}; choose from {SCHEDULES}")
        check_int_sequence(self.microbatches, where, "microbatches", minimum=1)
        if not self.microbatches:
            raise EinshardError(f"{where}: microbatches= takes at least one micro-batch count, got ()")
        check_int(self.repeats, where, "repeats", minimum=2)


@dataclass(frozen=True)
class PipelineCandidate:
    """One pipeline layout: which axis carries the stages, which the data, which schedule, how many micro-batches."""

    schedule: Schedule
    stage_axis: str
    data_axes: tuple[str, ...]
    microbatches: int
    repeats: int = 1

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of :func:`einshard.pipeline` / :func:`einshard.pipeline_info` for it."""
        schedule = "1f1b" if self.schedule == "interleaved" else self.schedule
        data = self.data_axes[0] if len(self.data_axes) == 1 else (self.data_axes or None)
        return {
            "schedule": schedule,
            "microbatches": self.microbatches,
            "repeats": self.repeats,
            "stage_axis": self.stage_axis,
            "data_axis": data,
        }

    @property
    def label(self) -> str:
        r = f", R={self.repeats}" if self.repeats > 1 else ""
        dp = f" · dp({','.join(self.data_axes)})" if self.data_axes else ""
        return f"pipeline {self.schedule} (stages over {self.stage_axis}, M={self.microbatches}{r}){dp}"


@dataclass(frozen=True)
class PipelineModel:
    """What scoring needs from the step, read from its data-parallel costing.

    Attributes:
        flops: FLOPs per device with the batch over the data axes and every layer local.
        stack_fraction: the share of those FLOPs in the stacked layers (their share of parameter elements).
        stack_bytes, other_bytes: parameter bytes of the stacked layers and of the rest.
        stack_elements, other_elements: the same in elements (optimizer state).
        activation_factor: live activation bytes per byte of stashed layer input (≥ 1).
    """

    flops: float
    stack_fraction: float
    stack_bytes: int
    other_bytes: int
    stack_elements: int
    other_elements: int
    activation_factor: float


@dataclass(frozen=True)
class PipelineCost:
    """A pipeline candidate's costs, per device, and the schedule numbers they came from."""

    candidate: PipelineCandidate
    info: Any  # einshard.lowering.pipeline.PipelineInfo
    time_s: float
    compute_s: float
    comm_bytes: float
    memory: int
    activation_bytes: int
    fits: bool

    @property
    def bubble_fraction(self) -> float:
        return float(self.info.bubble_fraction)


def pipeline_candidates(
    stack_params: Any, search: PipelineSearch, sizes: dict[str, int], layers: int
) -> list[tuple[PipelineCandidate, Any]]:
    """Every (candidate, ``pipeline_info``) the lowering accepts: each mesh axis that divides the layers as
    the stage axis, the other axes (of size > 1) as data axes where they divide the batch."""
    from ..lowering import pipeline_info

    batch = int(search.hidden.shape[0])
    out = []
    for stage in (a for a, n in sizes.items() if n > 1 and layers % n == 0):
        data = tuple(a for a, n in sizes.items() if a != stage and n > 1)
        while data and batch % math.prod(sizes[a] for a in data):
            data = data[:-1]
        for schedule in search.schedules:
            repeats = search.repeats if schedule in ("circular", "interleaved") else 1
            for m in search.microbatches:
                cand = PipelineCandidate(schedule, stage, data, m, repeats)
                try:
                    info = pipeline_info(stack_params, search.hidden, mesh=sizes, **cand.pipeline_kwargs())
                except EinshardError:
                    continue  # counts this schedule cannot run (micro-batches vs stages, layers vs repeats)
                out.append((cand, info))
    return out


def score_pipeline(
    cand: PipelineCandidate,
    info: Any,
    model: PipelineModel,
    profile: Any,
    sizes: dict[str, int],
    itemsize: int,
    budget: int | None,
    opt_bytes: float,
) -> PipelineCost:
    """The schedule model's time and memory for one candidate (module doc)."""
    stages = info.stages
    busy = max(1e-9, 1.0 - float(info.bubble_fraction))
    flops = model.flops * (model.stack_fraction / stages / busy + (1.0 - model.stack_fraction))
    compute = flops / profile.flops
    mb_bytes = math.prod(info.microbatch_shape) * itemsize
    # one permute of a micro-batch per iteration, forward and backward
    permutes = 2 * info.iterations
    comm_bytes = permutes * mb_bytes
    comm = permutes * profile.collective_time("collective-permute", stages, mb_bytes, mb_bytes)
    stage_bytes = model.stack_bytes / stages + model.other_bytes
    n_data = math.prod(sizes[a] for a in cand.data_axes)
    if n_data > 1:  # the stage's gradients, one combined all-reduce over the data axes
        sent = 2 * (n_data - 1) / n_data * stage_bytes
        axis_sizes = tuple(sizes[a] for a in cand.data_axes)
        comm += profile.collective_time("all-reduce", n_data, sent, stage_bytes, axis_sizes)
        comm_bytes += sent
    activations = int(info.activation_bytes * model.activation_factor)
    elements = model.stack_elements / stages + model.other_elements
    memory = int(2 * stage_bytes + opt_bytes * elements) + activations
    fits = budget is None or memory <= budget
    return PipelineCost(cand, info, compute + comm, compute, comm_bytes, memory, activations, fits)


def best_pipeline(costs: Sequence[PipelineCost], objective: str) -> PipelineCost | None:
    """The best candidate by the planner's order: fitting first, then the objective, then time, then memory."""

    def key(c: PipelineCost) -> tuple[Any, ...]:
        primary = {"memory": float(c.memory), "communication": c.comm_bytes}.get(objective, c.time_s)
        return (0, primary, c.time_s, c.memory) if c.fits else (1, c.memory, c.time_s)

    return min(costs, key=key, default=None)


def cost_pipelines(search: PipelineSearch, groups: Sequence[Any], batch: Any, costs: Any) -> list[PipelineCost]:
    """Every pipeline candidate of the planner's step, scored (``groups``/``batch``/``costs`` from ``plan``)."""
    import jax
    import numpy as np

    stacked = [g for g in groups if g.stacked]
    if not stacked:
        raise EinshardError(
            "plan(pipeline=...): no stacked layers to split into stages (a leading layer axis shared by the "
            "leaves under a 'layers'/'blocks'/'stack' key)"
        )
    layers = stacked[0].shapes[0][0]
    stack_params = {
        f"{g.display}#{k}": jax.ShapeDtypeStruct(s, np.float32) for g in stacked for k, s in enumerate(g.shapes)
    }
    sizes = dict(costs.sizes)
    stack_bytes = sum(g.nbytes for g in stacked)
    other_bytes = sum(g.nbytes for g in groups if not g.stacked)
    stack_el = sum(math.prod(s) for g in stacked for s in g.shapes)
    other_el = sum(math.prod(s) for g in groups if not g.stacked for s in g.shapes)
    itemsize = dtype_itemsize(search.hidden.dtype)
    hidden_bytes = math.prod(search.hidden.shape) * itemsize
    out = []
    models: dict[tuple[str, ...], PipelineModel | None] = {}
    for cand, info in pipeline_candidates(stack_params, search, sizes, layers):
        if cand.data_axes not in models:
            dp = _data_parallel(costs, groups, batch, cand.data_axes, layers, hidden_bytes, sizes)
            models[cand.data_axes] = (
                None
                if dp is None
                else PipelineModel(
                    dp[0], stack_el / max(1, stack_el + other_el), stack_bytes, other_bytes, stack_el, other_el, dp[1]
                )
            )
        model = models[cand.data_axes]
        if model is not None:
            profile = costs.traced.costs.profile.pricing()  # the stages' permutes priced as they run
            out.append(score_pipeline(cand, info, model, profile, sizes, itemsize, costs.budget, costs.opt_bytes))
    return out


def _data_parallel(
    costs: Any, groups: Sequence[Any], batch: Any, data: tuple[str, ...], layers: int, hidden: int, sizes: dict
) -> tuple[float, float] | None:
    """FLOPs per device and the activation factor, from the data-parallel costing over ``data``."""
    index = next((i for i, c in enumerate(batch.candidates) if set(c.dims[0]) == set(data) and not c.dims[1]), None)
    if index is None:
        return None
    score = costs.score((*(0 for _ in groups), index))
    n = math.prod(sizes[a] for a in data)
    params = sum(g.nbytes for g in groups)
    activations = max(0, score.report.peak_bytes - 2 * params)
    factor = max(1.0, activations / max(1.0, layers * hidden / n))
    return score.report.flops, factor
