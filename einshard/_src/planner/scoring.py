"""Scoring an assignment: what ``explain`` says the step costs under its layouts.

An *assignment* is a tuple of candidate indices, one per parameter group,
the batch's last.  Its score, all per device:

* **compute**: the FLOPs the device executes (``ProgramReport.flops``, which
  divides an einsum's FLOPs only by the mesh axes that split one of its
  indices: work replicated over an axis is counted in full on every device)
  over the profile's FLOP/s, plus, where the profile prices them, each
  product's kernel and the elementwise work on the elements it writes
  (:func:`unwalked_compute_s`: on XLA:CPU's small steps that work, not the
  FLOPs, is most of the compute);
* **communication**: the α–β time of the collectives ``explain`` finds, and
  the bytes they send;
* **memory**: ``explain``'s peak live bytes plus the optimizer state of the
  parameter elements the device holds.

Step time = compute + communication (no overlap), as ``explain`` prints it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax

from ..analysis.cost import Profile
from ..analysis.program import ProgramReport, TracedProgram
from ..analysis.program.oplog import OpLog
from ..core.layout import MeshAxis
from ..errors import EinshardError
from ..tree_rules import leaf_expressions
from .combining import CombinedCollectives, combined_report
from .groups import Group
from .inputs import shape_of
from .result import Alternative

__all__ = [
    "NEAR_TIE",
    "Score",
    "Costs",
    "like_params",
    "near_ties_first",
    "preset_assignments",
    "unwalked_compute_s",
    "user_preset",
]

# Predicted step times within this fraction of the best are one time to the cost model: a step's time is a sum of
# fitted prices (FLOP/s, a collective's α and β, XLA:CPU's kernel and element prices) that each stand for what the
# compiler does to within several percent (cpu profile: measured step times scatter 6-11% run to run,
# benchmarks/plan_prediction.py), so an order 1% apart is the model's rounding, not a faster layout.  Among such
# near-ties the plan takes what is certain instead: fewer bytes sent, then fewer FLOPs, then less memory
# (:func:`near_ties_first`).  1% keeps every real trade the model prices (a layout 2% faster by its prices still
# wins) and splits only ties like hk_stack's under a budget (282.51 against 282.73 ms, 32.1 against 24.2 MB).
NEAR_TIE = 0.01

_TIME_OBJECTIVES = ("training", "inference")
Ranked = TypeVar("Ranked", bound=Hashable)


@dataclass(frozen=True)
class Score:
    """One assignment's costs; ``key`` orders assignments (lower is better)."""

    fits: bool
    primary: float
    time_s: float
    compute_s: float
    memory: int
    comm: float
    sharded: int
    report: ProgramReport = field(compare=False, repr=False)
    comm_ops: int = 0  # collective ops XLA runs once combined (each repeat counted)

    @property
    def key(self) -> tuple[Any, ...]:
        t, c, p = settled(self.time_s), settled(self.comm), settled(self.primary)
        if not self.fits:
            return (1, self.memory, t, c, self.sharded)
        # Within the budget, among equally fast layouts the one that splits fewer parameters wins
        # (memory only breaks the remaining ties): a split that buys nothing the cost model sees is
        # a risk, not a gain.
        return (0, p, t, c, self.sharded, self.memory)

    @property
    def certain_key(self) -> tuple[float, float, int, int]:
        """How near-ties in time are ordered (:data:`NEAR_TIE`): bytes sent, FLOPs per device, then, as
        :attr:`key` does among equal times, fewer split parameters (a split that buys neither bytes nor FLOPs is
        a risk, not a gain), and memory last."""
        return (settled(self.comm), settled(self.report.flops), self.sharded, self.memory)


def _near(score: Score, best: Score, tolerance: float) -> bool:
    """Whether ``score`` fits and its time is within ``tolerance`` of ``best``'s (a fitting one's)."""
    return score.fits and score.primary <= best.primary * (1.0 + tolerance)


