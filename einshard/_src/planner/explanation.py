"""Naming a choice (``fsdp(data on x)``, ``tp(model on y)``, ``dp(data)``) and saying why it won, truthfully.

Every sentence of the explanation is a comparison of numbers the planner
computed (the choice's and the ``dp`` preset's compute, communication and
memory); a reason is printed only when those numbers show it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..analysis.cost import human_bytes, human_time
from .groups import Candidate, Group
from .result import Alternative
from .roles import Role
from .scoring import Score

__all__ = ["strategy", "short", "batch_strategy", "explain_choice"]


def strategy(
    group: Group, cand: Candidate, batch_axes: tuple[str, ...], roles: Mapping[int, Role] | None = None
) -> str:
    """A short name: ``replicated``, ``fsdp(data on x)``, ``tp(model on y)``, ``pipeline(stage)``, joined by ``+``.

    A split over a mesh axis that also splits the batch is FSDP (gathered before
    use); over another axis it is tensor parallelism, named by the tensor axis
    it splits, whatever the weight's axis order (``(in, out)`` or ``(out, in)``), and, where the
    program shows it (``roles``, from :func:`~.roles.weight_roles`), as ``col`` (an axis the first
    matmul keeps: column-parallel) or ``row`` (an axis it contracts: row-parallel).
    """
    parts = []
    for i, d in enumerate(cand.dims):
        if not d:
            continue
        if group.stacked and i == 0:
            parts.append(f"pipeline({','.join(d)})")
            continue
        fsdp = tuple(m for m in d if m in batch_axes)
        tp = tuple(m for m in d if m not in batch_axes)
        if fsdp:
            parts.append(f"fsdp({','.join(fsdp)} on {group.names[i]})")
        if tp:
            role = {"out": ", col", "in": ", row"}.get((roles or {}).get(i, ""), "")
            parts.append(f"tp({','.join(tp)} on {group.names[i]}{role})")
    return "+".join(parts) or "replicated"


def short(display: str) -> str:
    """``['layers'][*]['w1']`` → ``layers.*.w1`` (for one-line labels)."""
    parts = re.findall(r"\['([^']*)'\]|\[(\*|\d+)\]|\.(\w+)", display)
    return ".".join(next(p for p in tup if p) for tup in parts) or display


def batch_strategy(cand: Candidate) -> str:
    batch, seq = cand.dims
    parts = []
    if batch:
        parts.append(f"dp({','.join(batch)})")
    if seq:
        parts.append(f"seq({','.join(seq)})")
    return "+".join(parts) or "replicated batch"


def explain_choice(
    chosen: Score,
    optimizer_bytes: int,
    strategies: dict[str, str],
    presets: list[Alternative],
    alts: list[Alternative],
    budget: int | None,
    objective: str,
    warning: str,
    params_sharded: bool,
    batch_axes: tuple[str, ...],
    mesh_axes: tuple[str, ...],
) -> str:
    lines = []
    if warning:
        lines.append("WARNING: " + warning + ".")
    sharded = {k: v for k, v in strategies.items() if k != "batch" and v != "replicated"}
    lines.append(
        f"chosen: {strategies['batch']}; "
        + ("; ".join(f"{k}: {v}" for k, v in sharded.items()) or "every parameter replicated")
    )
    r = chosen.report
    comm_s = max(chosen.time_s - chosen.compute_s, 0.0)
    lines.append(
        f"step ≈ {human_time(chosen.time_s)}: compute {human_time(chosen.compute_s)} "
        f"({r.flops / 1e9:.3g} GFLOP/device), communication {human_time(comm_s)} "
        f"({r.comm_count} collectives, {human_bytes(chosen.comm)} sent/device); "
        f"memory {human_bytes(chosen.memory)}/device"
        + (f" (incl. optimizer state {human_bytes(optimizer_bytes)})" if optimizer_bytes else "")
        + (f" of a {human_bytes(budget)} budget" if budget is not None else "")
    )
    dp = next((p for p in presets if p.label == "preset dp"), None)
    if dp is not None:
        lines += _versus_dp(chosen, dp, budget, objective, params_sharded, batch_axes, mesh_axes)
    if alts:
        nxt = alts[0]
        if objective in ("training", "inference") and chosen.time_s > 0:
            gap = (nxt.time_s / chosen.time_s - 1) * 100
            lines.append(
                f"runner-up: {nxt.label}: {gap:+.1f}% time, {human_bytes(nxt.memory_bytes)}/device"
                + ("" if nxt.fits else " (over budget)")
            )
        else:
            lines.append(f"runner-up: {nxt.label}")
    return "\n".join(lines)


def _versus_dp(
    chosen: Score,
    dp: Alternative,
    budget: int | None,
    objective: str,
    params_sharded: bool,
    batch_axes: tuple[str, ...],
    mesh_axes: tuple[str, ...],
) -> list[str]:
    """Why not plain data parallelism: only the reasons the numbers show."""
    comm_s, dp_comm_s = chosen.time_s - chosen.compute_s, dp.time_s - dp.compute_s
    vs = (
        f"vs preset dp: {human_time(dp.time_s)}/step (compute {human_time(dp.compute_s)}, "
        f"communication {human_time(dp_comm_s)}), {human_bytes(dp.memory_bytes)}/device"
        + ("" if dp.fits else " (over budget)")
    )
    out = [vs]
    if not dp.fits and chosen.fits:
        out.append(
            f"data parallel does not fit: {human_bytes(dp.memory_bytes)} > {human_bytes(budget or 0)} "
            "budget, so parameters are sharded"
        )
        return out
    if objective not in ("training", "inference") or chosen.time_s > dp.time_s:
        return out
    idle = [a for a in mesh_axes if a not in batch_axes]
    if chosen.compute_s > dp.compute_s * (1 + 1e-9) and comm_s < dp_comm_s:
        out.append(
            f"the batch is not split over {', '.join(idle) or 'every axis'}: each device computes more "
            f"({human_time(chosen.compute_s)} vs {human_time(dp.compute_s)}), but that costs less than the "
            f"communication it saves ({human_time(comm_s)} vs {human_time(dp_comm_s)}); on this profile "
            "the step is dominated by collectives (a larger batch makes splitting it pay)"
        )
    elif params_sharded and comm_s < dp_comm_s:
        sends = (
            "sends less" if chosen.comm < dp.comm_bytes else "sends as much or more, in fewer or cheaper collectives,"
        )
        out.append(
            f"sharding parameters communicates for less time than data parallel's gradient reduction: it {sends} "
            f"({human_bytes(chosen.comm)} vs {human_bytes(dp.comm_bytes)}/device, "
            f"{human_time(comm_s)} vs {human_time(dp_comm_s)})"
        )
    elif chosen.compute_s < dp.compute_s * (1 - 1e-9):
        out.append(
            f"splitting the batch over more mesh axes than dp ({', '.join(batch_axes)}) divides the compute "
            f"further ({human_time(chosen.compute_s)} vs {human_time(dp.compute_s)})"
        )
    elif not params_sharded:
        out.append("parameters stay replicated: no split of them was faster")
    return out
