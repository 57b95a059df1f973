"""``einshard.plan``: the entry point (groups → candidates → search → result)."""

from __future__ import annotations

import dataclasses
import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax

from .._checks import check_callable, check_int, check_int_sequence, check_number, describe_value
from ..analysis.cost import human_bytes, human_time
from ..analysis.program import trace
from ..core.logical import AxisRulesLike, takes_axis_rules
from ..errors import EinshardError
from .explanation import batch_strategy, explain_choice, short, strategy
from .groups import Group, batch_candidates, param_candidates, param_groups, search_candidates
from .inputs import OBJECTIVES, mesh_axes_of, parse_bytes, shape_of
from .pipelines import PipelineCost, PipelineSearch, best_pipeline, cost_pipelines
from .result import Alternative, LayoutPlan
from .roles import weight_roles
from .scoring import Costs, Score, preset_assignments, user_preset
from .search import exhaustive, guided_descent
from .verify import DEFAULT_VERIFY, Verified, verification_mesh, verify_assignments

if TYPE_CHECKING:
    from ..targets import Target

__all__ = ["plan"]

EXHAUSTIVE_LIMIT = 256
MAX_EVALUATIONS = 160
PAIR_LIMIT = 512
SMALL_GROUP_FRACTION = 1e-2

PresetRules = tuple[Mapping[str, str] | str, Mapping[str, str] | str | Sequence[Mapping[str, str] | str]]


# The smallest value each count of plan() takes: 0 where "none" means something (no exhaustive search, no
# restarts, no pairs, no alternatives), 1 where the search needs at least one.
_COUNT_MINIMUMS = {"exhaustive_limit": 0, "max_evaluations": 1, "restarts": 0, "pair_limit": 0, "n_alternatives": 0}


def _check_search_options(**options: Any) -> None:
    """plan()'s options, each wrong one an EinshardError naming it (before any tracing)."""
    where = "einshard.plan"
    indices: dict[str, tuple[int, ...]] = {}
    for name in ("param_args", "data_args"):
        if options[name] is not None:
            indices[name] = check_int_sequence(options[name], where, name)
    params = set(indices.get("param_args", (0,)))  # (plan's default: the first argument holds the parameters)
    if "data_args" in indices and params & set(indices["data_args"]):
        shared = sorted(params & set(indices["data_args"]))
        raise EinshardError(f"{where}: param_args= and data_args= both list argument {shared[0]}")
    if options["optimizer_bytes_per_param"] is not None:
        check_number(options["optimizer_bytes_per_param"], where, "optimizer_bytes_per_param", minimum=0)
    for name, minimum in _COUNT_MINIMUMS.items():
        check_int(options[name], where, name, minimum=minimum)
    check_int(options["seed"], where, "seed")
    presets = options["presets"]
    if presets is not None and (not isinstance(presets, Mapping) or not all(isinstance(k, str) for k in presets)):
        raise EinshardError(
            f"{where}: presets= takes {{name: (param_rules, data_rules)}}, got {describe_value(presets)}"
        )
    if options["pipeline"] is not None and not isinstance(options["pipeline"], PipelineSearch):
        raise EinshardError(
            f"{where}: pipeline= takes an einshard.planner.PipelineSearch, got {describe_value(options['pipeline'])}"
        )