def near_ties_first(
    ranked: Sequence[Ranked], score: Callable[[Ranked], Score], objective: str, tolerance: float = NEAR_TIE
) -> list[Ranked]:
    """``ranked`` (assignments in :attr:`Score.key` order) with the fitting ones whose step time is within
    ``tolerance`` of the first's moved ahead, ordered by :attr:`Score.certain_key` (the key after it).  The band is
    anchored on the best time, so it is one set however the ties chain.  Other objectives (memory, bytes), and a
    best that does not fit the budget, keep the key's order: their primary measure is not a priced time."""
    if not ranked or objective not in _TIME_OBJECTIVES:
        return list(ranked)
    best = score(ranked[0])
    if not best.fits:
        return list(ranked)
    near = [a for a in ranked if _near(score(a), best, tolerance)]
    chosen = set(near)
    near.sort(key=lambda a: score(a).certain_key)  # stable: the key's order breaks the remaining ties
    return near + [a for a in ranked if a not in chosen]


def settled(x: float) -> float:
    """``x`` to 9 significant digits: sums of the same costs in another order differ in the last bits, and
    that noise must not decide between layouts the cost model prices alike (the tie-breaks after it do)."""
    return float(f"{x:.9g}")


@dataclass
class Costs:
    """Scores assignments with the traced program, remembering every one it costed."""

    traced: TracedProgram
    groups: list[Group]
    batch: Group
    args: tuple[Any, ...]
    p_idx: list[int]
    d_idx: list[int]
    objective: str
    budget: int | None
    opt_bytes: float
    cache: dict[tuple[int, ...], Score] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = {m.name: m.size for m in self.traced.mesh}
        params = self.params
        p_leaves, self.params_treedef = jax.tree_util.tree_flatten(params)
        self.n_param_leaves = len(p_leaves)
        self.data_structure = []
        for i in self.d_idx:
            flat, treedef = jax.tree_util.tree_flatten(self.args[i])
            self.data_structure.append((treedef, [len(shape_of(x)) for x in flat]))
        # Outputs that mirror the parameters (gradients, updated parameters) are laid out like them,
        # as a training step's out_shardings ask: FSDP gradients are reduce-scattered, not replicated.
        self.out_params = like_params(self.traced.out_shape, params)

    @property
    def params(self) -> Any:
        return tuple(self.args[i] for i in self.p_idx) if len(self.p_idx) != 1 else self.args[self.p_idx[0]]

    def in_specs(self, params_specs: Any, data_specs: list[Any]) -> tuple[Any, ...]:
        """The specs in ``fn``'s argument order (arguments neither parameters nor data: replicated)."""
        full: list[Any] = [None] * len(self.args)
        if len(self.p_idx) == 1:
            full[self.p_idx[0]] = params_specs
        else:
            for i, sub in zip(self.p_idx, params_specs):
                full[i] = sub
        for i, sub in zip(self.d_idx, data_specs):
            full[i] = sub
        for i in range(len(self.args)):
            if full[i] is None:
                full[i] = jax.tree_util.tree_map(lambda _: None, self.args[i])
        return tuple(full)

    def specs(self, assign: tuple[int, ...]) -> tuple[list[Any], list[Any]]:
        P = jax.sharding.PartitionSpec
        leaf_specs: list[Any] = [None] * self.n_param_leaves
        for g, c in zip(self.groups, assign):
            spec = P(*[(d if len(d) > 1 else d[0]) if d else None for d in g.candidates[c].dims])
            for i in g.leaves:
                leaf_specs[i] = spec
        data = self.batch.candidates[assign[-1]]
        out = []
        for treedef, ranks in self.data_structure:
            specs = []
            for r in ranks:
                dims: list[Any] = [None] * r
                if r >= 1 and data.dims[0]:
                    dims[0] = data.dims[0] if len(data.dims[0]) > 1 else data.dims[0][0]
                if r >= 2 and data.dims[1]:
                    dims[1] = data.dims[1][0]
                specs.append(P(*dims))
            out.append(jax.tree_util.tree_unflatten(treedef, specs))
        return leaf_specs, out

    def score(self, assign: tuple[int, ...]) -> Score:
        hit = self.cache.get(assign)
        if hit is not None:
            return hit
        leaf_specs, data_specs = self.specs(assign)
        params_specs = jax.tree_util.tree_unflatten(self.params_treedef, leaf_specs)
        out_specs = [None if i is None else leaf_specs[i] for i in self.out_params]
        report, combined = combined_report(self.traced, self.in_specs(params_specs, data_specs), out_specs)
        sharded = sum(g.candidates[c].sharded for g, c in zip(self.groups, assign))
        score = self.score_report(report, self.optimizer_bytes(assign), sharded, combined)
        self.cache[assign] = score
        return score

    def score_report(
        self, report: ProgramReport, optimizer_bytes: int, sharded: int = 0, combined: CombinedCollectives | None = None
    ) -> Score:
        memory = report.peak_bytes + optimizer_bytes
        fits = self.budget is None or memory <= self.budget
        # XLA merges independent collectives of one kind over the same axes: α once per merged op, where the
        # backend runs a merged op as one collective (not XLA:CPU: each piece pays its own, Profile.combined_latency).
        saves = combined is not None and report.profile.combined_latency == "once"
        small_ops = unwalked_compute_s(report)
        time_s = (
            report.time_s
            + small_ops
            + repriced_comm_s(report)
            - (combined.saved_s if saves and combined is not None else 0.0)
        )
        primary = {
            "training": time_s,
            "inference": time_s,
            "memory": float(memory),
            "communication": report.comm_bytes,
        }[self.objective]
        compute = report.flops / report.profile.flops + small_ops
        ops = combined.ops if combined is not None else report.comm_count
        return Score(fits, primary, time_s, compute, memory, report.comm_bytes, sharded, report, ops)

    def optimizer_bytes(self, assign: tuple[int, ...]) -> int:
        if not self.opt_bytes:
            return 0
        total = 0.0
        for g, c in zip(self.groups, assign):
            split = math.prod(self.sizes[m] for d in g.candidates[c].dims for m in d)
            total += sum(math.prod(s) for s in g.shapes) / split
        return int(total * self.opt_bytes)


