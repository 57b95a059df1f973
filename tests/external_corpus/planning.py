"""The planner against hand layouts on the external corpus: XLA's own bytes and FLOPs for each layout.

Shared by tests/test_external_corpus.py (the slow check) and benchmarks/bench_external.py (step times).
"""

from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard.testing import hlo

from . import Family, specs_for
from .compare import mesh_of

# The families the planner is checked on, and the tolerance on XLA's bytes: the plan may send at most this much
# more than the best hand layout that computes no more FLOPs per device than it (a layout replicating the batch
# sends nothing and computes everything on every device: bytes alone would reward it).
PLANNED = ("kh_llama", "keras_vit", "hk_stack", "kh_t5")
BYTES_TOLERANCE = 0.10


def step_of(family: Family) -> Any:
    return jax.value_and_grad(family.loss)


def plan_for(
    family: Family,
    verify: int | None = None,
    presets: dict[str, Any] | None = None,
    memory_budget: int | None = None,
    search: Any = None,
) -> Any:
    """einshard.plan on the Explicit (4, 2) mesh (only shapes matter), the step a training loop runs."""
    return einshard.plan(
        step_of(family),
        family.params,
        family.batch,
        mesh=mesh_of("explicit"),
        verify=verify,
        presets=presets,
        memory_budget=memory_budget,
        search=search,
    )


def tight_budget(family: Family) -> int:
    """A memory budget (bytes per device) halfway between the planner's fsdp and dp presets: replicated
    parameters with their optimizer state do not fit, so the plan must shard them (fsdp, tp, or both)."""
    starts = einshard.plan(
        step_of(family),
        family.params,
        family.batch,
        mesh=mesh_of("explicit"),
        search=einshard.planner.SearchOptions(exhaustive_limit=0, max_evaluations=1),
    )
    memory = {a.label: a.memory_bytes for a in starts.alternatives}
    return (memory["preset dp"] + memory["preset fsdp"]) // 2


def hand_layouts_that_fit(family: Family, memory_budget: int) -> set[str]:
    """The hand layouts whose memory, as the planner prices it (the step's peak + Adam state), is in the budget."""
    plan = plan_for(family, presets=hand_presets(family), memory_budget=memory_budget)
    return {
        a.label.removeprefix("preset hand_") for a in plan.alternatives if a.label.startswith("preset hand_") and a.fits
    }


def _exact_rules(tree: Any) -> dict[str, str]:
    """An expression tree as path rules, one exact pattern per leaf (what ``plan(presets=)`` takes)."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"^" + re.escape(jax.tree_util.keystr(path)) + "$": expr for path, expr in flat}


def hand_presets(family: Family) -> dict[str, Any]:
    """Every hand layout of the family as a ``plan(presets=)`` entry: ``hand_dp``, ``hand_tp``..."""
    out = {}
    for strategy in family.rules:
        params, batch = specs_for(family, strategy)
        out[f"hand_{strategy}"] = (_exact_rules(params), [_exact_rules(batch)])
    return out


def hand_presets_beating_the_search(plan: Any) -> list[str]:
    """The hand presets the cost model prices faster than the layout the search found (empty: the search found
    one at least as fast, by the model, as every hand layout).  ``plan`` was made with ``presets=hand_presets``;
    a plan returned *as* one of them means the search missed a layout its own model ranks first."""
    if plan.strategies.get("parameters") == "the preset's rules":
        return [f"{plan.strategies['batch']}: {plan.time_s * 1e6:.1f} µs, chosen over every layout the search costed"]
    return [
        f"{a.label}: {a.time_s * 1e6:.1f} µs vs the search's {plan.time_s * 1e6:.1f} µs"
        for a in plan.alternatives
        if a.label.startswith("preset hand_") and a.time_s < plan.time_s * (1 - 1e-9)
    ]


def _expressions(tree: Any, rules: dict[str, str]) -> Any:
    def one(path: Any, x: Any) -> str:
        key = jax.tree_util.keystr(path)
        return next(e for p, e in rules.items() if re.search(p, key))

    return jax.tree_util.tree_map_with_path(one, tree)


def layouts(family: Family, plan: Any) -> dict[str, tuple[Any, Any]]:
    """name -> (param expressions, batch expressions): every hand layout of the family, and 'plan'."""
    out = {s: specs_for(family, s) for s in family.rules}
    out["plan"] = (_expressions(family.params, plan.rules), _expressions(family.batch, plan.data_rules[0]))
    return out


def compiled(family: Family, exprs: tuple[Any, Any]) -> dict[str, Any]:
    """The step compiled under one layout on the Auto (4, 2) mesh: XLA's bytes per device, FLOPs, the jitted step."""
    mesh = mesh_of("auto")
    place = lambda e, a: einshard.sharding(e, a.shape, mesh=mesh)  # noqa: E731
    psh = jax.tree.map(place, exprs[0], family.params)
    bsh = jax.tree.map(place, exprs[1], family.batch)
    jitted = jax.jit(step_of(family), in_shardings=(psh, bsh), out_shardings=(NamedSharding(mesh, P()), psh))
    comp = jitted.lower(family.params, family.batch).compile()
    colls = hlo.normalized(comp.as_text())
    cost = comp.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {
        "program": same_program_key(comp.as_text()),
        "comm_bytes": float(sum(c.sent_bytes * c.runs for c in colls)),
        "collectives": sum(c.runs for c in colls),
        "flops": float(cost.get("flops", 0.0)),
        "jitted": jitted,
        "shardings": (psh, bsh),
    }


def same_program_key(hlo_text: str) -> str:
    """The compiled HLO without what differs between two compilations of one program: the module line (its name),
    the source tables before the first computation (file names, functions, locations, stack frames) and each
    op's source metadata.  Two layouts with equal keys run the same program."""
    lines = hlo_text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith(("%", "ENTRY"))), len(lines))
    return re.sub(r",? ?metadata=\{[^}]*\}", "", "\n".join(lines[first:]))


def same_programs(costs: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Each layout -> the first layout (in ``costs``' order: the hand layouts before the plans) that XLA compiled
    to the same program; itself when none did."""
    first: dict[str, str] = {}
    out = {}
    for label, c in costs.items():
        out[label] = first.setdefault(c["program"], label)
    return out


def worse_than_hand(costs: dict[str, dict[str, Any]], eligible: set[str] | None = None) -> list[str]:
    """Hand layouts that beat the plan by XLA's bytes beyond the tolerance while computing no more FLOPs
    (``eligible``: only those, e.g. the hand layouts that fit the plan's memory budget)."""
    mine = costs["plan"]
    return [
        f"{name}: {c['comm_bytes']:.0f} B, {c['flops']:.0f} FLOPs vs plan {mine['comm_bytes']:.0f} B, {mine['flops']:.0f}"
        for name, c in costs.items()
        if name != "plan"
        and (eligible is None or name in eligible)
        and c["flops"] <= mine["flops"] * 1.01
        and c["comm_bytes"] * (1 + BYTES_TOLERANCE) < mine["comm_bytes"]
    ]
