"""``einshard.audit``: what a rule set you already have does to a model step, and what ``plan`` would do instead.

A rule set — einshard path rules, a Keras ``LayoutMap``, or a Flax/MaxText logical layout read with
:mod:`einshard.interop` — is read for the step's parameters, then:

* each rule, with the leaves it matches and their bytes (a rule that matches nothing is listed as such);
* the leaves no rule matches (so they are replicated on every device), largest first — the regex that
  silently stopped matching after a rename (keras-hub#2806);
* logical names a rule maps to mesh axes but that were left whole because another dimension took them
  (Flax's silent fallback);
* memory per device (peak + optimizer state) against a budget;
* ``explain``'s collectives and step time for those layouts;
* ``plan``'s layout for the same step and budget beside it, and each leaf whose layout differs.

Nothing is reimplemented: the costs are :func:`einshard.explain`'s and :func:`einshard.plan`'s (the rule set
is costed as one of plan's presets, with the same model as plan's own choice).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import PartitionSpec

from ._checks import check_callable, check_str_or_strs, fail, naming
from .analysis.cost import human_bytes, human_time
from .analysis.program import ProgramReport, explain
from .core.logical import AxisRulesLike, current_axis_rules, scoped_axis_rules
from .core.mesh import AnyMesh, MeshLike, as_mesh, resolve_mesh
from .errors import EinshardError
from .interop._leaves import ImportedRules, LeafMatch, imported, leaves_of
from .interop.keras import from_keras
from .planner import LayoutPlan, plan
from .planner.inputs import Objective, parse_bytes
from .tree_rules import Rules, compile_rules, leaf_expressions

__all__ = ["audit", "AuditReport", "RuleUse", "LayoutDifference"]


@dataclass(frozen=True)
class RuleUse:
    """One rule of the audited set and the leaves it lays out."""

    source: str
    leaves: tuple[LeafMatch, ...]

    @property
    def nbytes(self) -> int:
        return sum(m.leaf.nbytes for m in self.leaves)


@dataclass(frozen=True)
class LayoutDifference:
    """A leaf that ``plan`` lays out otherwise than the audited rules."""

    name: str
    nbytes: int
    yours: PartitionSpec
    planned: PartitionSpec


@dataclass(frozen=True)
class AuditReport:
    """What :func:`audit` found.

    Attributes:
        imported: the rule set as read for the parameters (``imported.rules`` places them).
        rules: each rule in its order, with the leaves it matches.
        unmatched: the leaves no rule matches (replicated everywhere), largest first.
        memory_bytes: bytes per device of the audited layout (peak + optimizer state, as ``plan`` counts).
        budget: the budget in bytes, or None.
        fits: whether ``memory_bytes`` is within the budget (True without one).
        time_s, comm_bytes: the audited layout's step time and bytes sent per device (``plan``'s costing).
        report: ``explain``'s op-by-op report of the audited layout (its collectives, peak, step time).
        plan: ``plan``'s choice for the same step, mesh and budget.
        differences: the leaves the plan lays out otherwise (parameters, and data arguments as
            ``data[i]/name``), largest first.
    """

    imported: ImportedRules
    rules: tuple[RuleUse, ...]
    unmatched: tuple[LeafMatch, ...]
    memory_bytes: int
    budget: int | None
    fits: bool
    time_s: float
    comm_bytes: float
    report: ProgramReport
    plan: LayoutPlan
    differences: tuple[LayoutDifference, ...]

    @property
    def fallbacks(self) -> tuple[tuple[LeafMatch, tuple[str, ...]], ...]:
        """Leaves with logical names left whole although a rule maps them (their mesh axes were taken by
        another dimension: Flax's silent fallback), largest first."""
        found = [(m, m.fallbacks(self.imported.axis_rules)) for m in self.imported.leaves]
        return tuple(sorted(((m, f) for m, f in found if f), key=lambda mf: -mf[0].leaf.nbytes))

    def collectives(self) -> tuple[tuple[str, tuple[str, ...], int, float], ...]:
        """``explain``'s collectives summed by kind and mesh axes: ``(kind, axes, count, bytes per device)``."""
        totals: dict[tuple[str, tuple[str, ...]], list[float]] = {}
        for op in self.report.ops:
            for c in op.collectives:
                entry = totals.setdefault((c.kind, tuple(c.axes)), [0, 0.0])
                entry[0] += op.repeat
                entry[1] += c.bytes * op.repeat
        return tuple((k, a, int(n), b) for (k, a), (n, b) in sorted(totals.items(), key=lambda kv: -kv[1][1]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.imported.format,
            "rules": [
                {"rule": r.source, "leaves": [m.leaf.name for m in r.leaves], "bytes": r.nbytes} for r in self.rules
            ],
            "unmatched": [
                {"leaf": m.leaf.name, "shape": list(m.leaf.shape), "bytes": m.leaf.nbytes} for m in self.unmatched
            ],
            "fallbacks": [{"leaf": m.leaf.name, "names": list(f), "bytes": m.leaf.nbytes} for m, f in self.fallbacks],
            "memory_bytes": self.memory_bytes,
            "budget": self.budget,
            "fits": self.fits,
            "time_s": self.time_s,
            "comm_bytes": self.comm_bytes,
            "collectives": [{"kind": k, "axes": list(a), "count": n, "bytes": b} for k, a, n, b in self.collectives()],
            "plan": {
                "rules": dict(self.plan.rules),
                "time_s": self.plan.time_s,
                "memory_bytes": self.plan.memory_bytes,
                "comm_bytes": self.plan.comm_bytes,
            },
            "differences": [
                {"leaf": d.name, "bytes": d.nbytes, "yours": str(d.yours), "plan": str(d.planned)}
                for d in self.differences
            ],
        }

    def __str__(self) -> str:
        mesh = ", ".join(f"{m.name}={m.size}" for m in self.report.mesh)
        lines = [
            f"audit of {len(self.rules)} {self.imported.format} rules over {len(self.imported.leaves)} leaves "
            f"(mesh {mesh})",
            "rules:",
        ]
        width = max([len(r.source) for r in self.rules] + [10])
        for r in self.rules:
            if not r.leaves:
                lines.append(f"  {r.source!s:<{width}}  matches nothing")
                continue
            names = ", ".join(m.leaf.name for m in r.leaves[:4]) + (" ..." if len(r.leaves) > 4 else "")
            count = f"{len(r.leaves)} leaf" if len(r.leaves) == 1 else f"{len(r.leaves)} leaves"
            lines.append(f"  {r.source!s:<{width}}  {count}, {human_bytes(r.nbytes)}: {names}")
        if self.unmatched:
            total = sum(m.leaf.nbytes for m in self.unmatched)
            lines.append(f"no rule matches (replicated on every device), largest first — {human_bytes(total)}:")
            for m in self.unmatched:
                lines.append(f"  {m.leaf.name}  {m.leaf.shape}  {human_bytes(m.leaf.nbytes)}")
        else:
            lines.append("every leaf is matched by a rule")
        if self.fallbacks:
            lines.append("logical names left whole because their rules' mesh axes were taken (Flax's fallback):")
            for m, left in self.fallbacks:
                lines.append(f"  {m.leaf.name}  {m.leaf.shape}  {human_bytes(m.leaf.nbytes)}: {', '.join(left)}")
        budget = human_bytes(self.budget) if self.budget is not None else "none"
        verdict = "fits" if self.fits else "** OVER BUDGET **"
        lines.append(
            f"memory per device: {human_bytes(self.memory_bytes)} (peak + optimizer state), budget {budget}: {verdict}"
        )
        rep = self.report
        lines.append(
            f"step (explain): ~{human_time(rep.time_s)}, {rep.comm_count} collectives, "
            f"{human_bytes(rep.comm_bytes)} sent/device, peak {human_bytes(rep.peak_bytes)}/device"
        )
        for kind, axes, n, b in self.collectives():
            lines.append(f"  {kind}@{'·'.join(axes)} ×{n}  {human_bytes(b)}")
        p = self.plan
        lines.append(
            f"plan's choice: ~{human_time(p.time_s)}, {human_bytes(p.memory_bytes)}/device, "
            f"{human_bytes(p.comm_bytes)} sent/device" + ("" if p.fits else "  (does not fit either)")
        )
        lines.append(
            f"yours, costed as plan costs (collectives XLA combines counted once): ~{human_time(self.time_s)}, {human_bytes(self.memory_bytes)}/device, "
            f"{human_bytes(self.comm_bytes)} sent/device"
        )
        if self.differences:
            lines.append("leaves the plan lays out otherwise (yours -> plan's), largest first:")
            for d in self.differences:
                lines.append(f"  {d.name}  {human_bytes(d.nbytes)}  {d.yours} -> {d.planned}")
        else:
            lines.append("the plan lays every leaf out as your rules do")
        return "\n".join(lines)


def _as_imported(rules: Any, params: Any, mesh: MeshLike) -> ImportedRules:
    """A rule set in any form read for ``params``: :class:`ImportedRules` as is, a Keras ``LayoutMap``, or
    einshard path rules (a pattern mapping or one expression; logical names through the current rules).

    Unlike placing, a leaf no einshard pattern matches is not an error here: it is reported, replicated.
    """
    if isinstance(rules, ImportedRules):
        return rules
    names = tuple(str(n) for n in as_mesh(mesh).axis_names)
    if hasattr(rules, "device_mesh"):  # a keras LayoutMap (a mapping, of TensorLayouts)
        return from_keras(rules, params, mesh=mesh)
    if not isinstance(rules, (str, Mapping)):
        raise EinshardError(
            f"audit(rules=) takes einshard path rules, a keras LayoutMap, or what einshard.interop's readers "
            f"return (from_nnx, from_maxtext), got {type(rules).__name__}"
        )
    leaves = leaves_of(params)
    layouts: list[tuple[str | None, str]] = []
    if isinstance(rules, str):
        layouts = [(rules, rules)] * len(leaves)
        sources: tuple[str, ...] = (rules,)
    else:
        compiled = compile_rules(rules)
        sources = tuple(p for p, _, _ in compiled)
        for leaf in leaves:
            hit = next(((p, r) for p, regex, r in compiled if regex.search(leaf.path)), None)
            whole = "... -> ..."
            layouts.append((None, whole) if hit is None else (hit[0], hit[1] if hit[1] is not None else whole))
    return imported("einshard", leaves, layouts, names, sources, current_axis_rules())


def audit(
    step: Callable[..., Any],
    *args: Any,
    rules: Any,
    mesh: MeshLike | None = None,
    budget: int | float | str | None = None,
    data_rules: Rules | Sequence[Rules] | None = None,
    batch_axis: str | tuple[str, ...] | None = None,
    profile: Any = None,
    objective: Objective = "training",
    axis_rules: AxisRulesLike | None = None,
) -> AuditReport:
    """Audit a rule set on a model step: what each rule matches, what no rule matches (replicated, by bytes),
    memory per device against ``budget``, ``explain``'s collectives and step cost, and ``plan``'s layout beside it.

    Args:
        step: the step, as ``einshard.plan`` takes it (``jax.value_and_grad(loss)`` for training).
        args: its arguments, the parameters first (arrays or ``jax.ShapeDtypeStruct``s).
        rules: the rule set for the parameters: einshard path rules, a Keras ``LayoutMap``, or what
            :func:`einshard.interop.from_nnx` / :func:`~einshard.interop.from_maxtext` return.
        mesh: a Mesh or axis sizes; default the current mesh, else the arguments'.
        budget: memory per device (bytes or ``'16GiB'``).
        data_rules: the data arguments' rules (one for all, or one per argument); default each leaf's first
            axis split over ``batch_axis`` where it divides (whole otherwise).
        batch_axis: default the mesh's first axis.
        profile, objective: as for ``einshard.plan``.
        axis_rules: a logical-axis table for logical names in einshard ``rules`` and ``data_rules``.
    """
    check_callable(step, "einshard.audit", "step")
    if not args:
        raise EinshardError("audit() needs the step's arguments (the parameters first)")
    if batch_axis is not None:
        check_str_or_strs(batch_axis, "einshard.audit", "batch_axis")
    if data_rules is not None:
        _check_data_rules(data_rules)
    with scoped_axis_rules(axis_rules):
        return _audit(step, args, rules, mesh, budget, data_rules, batch_axis, profile, objective)


def _audit(
    step: Callable[..., Any],
    args: tuple[Any, ...],
    rules: Any,
    mesh: MeshLike | None,
    budget: Any,
    data_rules: Any,
    batch_axis: Any,
    profile: Any,
    objective: Objective,
) -> AuditReport:
    found = resolve_mesh(mesh, args, what="einshard.audit", check_operands=False)
    assert found is not None  # required=True raises instead
    mesh = mesh if mesh is not None else found
    params, data = args[0], args[1:]
    read = _as_imported(rules, params, mesh)
    data_list = _data_rules(data, data_rules, batch_axis, found)
    budget_bytes = parse_bytes(budget)
    chosen = plan(
        step,
        *args,
        mesh=mesh,
        profile=profile,
        memory_budget=budget_bytes,
        objective=objective,
        presets={"yours": (read.rules, data_list)},
    )
    yours = next((a for a in chosen.alternatives if a.label == "preset yours"), None)
    if yours is not None:
        time_s, memory, comm, fits = yours.time_s, yours.memory_bytes, yours.comm_bytes, yours.fits
    else:  # the rules beat every layout plan searched: plan returned them as its choice
        time_s, memory, comm, fits = chosen.time_s, chosen.memory_bytes, chosen.comm_bytes, chosen.fits
    in_specs = (_tree_like(params, [m.expression for m in read.leaves]),) + tuple(
        _tree_like(x, list(leaf_expressions(x, r))) for x, r in zip(data, data_list)
    )
    report = explain(step, *args, mesh=mesh, profile=profile, in_specs=in_specs)
    uses = tuple(RuleUse(s, read.matched_by(s)) for s in read.sources)
    return AuditReport(
        read,
        uses,
        read.unmatched,
        memory,
        budget_bytes,
        fits,
        time_s,
        comm,
        report,
        chosen,
        _differences(read, params, data, data_list, chosen, mesh),
    )


def _tree_like(tree: Any, exprs: list[Any]) -> Any:
    treedef = jax.tree_util.tree_structure(tree)
    count = len(jax.tree_util.tree_leaves(tree))
    if count != len(exprs):
        raise EinshardError(f"audit(): {len(exprs)} layouts for a pytree of {count} leaves")
    return jax.tree_util.tree_unflatten(treedef, exprs)


def _check_data_rules(data_rules: Any) -> None:
    """Rules for the data arguments: one rule set for all (an expression or path rules) or one per argument,
    each compiled here so that a bad one is named as data_rules= (not as the planner's preset it becomes)."""
    each = [data_rules] if isinstance(data_rules, (str, Mapping)) else data_rules
    if not isinstance(each, (tuple, list)):
        fail("einshard.audit", "data_rules", "rules (one for every data argument, or one per argument)", data_rules)
    with naming("einshard.audit", "data_rules"):
        for rules in each:
            if isinstance(rules, Mapping):
                compile_rules(rules)
            elif not isinstance(rules, str) and rules is not None:
                fail("einshard.audit", "data_rules", "an expression or path rules per argument", rules)


def _data_rules(data: Sequence[Any], data_rules: Any, batch_axis: Any, mesh: AnyMesh) -> list[Any]:
    if data_rules is not None:
        if isinstance(data_rules, (str, Mapping)):
            return [data_rules] * len(data)
        if len(data_rules) != len(data):
            raise EinshardError(f"audit(): {len(data_rules)} data_rules for {len(data)} data arguments")
        return list(data_rules)
    axes = (batch_axis,) if isinstance(batch_axis, str) else tuple(batch_axis or (str(mesh.axis_names[0]),))
    group = axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"
    sizes = dict(mesh.shape)
    missing = [a for a in axes if a not in sizes]
    if missing:
        raise EinshardError(f"audit(): batch_axis {missing[0]!r} is not an axis of the mesh {sizes}")
    ways = math.prod(sizes[a] for a in axes)
    out = []
    for x in data:
        # the first axis split over the batch axes where it divides; whole otherwise (a scalar, an odd length)
        exprs = [
            f"b ... -> b@{group} ..." if leaf.shape and leaf.shape[0] % ways == 0 else "... -> ..."
            for leaf in leaves_of(x, "args")
        ]
        out.append({"^" + re.escape(leaf.path) + "$": e for leaf, e in zip(leaves_of(x, "args"), exprs)})
    return out


def _differences(
    read: ImportedRules, params: Any, data: Sequence[Any], data_list: list[Any], chosen: LayoutPlan, mesh: MeshLike
) -> tuple[LayoutDifference, ...]:
    """The leaves (parameters, then data arguments as ``data[i]/name``) the plan lays out otherwise."""
    from .placement import spec

    def planned_spec(text: str | None, shape: tuple[int, ...]) -> PartitionSpec:
        return spec(text, shape, mesh=mesh) if text is not None else PartitionSpec()

    pairs = [
        (m.leaf.name, m.leaf, m.spec, planned_spec(text, m.leaf.shape))
        for m, text in zip(read.leaves, leaf_expressions(params, chosen.rules))
    ]
    for i, (x, rules) in enumerate(zip(data, data_list)):
        theirs = chosen.data_rules[i] if i < len(chosen.data_rules) else "... -> ..."
        for leaf, mine, planned in zip(leaves_of(x), leaf_expressions(x, rules), leaf_expressions(x, theirs)):
            label = f"data[{i}]" + (f"/{leaf.name}" if leaf.name else "")
            pairs.append((label, leaf, planned_spec(mine, leaf.shape), planned_spec(planned, leaf.shape)))
    out = [
        LayoutDifference(name, leaf.nbytes, yours, planned)
        for name, leaf, yours, planned in pairs
        if _entries(yours, len(leaf.shape)) != _entries(planned, len(leaf.shape))
    ]
    return tuple(sorted(out, key=lambda d: -d.nbytes))


def _entries(spec: PartitionSpec, rank: int) -> tuple[Any, ...]:
    entries = [e if not (isinstance(e, tuple) and len(e) == 1) else e[0] for e in tuple(spec)]
    return tuple(entries + [None] * (rank - len(entries)))