def repriced_comm_s(report: ProgramReport) -> float:
    """Seconds to add to ``report.time_s`` for its collectives to cost what the profile's own law says
    (:meth:`Profile.pricing`) rather than the ring count the walk ranked them on (:meth:`Profile.walking`); 0 where the
    two are one profile.  The walk chooses the collectives XLA compiles, the profile prices them as they run: on
    ``cpu``, a rendezvous plus a price per peer of the group (``latency_steps='peers'``)."""
    walked = report.profile
    priced = walked.pricing() if isinstance(walked, Profile) else walked
    if priced is walked:
        return 0.0
    sizes = {m.name: m.size for m in report.mesh}
    ops = report.ops
    delta = 0.0
    for op in ops.cost_ops() if isinstance(ops, OpLog) else ops:
        for c in op.collectives:
            axis_sizes = tuple(sizes[a] for a in c.axes if a in sizes)
            if math.prod(axis_sizes) != c.group_size:  # a regrouped gather: one ring of its group, as cost.price
                axis_sizes = (c.group_size,)
            delta += op.repeat * (
                priced.collective_time(c.kind, c.group_size, c.bytes, c.array_bytes, axis_sizes) - c.time
            )
    return delta


def unwalked_compute_s(report: ProgramReport) -> float:
    """The compute ``report.flops`` leaves out, on the report's profile: per op that computes (a dot), the profile's
    fixed cost of a kernel, and the elementwise work on the activations the forward products write
    (:meth:`Profile.small_op_time`).

    The walk prices FLOPs only; a layer's bias, activation, norm and residual run on its products' results, so the
    elements a forward dot writes per device stand for that work: a layout that computes a product replicated (a
    batch left whole, a Megatron split's whole activations) also runs its elementwise work replicated.  Where the
    program has a backward, those elements are counted twice: the backward's elementwise ops are the transposes of
    the forward's, one on each cotangent, which has its value's shape.  A backward product's own result is not
    counted: an activation's cotangent is already (its forward value's), and no elementwise work follows a weight
    gradient; on XLA:CPU a product's result costs nothing measurable beyond its FLOPs (benchmarks/cpu_calibration.py
    --dots), so only the work that follows it is priced.  Zero on a profile with neither price (GPU, TPU: their
    FLOP/s already stand for a step's).
    """
    p = report.profile
    if not p.op_overhead and not p.element_time:
        return 0.0
    ops = report.ops
    dots = [
        (op.phase, op.repeat, op.out_layout)
        for op in (ops.cost_ops() if isinstance(ops, OpLog) else ops)
        if op.flops and op.out_layout is not None
    ]
    passes = 2 if any(phase == "backward" for phase, _, _ in dots) else 1
    total = 0.0
    for phase, repeat, out in dots:
        elements = passes * out.bytes_per_device(1) if phase == "forward" else 0
        total += repeat * p.small_op_time(elements)
    return total