@takes_axis_rules()
def plan(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Any = None,
    profile: Any = None,
    memory_budget: int | float | str | None = None,
    objective: str = "training",
    param_args: Sequence[int] | None = None,
    data_args: Sequence[int] | None = None,
    optimizer_bytes_per_param: float | None = None,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    max_evaluations: int = MAX_EVALUATIONS,
    restarts: int = 0,
    pair_limit: int = PAIR_LIMIT,
    seed: int = 0,
    presets: Mapping[str, PresetRules] | None = None,
    n_alternatives: int = 5,
    pipeline: PipelineSearch | None = None,
    verify: int | None = None,
    target: Any = None,
    axis_rules: AxisRulesLike | None = None,
    **kwargs: Any,
) -> LayoutPlan:
    """Choose einshard layouts for ``fn``'s parameters and batch: fastest within ``memory_budget``.

    Args:
        fn: a training step (or ``jax.value_and_grad`` of a loss) for ``'training'``, a forward pass for
            ``'inference'``; called as ``fn(*args, **kwargs)``.
        args: pytrees of arrays or ``jax.ShapeDtypeStruct``s; the first is the parameters, the rest data.
        mesh: a Mesh, an AbstractMesh, or axis sizes ``{'data': 256, 'model': 8}`` (plan a 2048-device
            mesh from sizes only); default the mesh of ``jax.set_mesh``, else the arguments' mesh.
        profile: hardware profile for time (``'h100'``, ``'tpu-v5p'``, ``'cpu'`` or an ``einshard.Profile``);
            default the profile of the machine this runs on (``cpu`` on a CPU, by ``jax.devices()[0].device_kind``
            on a GPU/TPU), named on the plan's first line.
        memory_budget: bytes per device (or ``'16GiB'``); None: no limit.
        objective: ``'training'`` / ``'inference'`` (step time), ``'memory'`` (bytes per device),
            ``'communication'`` (bytes sent per device).
        param_args, data_args: which positional arguments are parameters / data (default ``[0]`` / the rest);
            any other argument stays replicated.
        optimizer_bytes_per_param: optimizer state per parameter element (default 8, Adam's two f32
            moments, for ``'training'``; 0 otherwise).
        exhaustive_limit: search exhaustively when there are at most this many assignments.
        max_evaluations: otherwise, cost at most this many assignments (each walks the program once).
        restarts: extra random starts of the descent (besides data parallel and fully sharded).
        pair_limit: also try moving every two groups together when that is at most this many assignments.
        presets: hand-written layouts to cost alongside: ``{name: (param_rules, data_rules)}``; they appear
            in ``alternatives`` (``dp`` and ``fsdp`` are always there).  A preset that beats every
            assignment the search costed is returned as the plan (the explanation says so).
        axis_rules: a table from logical axis names to mesh axes, for ``@batch``-style names in the step's
            einshard calls and in ``presets`` (docs/logical-axes.md).
        pipeline: also cost pipeline layouts of the stacked layers (:class:`PipelineSearch`: the layer's
            activation shape, schedules, micro-batch counts) with the schedule model of
            :func:`einshard.pipeline_info`; the best appears in ``alternatives`` and is the plan when it
            beats every layout (e.g. where only a pipeline meets the memory budget).
        verify: compile the ``verify`` best assignments and the best preset with XLA (shapes only, on the
            mesh planned for) and choose by the compiled collectives and memory where they disagree with
            the prediction (:mod:`einshard.planner.verify`); ``result.verification`` shows predicted vs
            compiled.  Default: ``0`` when every op of ``fn`` has a layout rule, else
            :data:`~einshard.planner.verify.DEFAULT_VERIFY` (an incomplete model is never ranked on the
            prediction alone when its mesh's devices are here; the result says so when they are not).
        target: the hardware to plan for when it is not this machine's (:mod:`einshard.targets`):
            ``'tpu:v5p:4x4x4'`` (the profile, ``memory_budget`` and ``mesh`` default to the slice's chip,
            its HBM and :meth:`~einshard.targets.Target.default_mesh`; ``verify`` compiles with the TPU
            compiler over the slice's devices, shapes only: libtpu, ``pip install 'einshard[tpu]'``) or
            ``'gpu:h100x8'`` (a profile only: the plan says no compiler check was possible).

    Returns:
        A :class:`LayoutPlan`; ``result.rules`` plugs into ``einshard.einshard(params, result.rules, mesh=mesh)``.
    """
    start = time.perf_counter()
    check_callable(fn, "einshard.plan", "fn")
    if verify is not None and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 0):
        raise EinshardError(f"plan(): verify must be a count of candidates to compile (>= 0) or None, got {verify!r}")
    if objective not in OBJECTIVES:
        raise EinshardError(f"plan(): objective must be one of {OBJECTIVES}, got {objective!r}")
    _check_search_options(
        param_args=param_args,
        data_args=data_args,
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        exhaustive_limit=exhaustive_limit,
        max_evaluations=max_evaluations,
        restarts=restarts,
        pair_limit=pair_limit,
        seed=seed,
        presets=presets,
        n_alternatives=n_alternatives,
        pipeline=pipeline,
    )
    if not args:
        raise EinshardError("plan() needs the function's arguments (the parameters first)")
    tgt = _target_of(target)
    if tgt is not None:
        from ..targets import on_target

        mesh, profile = on_target(tgt, mesh, profile, "plan()")
        memory_budget = tgt.hbm_bytes if memory_budget is None else memory_budget
    budget = parse_bytes(memory_budget)
    mesh_axes = mesh_axes_of(mesh, args)
    p_idx = list(param_args) if param_args is not None else [0]
    d_idx = list(data_args) if data_args is not None else [i for i in range(len(args)) if i not in p_idx]
    for i in p_idx + d_idx:
        if not 0 <= i < len(args):
            raise EinshardError(f"plan(): argument index {i} in param_args/data_args, but fn gets {len(args)}")
    params = tuple(args[i] for i in p_idx) if len(p_idx) != 1 else args[p_idx[0]]
    opt_bytes = (
        optimizer_bytes_per_param
        if optimizer_bytes_per_param is not None
        else (8.0 if objective == "training" else 0.0)
    )
    traced = trace(fn, *args, mesh={m.name: m.size for m in mesh_axes}, profile=profile, **kwargs)
    groups, _ = param_groups(params, mesh_axes)
    total_param_bytes = sum(g.nbytes for g in groups) or 1
    groups = [
        dataclasses.replace(
            g, candidates=param_candidates(g, mesh_axes, g.nbytes < SMALL_GROUP_FRACTION * total_param_bytes)
        )
        for g in groups
    ]
    data_shapes = [shape_of(x) for i in d_idx for x in jax.tree_util.tree_leaves(args[i])]
    batch = Group("", "batch", (), tuple(data_shapes), (), 0, False, batch_candidates(data_shapes, mesh_axes), True)
    costs = Costs(traced, groups, batch, args, p_idx, d_idx, objective, budget, opt_bytes)
    # Each group's axes as its first matmul uses them (labels read (out, in) and 3-D kernels right).
    offsets = [sum(len(jax.tree_util.tree_leaves(args[j])) for j in range(i)) for i in p_idx]
    p_counts = [len(jax.tree_util.tree_leaves(args[i])) for i in p_idx]
    flat_of = [off + k for off, n in zip(offsets, p_counts) for k in range(n)]
    roles = [weight_roles(traced.jaxpr, flat_of[g.leaves[0]]) if g.leaves else {} for g in groups]
    counts = [len(g.candidates) for g in groups] + [len(batch.candidates)]
    space = math.prod(counts)
    presets_assign = preset_assignments(groups, batch)
    if space <= exhaustive_limit:
        method = "exhaustive"
        order = exhaustive(costs, counts)
    else:
        method = "coordinate descent"
        rng = random.Random(seed)
        starts = list(presets_assign.values()) + [tuple(rng.randrange(n) for n in counts) for _ in range(restarts)]
        sizes = {m.name: m.size for m in mesh_axes}
        allowed_cache: dict[tuple[int, int], tuple[int, ...]] = {}

        def allowed(g: int, b: int) -> tuple[int, ...]:
            if (g, b) not in allowed_cache:
                allowed_cache[(g, b)] = search_candidates(groups[g], batch.candidates[b].dims[0], sizes)
            return allowed_cache[(g, b)]

        order = guided_descent(costs, counts, starts, allowed, max(max_evaluations, len(starts)), pair_limit)
    best = order[0]

    def rules_of(assign: tuple[int, ...]) -> tuple[dict[str, str], tuple[dict[str, str | None], ...]]:
        rules = {g.pattern: g.expression(g.candidates[c]) for g, c in zip(groups, assign)}
        data_rules = []
        for i in d_idx:
            r: dict[str, str | None] = {}
            for path, x in jax.tree_util.tree_flatten_with_path(args[i])[0]:
                rank = len(shape_of(x))
                pattern = "^" + re.escape(jax.tree_util.keystr(path)) + "$"
                r[pattern] = batch.expression(batch.candidates[assign[-1]], rank) if rank else None
            data_rules.append(r)
        return rules, tuple(data_rules)

    def label_of(assign: tuple[int, ...]) -> str:
        bax = batch.candidates[assign[-1]].dims[0]
        names = [
            f"{short(g.display)}={strategy(g, g.candidates[c], bax, roles[k])}"
            for k, (g, c) in enumerate(zip(groups, assign))
            if g.candidates[c].sharded
        ]
        return batch_strategy(batch.candidates[assign[-1]]) + " · " + (", ".join(names) or "params replicated")

    def alternative(label: str, assign: tuple[int, ...]) -> Alternative:
        s = costs.score(assign)
        r, d = rules_of(assign)
        return Alternative(label, r, d, s.time_s, s.memory, s.comm, s.fits, s.compute_s)

    predicted = costs.score(best).report  # the search's choice: whether the model had a rule for every op
    n_verify = verify if verify is not None else (0 if predicted.complete else DEFAULT_VERIFY)
    verification: tuple[Verified, ...] = ()
    unverified = ""
    predicted_first = ""
    target_note = ""
    if tgt is not None and not tgt.compiles:
        target_note = tgt.note() + (f" (verify={n_verify} not run)" if n_verify else "")
        n_verify = 0
    elif tgt is not None:
        target_note = tgt.note()
    if n_verify:
        from ..targets import target_mesh

        try:
            vmesh = (
                verification_mesh(mesh, args, mesh_axes)
                if tgt is None
                else target_mesh(tgt, {m.name: m.size for m in mesh_axes})
            )
        except EinshardError as err:
            if verify is not None:
                raise
            unverified = str(err).splitlines()[0]
        else:
            candidates = [(label_of(a), a) for a in order[:n_verify]]
            predicted_first = candidates[0][0]
            name, preset = min(presets_assign.items(), key=lambda kv: costs.score(kv[1]).key)
            if preset not in order[:n_verify]:
                candidates.append((f"preset {name}", preset))
            rows = verify_assignments(
                fn,
                costs,
                candidates,
                vmesh,
                kwargs,
                hbm_bytes=None if tgt is None else tgt.hbm_bytes,
                compiler="XLA" if tgt is None else f"TPU compiler ({tgt.topology_name})",
            )
            verification = tuple(row for row, _ in rows)
            best = rows[0][1]
            order = [best] + [a for a in order if a != best]
    chosen = costs.score(best)
    alts = [alternative(label_of(a), a) for a in order[1 : 1 + n_alternatives]]
    preset_alts = [alternative(f"preset {n}", a) for n, a in presets_assign.items() if n not in (presets or {})]
    user: list[tuple[Alternative, Score]] = [user_preset(n, pr, pd, costs) for n, (pr, pd) in (presets or {}).items()]
    preset_alts += [alt for alt, _ in user]
    rules, data_rules = rules_of(best)
    bax = batch.candidates[best[-1]].dims[0]
    strategies = {g.display: strategy(g, g.candidates[c], bax, roles[k]) for k, (g, c) in enumerate(zip(groups, best))}
    strategies["batch"] = batch_strategy(batch.candidates[best[-1]])
    params_sharded = any(g.candidates[c].sharded for g, c in zip(groups, best))
    optimizer_bytes = costs.optimizer_bytes(best)
    beaten_by = min(user, key=lambda u: u[1].key, default=None)
    if beaten_by is not None and beaten_by[1].key < chosen.key:
        # A hand-written layout the candidates cannot express beat the search: return it.
        alt, chosen = beaten_by
        rules = alt.rules
        data_rules = alt.data_rules
        strategies = {"batch": alt.label, "parameters": "the preset's rules"}
        params_sharded = True
        optimizer_bytes = chosen.memory - chosen.report.peak_bytes
    pipe = None
    if pipeline is not None:
        pipes = cost_pipelines(pipeline, groups, batch, costs)
        by_schedule: dict[str, PipelineCost] = {}
        for p in pipes:
            b = by_schedule.get(p.candidate.schedule)
            if b is None or best_pipeline([p, b], objective) is p:
                by_schedule[p.candidate.schedule] = p
        best_pipe = best_pipeline(pipes, objective)
        for p in sorted(by_schedule.values(), key=lambda p: (not p.fits, p.time_s)):
            r, d = pipeline_rules(p, groups, batch, rules_of)
            alts.append(Alternative(p.candidate.label, r, d, p.time_s, p.memory, p.comm_bytes, p.fits, p.compute_s))
        if best_pipe is not None and _pipeline_wins(best_pipe, chosen, objective):
            pipe = best_pipe
            rules, data_rules = pipeline_rules(pipe, groups, batch, rules_of)
            strategies = {
                g.display: (f"pipeline({pipe.candidate.stage_axis})" if g.stacked else "replicated") for g in groups
            }
            strategies["batch"] = pipe.candidate.label
            params_sharded = True
    warning = ""
    if pipe is not None:
        fits = pipe.fits
        if not fits:
            warning = (
                f"no layout fits the memory budget: the least-bad needs {human_bytes(pipe.memory)}/device "
                f"> budget {human_bytes(budget or 0)}; returned anyway (fits=False)"
            )
        _say_what_stays_replicated(params, rules)
        return LayoutPlan(
            rules=rules,
            data_rules=data_rules,
            time_s=pipe.time_s,
            memory_bytes=pipe.memory,
            comm_bytes=pipe.comm_bytes,
            fits=fits,
            warning=warning,
            alternatives=tuple(alts + preset_alts),
            explanation=(
                f"chosen: {pipe.candidate.label}: {human_time(pipe.time_s)}/step, bubble "
                f"{pipe.bubble_fraction:.0%}, {human_bytes(pipe.memory)}/device (activations "
                f"{human_bytes(pipe.activation_bytes)}); the best layout jax.jit runs: "
                f"{human_time(chosen.time_s)}, {human_bytes(chosen.memory)}/device"
                + ("" if chosen.fits else " (over the budget)")
            ),
            report=chosen.report,
            strategies=strategies,
            objective=objective,
            memory_budget=budget,
            method=method,
            evaluated=len(costs.cache),
            space=space,
            planning_s=time.perf_counter() - start,
            compute_s=pipe.compute_s,
            pipeline=pipe,
            verification=verification,
        )
    if not chosen.fits:
        warning = (
            f"no layout fits the memory budget: the least-bad needs {human_bytes(chosen.memory)}/device "
            f"> budget {human_bytes(budget or 0)}; returned anyway (fits=False)"
        )
    explanation = explain_choice(
        chosen,
        optimizer_bytes,
        strategies,
        preset_alts,
        alts,
        budget,
        objective,
        warning,
        params_sharded,
        bax,
        tuple(m.name for m in mesh_axes if m.size > 1),
    )
    if beaten_by is not None and chosen is beaten_by[1]:
        unchecked = " (by the prediction: presets= are not compiled by verify)" if verification else ""
        explanation = (
            f"{beaten_by[0].label} beats every assignment searched{unchecked}; returned as the plan\n" + explanation
        )
    if verification:
        explanation = _verification_note(verification, predicted.complete, predicted_first) + explanation
    if target_note:
        explanation = target_note + "\n" + explanation
    if not predicted.complete and not verification:
        warning = (warning + "; " if warning else "") + (
            f"the model is incomplete (no layout rule for {', '.join(predicted.unfollowed)}) and the layouts are "
            f"ranked on the prediction alone: {unverified or 'verify=0'}"
        )
    _say_what_stays_replicated(params, rules)
    return LayoutPlan(
        rules=rules,
        data_rules=data_rules,
        time_s=chosen.time_s,
        memory_bytes=chosen.memory,
        comm_bytes=chosen.comm,
        fits=chosen.fits,
        warning=warning,
        alternatives=tuple(alts + preset_alts),
        explanation=explanation,
        report=chosen.report,
        strategies=strategies,
        objective=objective,
        memory_budget=budget,
        method=method,
        evaluated=len(costs.cache),
        space=space,
        planning_s=time.perf_counter() - start,
        compute_s=chosen.compute_s,
        verification=verification,
    )


