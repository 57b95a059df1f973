"""``einshard.plan``: the entry point (groups → candidates → search → result)."""

from __future__ import annotations

import dataclasses
import inspect
import math
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import jax

from .._checks import check_callable, check_int_sequence, check_number, describe_value
from ..analysis.cost import human_bytes, human_time
from ..analysis.program import trace
from ..core.layout import MeshAxis
from ..core.logical import AxisRulesLike, takes_axis_rules
from ..errors import EinshardError
from .explanation import batch_strategy, explain_choice, short, strategy
from .groups import Group, batch_candidates, param_candidates, param_groups, search_candidates
from .inputs import OBJECTIVES, Objective, devices_memory, mesh_axes_of, parse_bytes, shape_of
from .options import FIELDS, SearchOptions, search_options
from .pipelines import PipelineCost, PipelineSearch, best_pipeline, cost_pipelines
from .preset_match import admit_preset_layouts, expressible_presets
from .result import Alternative, LayoutPlan
from .roles import Parallel, megatron_pairs, weight_roles
from .scoring import Costs, Score, near_ties_first, preset_assignments, user_preset
from .search import exhaustive, guided_descent, sharded_parameters, tensor_parallel_starts
from .verify import (
    DEFAULT_VERIFY,
    Verified,
    collective_kinds,
    explicit_mesh_of,
    layout_specs,
    refused_on,
    typed_report,
    verification_mesh,
    verify_assignments,
)

if TYPE_CHECKING:
    from ..targets import Target

__all__ = ["plan"]

SMALL_GROUP_FRACTION = 1e-2

PresetRules = tuple[Mapping[str, str] | str, Mapping[str, str] | str | Sequence[Mapping[str, str] | str]]
Assign = tuple[int, ...]
Rules = tuple[dict[str, str], tuple[dict[str, str | None], ...]]


@takes_axis_rules()
def plan(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Any = None,
    profile: Any = None,
    memory_budget: int | float | str | None = None,
    objective: Objective = "training",
    param_args: Sequence[int] | None = None,
    data_args: Sequence[int] | None = None,
    optimizer_bytes_per_param: float | None = None,
    presets: Mapping[str, PresetRules] | None = None,
    pipeline: PipelineSearch | None = None,
    verify: int | None = None,
    target: Any = None,
    search: SearchOptions | None = None,
    axis_rules: AxisRulesLike | None = None,
    **kwargs: Any,
) -> LayoutPlan:
    """Choose einshard layouts for ``fn``'s parameters and batch: fastest within ``memory_budget``.

    Args:
        fn: a training step (or ``jax.value_and_grad`` of a loss) for ``'training'``, a forward pass for
            ``'inference'``; called as ``fn(*args, **kwargs)``: every keyword that is not ``plan``'s own reaches
            ``fn``.
        args: pytrees of arrays or ``jax.ShapeDtypeStruct``s; the first is the parameters, the rest data.
        mesh: a Mesh, an AbstractMesh, or axis sizes ``{'data': 256, 'model': 8}`` (plan a 2048-device
            mesh from sizes only); default the mesh of ``jax.set_mesh``, else the arguments' mesh.
        profile: hardware profile for time (``'h100'``, ``'tpu-v5p'``, ``'cpu'`` or an ``einshard.Profile``);
            default the profile of the machine this runs on (``cpu`` on a CPU, by ``jax.devices()[0].device_kind``
            on a GPU/TPU), named on the plan's first line.
        memory_budget: bytes per device (or ``'16GiB'``); default, when neither ``profile`` nor ``target`` is
            given (a plan for the machine this runs on): the memory of one of the mesh's devices on a GPU/TPU
            (``memory_stats()['bytes_limit']``), no limit on a CPU.
        objective: ``'training'`` / ``'inference'`` (step time), ``'memory'`` (bytes per device),
            ``'communication'`` (bytes sent per device).
        param_args, data_args: which positional arguments are parameters / data (default ``[0]`` / the rest);
            any other argument stays replicated.
        optimizer_bytes_per_param: optimizer state per parameter element (default 8, Adam's two f32
            moments, for ``'training'``; 0 otherwise).
        presets: hand-written layouts to cost alongside: ``{name: (param_rules, data_rules)}``; they appear
            in ``alternatives`` (``dp`` and ``fsdp`` are always there).  A preset that beats every
            assignment the search costed is returned as the plan (the explanation says so).
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
        search: how the search walks the assignments (:class:`~einshard.planner.SearchOptions`: the
            exhaustive limit, the descent's evaluations, restarts, pairs, seed, how many alternatives to list);
            None: the defaults.
        axis_rules: a table from logical axis names to mesh axes, for ``@batch``-style names in the step's
            einshard calls and in ``presets`` (docs/logical-axes.md).

    Returns:
        A :class:`LayoutPlan`; ``result.rules`` plugs into ``einshard.einshard(params, result.rules, mesh=mesh)``.
    """
    start = time.perf_counter()
    options = _check_arguments(
        fn, args, kwargs, objective, verify, param_args, data_args, optimizer_bytes_per_param, presets, pipeline, search
    )
    tgt = _target_of(target)
    if tgt is not None:
        from ..targets import on_target

        mesh, profile = on_target(tgt, mesh, profile, "plan()")
        memory_budget = tgt.hbm_bytes if memory_budget is None else memory_budget
    elif memory_budget is None and profile is None:
        # Planning for this machine's accelerators: what does not fit in their memory does not run.
        memory_budget = devices_memory(mesh, args)
    budget = parse_bytes(memory_budget)
    mesh_axes = mesh_axes_of(mesh, args)
    p_idx, d_idx = _argument_indices(args, param_args, data_args)
    params = tuple(args[i] for i in p_idx) if len(p_idx) != 1 else args[p_idx[0]]
    opt_bytes = (
        optimizer_bytes_per_param
        if optimizer_bytes_per_param is not None
        else (8.0 if objective == "training" else 0.0)
    )
    space = _space(fn, args, kwargs, mesh_axes, profile, params, p_idx, d_idx, objective, budget, opt_bytes)
    # The user's presets the candidates express join dp and fsdp: starts of the search, and compiled by verify=
    # when the model ranks one the best preset (a hand layout is otherwise only ever priced, never compiled).
    built_in = preset_assignments(space.groups, space.batch)  # before the presets' layouts join the candidates
    admit_preset_layouts(presets or {}, space.costs)
    expressed, _ = expressible_presets(presets or {}, space.costs)
    presets_assign = {**built_in, **expressed}
    method, order = _search(space, presets_assign, mesh_axes, options)
    # The search walks by the key; the ranking it returns settles near-ties in time by what is certain (bytes,
    # FLOPs, split parameters, memory: scoring.NEAR_TIE).
    order = near_ties_first(order, space.costs.score, objective)
    checked = _verify(fn, kwargs, space, order, presets_assign, verify, tgt, mesh, args, mesh_axes)
    run = _Run(
        space=space,
        order=checked.order,
        best=checked.order[0],
        presets_assign=presets_assign,
        presets=presets or {},
        expressed=tuple(expressed),
        options=options,
        objective=objective,
        budget=budget,
        method=method,
        start=start,
    )
    chosen = _choice(run)
    pipe = None
    if pipeline is not None:
        pipe_alternatives, pipe = _pipeline_choice(run, chosen, pipeline)
        chosen = dataclasses.replace(chosen, alternatives=chosen.alternatives + pipe_alternatives)
    if pipe is not None:
        _say_what_stays_replicated(params, pipe.rules)
        # On Explicit axes the pipeline's layout is traced typed as the einsum path's choice is: never silent.
        needs = (
            "" if checked.typed_on is None else _pipeline_refusal(fn, kwargs, run.space, pipe.cost, checked.typed_on)
        )
        return _pipeline_plan(run, chosen, pipe, checked.verification, needs)
    _say_what_stays_replicated(params, chosen.rules)
    return _layout_plan(run, chosen, checked, mesh_axes)