def like_params(out_shape: Any, params: Any) -> list[int | None]:
    """Per output leaf, the parameter leaf it mirrors (gradients, updated parameters), else None."""
    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    p_shapes = [shape_of(x) for x in p_leaves]

    def match(tree: Any) -> list[int | None]:
        leaves, tdef = jax.tree_util.tree_flatten(tree)
        if tdef == p_def and [shape_of(x) for x in leaves] == p_shapes:  # type: ignore[operator]
            return list(range(len(leaves)))
        if isinstance(tree, (tuple, list)) and leaves and tree:
            return [i for sub in tree for i in match(sub)]
        return [None] * len(leaves)

    return match(out_shape)


def preset_assignments(groups: list[Group], batch: Group) -> dict[str, tuple[int, ...]]:
    """``dp`` (replicated parameters, the batch over every axis that divides) and ``fsdp``
    (each group's largest split over the batch's axes)."""
    best_batch = max(
        range(len(batch.candidates)),
        key=lambda c: (len(batch.candidates[c].dims[0]), -len(batch.candidates[c].dims[1])),
    )
    bax = set(batch.candidates[best_batch].dims[0])
    fsdp = []
    for g in groups:
        options = [
            (sum(len(d) for d in c.dims), -i, i)
            for i, c in enumerate(g.candidates)
            if all(m in bax for d in c.dims for m in d) and not (g.stacked and c.dims[0])
        ]
        fsdp.append(max(options)[2] if options else 0)
    return {"dp": (*(0 for _ in groups), best_batch), "fsdp": (*fsdp, best_batch)}


def _pick(name: str, rules: Any, tree: Any) -> Any:
    """Each leaf's expression by the one path-rule matcher (:mod:`einshard.tree_rules`, as ``einshard()`` reads rules)."""
    try:
        picked = leaf_expressions(tree, rules)
    except EinshardError as err:
        raise EinshardError(f"preset {name!r}: {err}") from None
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), picked)


def user_preset(
    name: str,
    prules: Mapping[str, str] | str,
    pdata: Mapping[str, str] | str | Sequence[Mapping[str, str] | str],
    costs: Costs,
) -> tuple[Alternative, Score]:
    """Cost a hand-written preset with the same model."""
    from ..core.layout import resolve_named
    from ..parsing import parse_placement

    args, p_idx, d_idx = costs.args, costs.p_idx, costs.d_idx
    data_list = [pdata] * len(d_idx) if isinstance(pdata, (Mapping, str)) else list(pdata)
    full: list[Any] = []
    for i in range(len(args)):
        if i in p_idx:
            full.append(_pick(name, prules, args[i]))
        elif i in d_idx:
            full.append(_pick(name, data_list[d_idx.index(i)], args[i]))
        else:
            full.append(jax.tree_util.tree_map(lambda _: None, args[i]))
    mesh: tuple[MeshAxis, ...] = costs.traced.mesh
    p_leaves = [x for i in p_idx for x in jax.tree_util.tree_leaves(args[i])]
    p_exprs = [e for i in p_idx for e in jax.tree_util.tree_leaves(full[i])]
    layouts = [resolve_named(parse_placement(e), shape_of(x), mesh) for e, x in zip(p_exprs, p_leaves)]
    p_specs = [jax.sharding.PartitionSpec(*lay.spec_entries()) for lay in layouts]
    out_specs = [None if i is None else p_specs[i] for i in costs.out_params]
    report, combined = combined_report(costs.traced, tuple(full), out_specs)
    opt = int(sum(math.prod(lay.shard_shape) for lay in layouts) * costs.opt_bytes)
    score = costs.score_report(report, opt, 0, combined)
    data_rules: tuple[dict[str, str | None], ...] = tuple(
        dict(d) if isinstance(d, Mapping) else {".*": d} for d in data_list
    )
    alt = Alternative(
        f"preset {name}",
        dict(prules) if isinstance(prules, Mapping) else {".*": prules},
        data_rules,
        score.time_s,
        score.memory,
        score.comm,
        score.fits,
        score.compute_s,
    )
    return alt, score