def _verification_note(verification: tuple[Verified, ...], complete: bool, predicted_first: str) -> str:
    """The explanation's first line about the compiler's check: whether it agreed with the search's first."""
    why = "" if complete else "the model is incomplete, "
    chosen = next(v for v in verification if v.chosen)
    first = next(v for v in verification if v.label == predicted_first)
    line = f"verified with XLA ({why}{len(verification)} candidates compiled, shapes only): "
    if chosen is first:
        return line + f"the compiler agrees on {chosen.label}\n"
    return line + (
        f"chose {chosen.label} by the compiled numbers ({human_time(chosen.compiled_time_s)}/step, "
        f"{human_bytes(chosen.compiled_comm_bytes)} sent); the prediction's first, {first.label}, "
        f"compiles to {human_time(first.compiled_time_s)}/step, {human_bytes(first.compiled_comm_bytes)} sent\n"
    )


def pipeline_rules(
    pipe: PipelineCost, groups: list[Group], batch: Group, rules_of: Callable[..., Any]
) -> tuple[dict[str, str], tuple[dict[str, str | None], ...]]:
    """The stacked layers over the stage axis, the rest replicated; the batch over the data axes."""
    cand = pipe.candidate
    rules = {
        g.pattern: g.expression(
            dataclasses.replace(g.candidates[0], dims=((cand.stage_axis,), *g.candidates[0].dims[1:]))
        )
        if g.stacked
        else g.expression(g.candidates[0])
        for g in groups
    }
    b = next(i for i, c in enumerate(batch.candidates) if set(c.dims[0]) == set(cand.data_axes) and not c.dims[1])
    _, data_rules = rules_of((*(0 for _ in groups), b))
    return rules, data_rules


def _pipeline_wins(pipe: PipelineCost, chosen: Score, objective: str) -> bool:
    if pipe.fits != chosen.fits:
        return pipe.fits
    if not pipe.fits:
        return pipe.memory < chosen.memory
    primary = {"memory": float(pipe.memory), "communication": pipe.comm_bytes}.get(objective, pipe.time_s)
    return (primary, pipe.time_s) < (chosen.primary, chosen.time_s)


def _say_what_stays_replicated(params: Any, rules: Mapping[str, str]) -> None:
    """No rule set is silently empty (issue 22): the plan's rules, matched against the parameters they were
    planned for, warn (einshard.errors.EinshardWarning, from einshard.tree_rules) naming any leaf of
    LARGE_LEAF_BYTES or more they leave whole on every device, as placing them would."""
    from ..tree_rules import UNMATCHED, leaf_expressions

    leaf_expressions(params, rules, unmatched=UNMATCHED)


def _target_of(target: Any) -> Target | None:
    """The parsed target, checked up front: a TPU target needs libtpu (the ``[tpu]`` extra) before any work."""
    if target is None:
        return None
    from ..targets import parse_target, target_devices

    tgt = parse_target(target)
    if tgt.compiles:
        target_devices(tgt)
    return tgt