# -- checking the call ----------------------------------------------------------------------------------------------


def _check_arguments(
    fn: Any,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    objective: Any,
    verify: Any,
    param_args: Any,
    data_args: Any,
    optimizer_bytes_per_param: Any,
    presets: Any,
    pipeline: Any,
    search: Any,
) -> SearchOptions:
    """plan()'s arguments, each wrong one an EinshardError naming it (before any tracing); the search options."""
    where = "einshard.plan"
    check_callable(fn, where, "fn")
    if verify is not None and (isinstance(verify, bool) or not isinstance(verify, int) or verify < 0):
        raise EinshardError(f"plan(): verify must be a count of candidates to compile (>= 0) or None, got {verify!r}")
    if objective not in OBJECTIVES:
        raise EinshardError(f"plan(): objective must be one of {OBJECTIVES}, got {objective!r}")
    indices: dict[str, tuple[int, ...]] = {}
    for name, value in (("param_args", param_args), ("data_args", data_args)):
        if value is not None:
            indices[name] = check_int_sequence(value, where, name)
    params = set(indices.get("param_args", (0,)))  # (plan's default: the first argument holds the parameters)
    if "data_args" in indices and params & set(indices["data_args"]):
        shared = sorted(params & set(indices["data_args"]))
        raise EinshardError(f"{where}: param_args= and data_args= both list argument {shared[0]}")
    if optimizer_bytes_per_param is not None:
        check_number(optimizer_bytes_per_param, where, "optimizer_bytes_per_param", minimum=0)
    if presets is not None and (not isinstance(presets, Mapping) or not all(isinstance(k, str) for k in presets)):
        raise EinshardError(
            f"{where}: presets= takes {{name: (param_rules, data_rules)}}, got {describe_value(presets)}"
        )
    if pipeline is not None and not isinstance(pipeline, PipelineSearch):
        raise EinshardError(
            f"{where}: pipeline= takes an einshard.planner.PipelineSearch, got {describe_value(pipeline)}"
        )
    options = search_options(search, where)
    _check_step_keywords(fn, kwargs)
    if not args:
        raise EinshardError("plan() needs the function's arguments (the parameters first)")
    return options


def _check_step_keywords(fn: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """A search knob written as a keyword (as before ``search=``) goes to ``fn``; where ``fn`` takes no such
    keyword that would be a TypeError from inside the trace, so name the knob and its new home instead."""
    knobs = sorted(FIELDS & set(kwargs))
    if not knobs:
        return
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a callable object without a readable signature: let fn decide
        return
    takes = signature.parameters
    if any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        return
    for knob in knobs:
        if knob not in takes:
            raise EinshardError(
                f"einshard.plan: {knob}={kwargs[knob]!r} is a search option: pass "
                f"search=einshard.planner.SearchOptions({knob}={kwargs[knob]!r}) (plan's other keywords go to fn, "
                f"which takes no {knob}=)"
            )


def _argument_indices(
    args: tuple[Any, ...], param_args: Sequence[int] | None, data_args: Sequence[int] | None
) -> tuple[list[int], list[int]]:
    """Which positional arguments hold the parameters and which the data (default: the first, and the rest)."""
    p_idx = list(param_args) if param_args is not None else [0]
    d_idx = list(data_args) if data_args is not None else [i for i in range(len(args)) if i not in p_idx]
    for i in p_idx + d_idx:
        if not 0 <= i < len(args):
            raise EinshardError(f"plan(): argument index {i} in param_args/data_args, but fn gets {len(args)}")
    return p_idx, d_idx


# -- the space of assignments ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Space:
    """The traced step's groups and batch with their candidates, the costs, and how an assignment reads."""

    args: tuple[Any, ...]
    d_idx: list[int]
    groups: list[Group]
    batch: Group
    costs: Costs
    roles: list[dict[int, Literal["in", "out"]]]
    mesh_names: tuple[str, ...]
    parallel: dict[int, Parallel]  # group index -> how Megatron splits it (roles.megatron_pairs)

    @property
    def counts(self) -> list[int]:
        return [len(g.candidates) for g in self.groups] + [len(self.batch.candidates)]

    def rules_of(self, assign: Assign) -> Rules:
        rules = {g.pattern: g.expression(g.candidates[c]) for g, c in zip(self.groups, assign)}
        data_rules = []
        for i in self.d_idx:
            r: dict[str, str | None] = {}
            for path, x in jax.tree_util.tree_flatten_with_path(self.args[i])[0]:
                rank = len(shape_of(x))
                pattern = "^" + re.escape(jax.tree_util.keystr(path)) + "$"
                r[pattern] = self.batch.expression(self.batch.candidates[assign[-1]], rank) if rank else None
            data_rules.append(r)
        return rules, tuple(data_rules)

    def strategies(self, assign: Assign) -> dict[str, str]:
        """Each sharded group's strategy, by group display name (the label's parts)."""
        bax = self.batch.candidates[assign[-1]].dims[0]
        return {
            g.display: strategy(g, g.candidates[c], bax, self.roles[k])
            for k, (g, c) in enumerate(zip(self.groups, assign))
        }

    def label_of(self, assign: Assign) -> str:
        bax = self.batch.candidates[assign[-1]].dims[0]
        names = [
            f"{short(g.display)}={strategy(g, g.candidates[c], bax, self.roles[k])}"
            for k, (g, c) in enumerate(zip(self.groups, assign))
            if g.candidates[c].sharded
        ]
        return batch_strategy(self.batch.candidates[assign[-1]]) + " · " + (", ".join(names) or "params replicated")

    def alternative(self, label: str, assign: Assign) -> Alternative:
        s = self.costs.score(assign)
        r, d = self.rules_of(assign)
        return Alternative(label, r, d, s.time_s, s.memory, s.comm, s.fits, s.compute_s)


def _unplaced(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each placed array (or ShapeDtypeStruct with a sharding) as a bare ShapeDtypeStruct."""

    def bare(a: Any) -> Any:
        if getattr(a, "sharding", None) is None or not hasattr(a, "shape") or not hasattr(a, "dtype"):
            return a
        return jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=bool(getattr(a, "weak_type", False)))

    return tuple(jax.tree.map(bare, args))


def _space(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    mesh_axes: tuple[MeshAxis, ...],
    profile: Any,
    params: Any,
    p_idx: list[int],
    d_idx: list[int],
    objective: str,
    budget: int | None,
    opt_bytes: float,
) -> _Space:
    """Trace ``fn`` once; group the parameters and list each group's candidate layouts and the batch's."""
    # Traced on the arguments' shapes, not their placement: arrays already placed on Explicit axes would type the
    # program with their layout, and the typed rules would then price every candidate as if its values still
    # carried those types (a placed batch b@data made the dp preset gather what XLA never gathers).
    traced = trace(fn, *_unplaced(args), mesh={m.name: m.size for m in mesh_axes}, profile=profile, **kwargs)
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
    mesh_names = tuple(m.name for m in mesh_axes if m.size > 1)
    parallel = megatron_pairs(traced.jaxpr, {flat_of[leaf]: k for k, g in enumerate(groups) for leaf in g.leaves})
    return _Space(args, d_idx, groups, batch, costs, roles, mesh_names, parallel)


def _search(
    space: _Space, presets_assign: Mapping[str, Assign], mesh_axes: tuple[MeshAxis, ...], options: SearchOptions
) -> tuple[str, list[Assign]]:
    """The costed assignments, best first: every one when the space is small, else a guided coordinate descent
    from the presets (and ``options.restarts`` random starts)."""
    counts = space.counts
    if math.prod(counts) <= options.exhaustive_limit:
        return "exhaustive", exhaustive(space.costs, counts)
    rng = random.Random(options.seed)
    sizes = {m.name: m.size for m in mesh_axes}
    standard = tensor_parallel_starts(space.groups, space.batch, space.parallel, space.roles, sizes)
    randoms = [tuple(rng.randrange(n) for n in counts) for _ in range(options.restarts)]
    starts = list(dict.fromkeys([*presets_assign.values(), *randoms]))
    allowed_cache: dict[tuple[int, int], tuple[int, ...]] = {}

    def allowed(g: int, b: int) -> tuple[int, ...]:
        if (g, b) not in allowed_cache:
            # The mesh axes the batch's sequence uses gather a weight split over them as the batch's own do
            # (the activations are not split so on the weight's axes): both are FSDP to search_candidates.
            dims = space.batch.candidates[b].dims
            allowed_cache[(g, b)] = search_candidates(
                space.groups[g], dims[0] + dims[1], sizes, for_memory=space.costs.objective == "memory"
            )
        return allowed_cache[(g, b)]

    evaluations = max(options.max_evaluations, len(starts))
    # Under the memory objective each batch layout starts from its parameters split over every mesh axis (the
    # least parameter memory) rather than replicated: batch layouts are ranked by their best start, and with
    # replicated parameters that ranks them by the activations alone, so a batch layout whose best needs its
    # weights split over the mesh axes its sequence also uses was descended last, past the evaluation budget.
    base = sharded_parameters(space.groups) if space.costs.objective == "memory" else None
    return "coordinate descent", guided_descent(
        space.costs, counts, starts, allowed, evaluations, options.pair_limit, megatron=standard, base=base
    )


# -- the compiler's check -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Checked:
    """The ranking after ``verify=`` (the search's own when nothing was compiled) and what to say about it."""

    order: list[Assign]
    predicted: Any  # the search's first choice's ProgramReport: whether the model had a rule for every op
    verification: tuple[Verified, ...] = ()
    unverified: str = ""  # why no compile ran although the model is incomplete
    predicted_first: str = ""  # the search's first, by label, when the compiler ranked
    target_note: str = ""
    # The caller's mesh has Explicit axes: the prediction is the program XLA lays out by propagation (Auto axes').
    explicit: bool = False
    # JAX's refusal of the chosen layout on those Explicit axes ('' where it types): the step, run as written on
    # it, raises; it runs only under jax.sharding.auto_axes (or on Auto axes).
    needs_auto_axes: str = ""
    accepted_instead: str = ""  # with needs_auto_axes and no compile: the best-ranked layout JAX does type, if any
    # A mesh with the caller's Explicit axes to trace a layout typed on (None: Auto axes, sizes, or no devices).
    typed_on: jax.sharding.Mesh | None = None
    # Unverified on Explicit axes, where JAX types the choice: how explain's typed step of it differs from the
    # prediction (the untyped step's), '' where it does not.
    typed_note: str = ""


def _verify(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    space: _Space,
    order: list[Assign],
    presets_assign: Mapping[str, Assign],
    verify: int | None,
    tgt: Target | None,
    mesh: Any,
    args: tuple[Any, ...],
    mesh_axes: tuple[MeshAxis, ...],
) -> _Checked:
    """Compile the best few assignments and the best preset (``verify=``; by default when the model is
    incomplete) and rank them by the compiled numbers."""
    costs = space.costs
    predicted = costs.score(order[0]).report
    n_verify = verify if verify is not None else (0 if predicted.complete else DEFAULT_VERIFY)
    target_note = ""
    if tgt is not None and not tgt.compiles:
        target_note = tgt.note() + (f" (verify={n_verify} not run)" if n_verify else "")
        n_verify = 0
    elif tgt is not None:
        target_note = tgt.note()
    explicit, typed_on = explicit_mesh_of(mesh, args, mesh_axes) if tgt is None else (False, None)
    if not n_verify:
        # Unverified on Explicit axes: the prediction ranked the untyped program; whether JAX types the chosen
        # layout is one trace away, and a layout it refuses is said so (the plan's first line), never silently.
        needs = "" if typed_on is None else _typed_refusal(fn, kwargs, space, order[0], typed_on)
        accepted = (
            ""
            if not needs or typed_on is None
            else _accepted_instead(fn, kwargs, space, order, presets_assign, typed_on)
        )
        typed_note = "" if needs or typed_on is None else _typed_difference(fn, kwargs, space, order[0], typed_on)
        return _Checked(
            order,
            predicted,
            target_note=target_note,
            explicit=explicit,
            needs_auto_axes=needs,
            accepted_instead=accepted,
            typed_on=typed_on,
            typed_note=typed_note,
        )
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
        return _Checked(
            order,
            predicted,
            unverified=str(err).splitlines()[0],
            target_note=target_note,
            explicit=explicit,
            typed_on=typed_on,
        )
    candidates = [(space.label_of(a), a) for a in order[:n_verify]]
    name, preset = min(presets_assign.items(), key=lambda kv: costs.score(kv[1]).key)
    if preset not in order[:n_verify]:
        candidates.append((f"preset {name}", preset))
    rows = verify_assignments(
        fn,
        costs,
        candidates,
        vmesh,
        dict(kwargs),
        hbm_bytes=None if tgt is None else tgt.hbm_bytes,
        compiler="XLA" if tgt is None else f"TPU compiler ({tgt.topology_name})",
    )
    best = rows[0][1]
    return _Checked(
        order=[best] + [a for a in order if a != best],
        predicted=predicted,
        verification=tuple(row for row, _ in rows),
        predicted_first=candidates[0][0],
        target_note=target_note,
        explicit=explicit,
        needs_auto_axes=rows[0][0].refused,
        typed_on=typed_on,
    )


def _typed_difference(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], space: _Space, assign: Assign, mesh: jax.sharding.Mesh
) -> str:
    """Where explain's typed step of ``assign`` on ``mesh``'s Explicit axes moves other collectives than the
    prediction (the untyped step, laid out by propagation as on Auto axes), or 10% more or fewer bytes: a line
    saying both; '' where they agree.  The search ranks the untyped step (a trace for all layouts); JAX types each
    op of the step a user runs from the arguments' layouts, and lays some out otherwise (a replicated weight
    gathered where propagation keeps a partial sum)."""
    from .verify import candidate_of

    c = candidate_of(space.costs, 0, "", assign)
    untyped = c.score.report
    try:
        typed = typed_report(fn, space.costs.args, c.in_specs, c.out_specs, mesh, untyped.profile, **kwargs)
    except EinshardError as err:  # JAX types it (the caller checked); explain cannot price it: said, not skipped
        return (
            "APPROXIMATE on this mesh's Explicit axes: the prediction is the untyped step's, and explain could not "
            f"price the typed step ({str(err).splitlines()[0]}); verify=k compiles it"
        )
    kinds, typed_kinds = collective_kinds(untyped), collective_kinds(typed)
    if kinds == typed_kinds and abs(typed.comm_bytes - untyped.comm_bytes) <= 0.1 * max(untyped.comm_bytes, 1.0):
        return ""

    def said(report: Any, by_kind: dict[str, int]) -> str:
        shown = ", ".join(f"{n} {k}" for k, n in sorted(by_kind.items())) or "no collective"
        return f"{human_bytes(report.comm_bytes)}/device ({shown})"

    return (
        f"APPROXIMATE on this mesh's Explicit axes: the typed step of this layout (explain's) sends {said(typed, typed_kinds)}"
        f" against the prediction's {said(untyped, kinds)}, the untyped step's: JAX types every op from the arguments'"
        " layouts and lays some out otherwise than propagation; verify=k compiles the typed step"
    )


# How many of the next-ranked layouts an unverified plan traces typed, when JAX refuses its choice, to name the best
# one JAX accepts (a trace each: ~8 ms CPU for the demo transformer's step, against 2.7 s for its plan).
ACCEPTED_SEARCH = 8


def _accepted_instead(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    space: _Space,
    order: list[Assign],
    presets_assign: Mapping[str, Assign],
    mesh: jax.sharding.Mesh,
) -> str:
    """Where JAX refuses the unverified choice: the best by the prediction of the next :data:`ACCEPTED_SEARCH`
    ranked layouts and the presets that JAX types on ``mesh``, with its predicted time against the choice's ('' where
    none of them types)."""
    chosen = space.costs.score(order[0])
    named = {a: space.label_of(a) for a in order[1 : 1 + ACCEPTED_SEARCH]}
    for name, a in presets_assign.items():
        named.setdefault(a, f"preset {name}")
    for assign in sorted(named, key=lambda a: space.costs.score(a).key):
        if assign != order[0] and not _typed_refusal(fn, kwargs, space, assign, mesh):
            score = space.costs.score(assign)
            slower = score.time_s / chosen.time_s - 1 if chosen.time_s else 0.0
            return f"{named[assign]} (predicted {human_time(score.time_s)}/step, {slower:+.0%})"
    return ""


def _typed_refusal(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], space: _Space, assign: Assign, mesh: jax.sharding.Mesh
) -> str:
    """JAX's refusal of ``assign``'s layouts on ``mesh``'s Explicit axes ('' where it types the step), traced as
    ``verify=`` compiles it (the parameters' outputs laid out like them)."""
    from .verify import candidate_of

    c = candidate_of(space.costs, 0, "", assign)
    return refused_on(fn, space.costs.args, c.in_specs, c.out_specs, mesh, **kwargs)


# -- the choice -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Run:
    """One plan() call after the search: what the result is built from."""

    space: _Space
    order: list[Assign]
    best: Assign
    presets_assign: Mapping[str, Assign]
    presets: Mapping[str, PresetRules]
    expressed: tuple[str, ...]  # the user's presets that are assignments (searched and verified as such)
    options: SearchOptions
    objective: str
    budget: int | None
    method: str
    start: float


@dataclasses.dataclass(frozen=True)
class _Choice:
    """The layout chosen among the searched assignments and the user's presets, with what the result lists."""

    score: Score
    rules: dict[str, str]
    data_rules: tuple[dict[str, str | None], ...]
    strategies: dict[str, str]
    params_sharded: bool
    optimizer_bytes: int
    alternatives: list[Alternative]
    preset_alternatives: list[Alternative]
    beaten_by: Alternative | None  # the user's preset returned as the plan because it beat every assignment


def _choice(run: _Run) -> _Choice:
    """The search's best, unless a user's preset (a layout the candidates cannot express) beats it."""
    space, best = run.space, run.best
    costs = space.costs
    chosen = costs.score(best)
    alts = [space.alternative(space.label_of(a), a) for a in run.order[1 : 1 + run.options.n_alternatives]]
    preset_alts = [space.alternative(f"preset {n}", a) for n, a in run.presets_assign.items() if n not in run.presets]
    user: list[tuple[Alternative, Score]] = [user_preset(n, pr, pd, costs) for n, (pr, pd) in run.presets.items()]
    preset_alts += [alt for alt, _ in user]
    # A preset that is an assignment already competed in the search (and in verify='s compiled ranking, which
    # must not be overruled by the prediction): only the others can beat the choice here.
    outside = [u for u, n in zip(user, run.presets) if n not in run.expressed]
    # Ranked with the choice as the search's order is (scoring.near_ties_first: near-ties in time by bytes sent).
    contenders = [chosen, *(score for _, score in outside)]
    by_key = sorted(range(len(contenders)), key=lambda i: contenders[i].key)  # stable: the choice wins equal keys
    first = near_ties_first(by_key, contenders.__getitem__, run.objective)[0]
    beaten_by = outside[first - 1] if first else None
    if beaten_by is not None:
        # A hand-written layout the candidates cannot express beat the search: return it.
        alt, score = beaten_by
        return _Choice(
            score=score,
            rules=alt.rules,
            data_rules=alt.data_rules,
            strategies={"batch": alt.label, "parameters": "the preset's rules"},
            params_sharded=True,
            optimizer_bytes=score.memory - score.report.peak_bytes,
            alternatives=alts,
            preset_alternatives=preset_alts,
            beaten_by=alt,
        )
    rules, data_rules = space.rules_of(best)
    strategies = space.strategies(best)
    strategies["batch"] = batch_strategy(space.batch.candidates[best[-1]])
    return _Choice(
        score=chosen,
        rules=rules,
        data_rules=data_rules,
        strategies=strategies,
        params_sharded=any(g.candidates[c].sharded for g, c in zip(space.groups, best)),
        optimizer_bytes=costs.optimizer_bytes(best),
        alternatives=alts,
        preset_alternatives=preset_alts,
        beaten_by=None,
    )


@dataclasses.dataclass(frozen=True)
class _PipelineChoice:
    """The pipeline layout that beats every layout ``jax.jit`` runs, with its rules."""

    cost: PipelineCost
    rules: dict[str, str]
    data_rules: tuple[dict[str, str | None], ...]


def _pipeline_choice(
    run: _Run, chosen: _Choice, search: PipelineSearch
) -> tuple[list[Alternative], _PipelineChoice | None]:
    """Cost the pipeline layouts: the best of each schedule as alternatives, and the best one when it beats the
    chosen layout."""
    space = run.space
    pipes = cost_pipelines(search, space.groups, space.batch, space.costs)
    by_schedule: dict[str, PipelineCost] = {}
    for p in pipes:
        b = by_schedule.get(p.candidate.schedule)
        if b is None or best_pipeline([p, b], run.objective) is p:
            by_schedule[p.candidate.schedule] = p
    best_pipe = best_pipeline(pipes, run.objective)
    alternatives = []
    for p in sorted(by_schedule.values(), key=lambda p: (not p.fits, p.time_s)):
        r, d = pipeline_rules(p, space.groups, space.batch, space.rules_of)
        alternatives.append(Alternative(p.candidate.label, r, d, p.time_s, p.memory, p.comm_bytes, p.fits, p.compute_s))
    if best_pipe is None or not _pipeline_wins(best_pipe, chosen.score, run.objective):
        return alternatives, None
    rules, data_rules = pipeline_rules(best_pipe, space.groups, space.batch, space.rules_of)
    return alternatives, _PipelineChoice(best_pipe, rules, data_rules)


def _over_budget(memory: int | float, budget: int | None) -> str:
    return (
        f"no layout fits the memory budget: the least-bad needs {human_bytes(memory)}/device "
        f"> budget {human_bytes(budget or 0)}; returned anyway (fits=False)"
    )


def _pipeline_plan(
    run: _Run, chosen: _Choice, pipe_choice: _PipelineChoice, verification: tuple[Verified, ...], needs: str = ""
) -> LayoutPlan:
    """The LayoutPlan of a winning pipeline layout; ``needs``: JAX's refusal of the step as written with that
    layout on the mesh's Explicit axes ('' where it types it, or the axes are Auto)."""
    pipe, score = pipe_choice.cost, chosen.score
    warning = "" if pipe.fits else _over_budget(pipe.memory, run.budget)
    refused = ""
    if needs:
        warning = (warning + "; " if warning else "") + (
            f"needs jax.sharding.auto_axes: JAX refuses the chosen layout on the mesh's Explicit axes: {needs}"
        )
        refused = (
            f"\nJAX refuses the step as written with this layout on the mesh's Explicit axes: {needs}; the pipeline "
            "is einshard.pipeline(layer_fn, params, x, **plan.pipeline.candidate.pipeline_kwargs()) inside the step "
            "(its shard_map takes the stage-split layers), and the step as written runs this layout only under "
            "jax.sharding.auto_axes (or on a mesh with Auto axes), as a layout jax.jit lays out, not a pipeline"
        )
    strategies = {
        g.display: (f"pipeline({pipe.candidate.stage_axis})" if g.stacked else "replicated") for g in run.space.groups
    }
    strategies["batch"] = pipe.candidate.label
    return LayoutPlan(
        rules=pipe_choice.rules,
        data_rules=pipe_choice.data_rules,
        time_s=pipe.time_s,
        memory_bytes=pipe.memory,
        comm_bytes=pipe.comm_bytes,
        fits=pipe.fits,
        warning=warning,
        alternatives=tuple(chosen.alternatives + chosen.preset_alternatives),
        explanation=(
            f"chosen: {pipe.candidate.label}: {human_time(pipe.time_s)}/step, bubble "
            f"{pipe.bubble_fraction:.0%}, {human_bytes(pipe.memory)}/device (activations "
            f"{human_bytes(pipe.activation_bytes)}); the best layout jax.jit runs: "
            f"{human_time(score.time_s)}, {human_bytes(score.memory)}/device"
            + ("" if score.fits else " (over the budget)")
            + refused
        ),
        report=score.report,
        strategies=strategies,
        objective=run.objective,
        memory_budget=run.budget,
        method=run.method,
        evaluated=len(run.space.costs.cache),
        space=math.prod(run.space.counts),
        planning_s=time.perf_counter() - run.start,
        compute_s=pipe.compute_s,
        pipeline=pipe,
        verification=verification,
        needs_auto_axes=needs,
    )


def _layout_plan(run: _Run, chosen: _Choice, checked: _Checked, mesh_axes: tuple[MeshAxis, ...]) -> LayoutPlan:
    """The LayoutPlan of the chosen layout (searched or a user's preset), with its explanation."""
    score = chosen.score
    warning = "" if score.fits else _over_budget(score.memory, run.budget)
    explanation = explain_choice(
        score,
        chosen.optimizer_bytes,
        chosen.strategies,
        chosen.preset_alternatives,
        chosen.alternatives,
        run.budget,
        run.objective,
        warning,
        chosen.params_sharded,
        run.space.batch.candidates[run.best[-1]].dims[0],
        run.space.mesh_names,
    )
    if chosen.beaten_by is not None:
        unchecked = " (by the prediction: presets= are not compiled by verify)" if checked.verification else ""
        explanation = (
            f"{chosen.beaten_by.label} beats every assignment searched{unchecked}; returned as the plan\n" + explanation
        )
    # The refusal is the searched choice's: a user's preset that beat it is another layout (priced, not traced).
    needs = checked.needs_auto_axes if chosen.beaten_by is None else ""
    if checked.verification:
        explanation = (
            _verification_note(
                checked.verification, checked.predicted.complete, checked.predicted_first, checked.explicit
            )
            + explanation
        )
    elif needs:
        runs = (
            f"the best-ranked layout JAX accepts is {checked.accepted_instead}"
            if checked.accepted_instead
            else f"JAX refuses the next {ACCEPTED_SEARCH} ranked layouts and the presets too"
        )
        explanation = (
            f"JAX refuses this layout on the mesh's Explicit axes: {needs}; the step runs it only "
            f"under jax.sharding.auto_axes (or on a mesh with Auto axes); {runs}; verify=k compiles the best k and "
            "chooses among those JAX accepts\n" + explanation
        )
    if checked.explicit and not checked.verification:
        explanation += (
            "\npredicted for the step as XLA lays it out by propagation (Auto axes); on this mesh's Explicit axes "
            "JAX types every op from the arguments' layouts, and the compiled collectives can differ: verify=k "
            "compiles the typed program"
        )
        if checked.typed_note and chosen.beaten_by is None:  # (the note is the searched choice's, as needs is)
            explanation += "\n" + checked.typed_note
    if needs:
        warning = (warning + "; " if warning else "") + (
            f"needs jax.sharding.auto_axes: JAX refuses the chosen layout on the mesh's Explicit axes: {needs}"
        )
    if checked.target_note:
        explanation = checked.target_note + "\n" + explanation
    if not checked.predicted.complete and not checked.verification:
        warning = (warning + "; " if warning else "") + (
            f"the model is incomplete (no layout rule for {', '.join(checked.predicted.unfollowed)}) and the "
            f"layouts are ranked on the prediction alone: {checked.unverified or 'verify=0'}"
        )
    return LayoutPlan(
        rules=chosen.rules,
        data_rules=chosen.data_rules,
        time_s=score.time_s,
        memory_bytes=score.memory,
        comm_bytes=score.comm,
        fits=score.fits,
        warning=warning,
        alternatives=tuple(chosen.alternatives + chosen.preset_alternatives),
        explanation=explanation,
        report=score.report,
        strategies=chosen.strategies,
        objective=run.objective,
        memory_budget=run.budget,
        method=run.method,
        evaluated=len(run.space.costs.cache),
        space=math.prod(run.space.counts),
        planning_s=time.perf_counter() - run.start,
        compute_s=score.compute_s,
        verification=checked.verification,
        needs_auto_axes=needs,
    )


def _verification_note(
    verification: tuple[Verified, ...], complete: bool, predicted_first: str, explicit: bool = False
) -> str:
    """The explanation's first line about the compiler's check: whether it agreed with the search's first, and
    which candidates JAX refused on the mesh's Explicit axes (ranked last, their numbers Auto axes')."""
    why = "" if complete else "the model is incomplete, "
    chosen = next(v for v in verification if v.chosen)
    first = next(v for v in verification if v.label == predicted_first)
    refused = [v for v in verification if v.refused]
    line = f"verified with {chosen.compiler or 'XLA'} ({why}{len(verification)} candidates compiled, shapes only): "
    if explicit:
        # On Explicit axes the two columns are two programs: the prediction ranks the untyped step (as XLA
        # propagates it on Auto axes), the compile is the typed step; where they differ the compile decides.
        line += "predicted as the untyped step (Auto axes' propagation), compiled as the typed step; "
    if refused:
        line += (
            f"JAX refuses {len(refused)} of them on the mesh's Explicit axes (each row says where; compiled on Auto "
            "axes instead, ranked after those it accepts); "
        )
    if chosen.refused:
        return line + (
            f"none is accepted: chose {chosen.label} by its Auto-axes compile ({human_time(chosen.compiled_time_s)}"
            f"/step, {human_bytes(chosen.compiled_comm_bytes)} sent); it NEEDS jax.sharding.auto_axes: "
            f"{chosen.refused}\n"
        )
    if chosen is first:
        return line + f"the compiler agrees on {chosen.label}\n"
    if first.refused:
        return line + (
            f"chose {chosen.label}, the best JAX accepts, by the compiled numbers ({human_time(chosen.compiled_time_s)}"
            f"/step, {human_bytes(chosen.compiled_comm_bytes)} sent); the prediction's first, {first.label}, is "
            f"refused: {first.refused}; on Auto axes it compiles to {human_time(first.compiled_time_s)}/step, "
            f"{human_bytes(first.compiled_comm_bytes)} sent\n"
        )
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
    _, data_rules = rules_of((*(0 for _ in groups), _pipeline_batch(pipe, batch)))
    return rules, data_rules


def _pipeline_batch(pipe: PipelineCost, batch: Group) -> int:
    """The batch candidate of a pipeline layout: split over its data axes alone (the sequence whole)."""
    data_axes = set(pipe.candidate.data_axes)
    return next(i for i, c in enumerate(batch.candidates) if set(c.dims[0]) == data_axes and not c.dims[1])


def _pipeline_refusal(
    fn: Callable[..., Any], kwargs: Mapping[str, Any], space: _Space, pipe: PipelineCost, mesh: jax.sharding.Mesh
) -> str:
    """JAX's refusal of the step as written with the pipeline's layout (:func:`pipeline_rules`: the stacked layers
    split over the stage axis, the rest whole, the batch over the data axes) on ``mesh``'s Explicit axes, traced as
    ``verify=`` traces a layout ('' where JAX types it).  A scan over the stacked layers is refused so (JAX scans
    only an unsplit leading axis): the step as written is not the pipeline, which :func:`einshard.pipeline` runs."""
    costs = space.costs
    leaf_specs, data_specs = costs.specs((*(0 for _ in space.groups), _pipeline_batch(pipe, space.batch)))
    for g in space.groups:
        if g.stacked:
            for i in g.leaves:
                leaf_specs[i] = jax.sharding.PartitionSpec(pipe.candidate.stage_axis, *leaf_specs[i][1:])
    in_specs, out_specs = layout_specs(costs, leaf_specs, data_specs)
    return refused_on(fn, costs.args, in_specs, out_specs, mesh, **kwargs)


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
