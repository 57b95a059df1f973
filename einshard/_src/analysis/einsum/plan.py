"""The :class:`EinsumPlan`: what an einsum costs laid out one way, and the other ways; and the strategy's
name, the way users talk: data parallel, column/row-parallel TP, FSDP, ...

Which operand is "the weight" (a heuristic, documented because it decides
column- vs row-parallel and FSDP):

1. An operand that holds an axis named like a batch or a sequence
   (``b``, ``batch``, ``s``, ``seq``, ``t``, ``l``, ``tokens``, ...) is an
   activation; so is one that holds a batch-class axis (one shared by several
   operands and the output, as in attention's ``b h``).
2. Of the operands left, the weight is the last one (``x @ W`` order); if none
   is left there is no weight (attention-like einsums: activations only).

Each mesh axis then gets a role from the einsum axis it keeps:

* none kept → ``replicated`` (compute duplicated over that axis);
* a contracted / lone-reduced axis → ``row-parallel TP`` (partial sums);
* a free axis of the weight → ``column-parallel TP``;
* any other batch/free axis → ``data parallel``, or ``sequence parallel`` if
  it is named like a sequence, or ``head-parallel TP`` if named like attention
  heads (``h``, ``head``, ``heads``: Megatron splits heads as tensor
  parallelism); a data-parallel axis over which the weight arrived split and
  is gathered before use is ``FSDP``.

The strategy combines the roles: one role names it; data parallel or FSDP
with TP is ``hybrid DP×TP`` (``FSDP×TP``); column with row TP is ``2-D TP``.
The einshard-tutorial view looks only at classes: every kept axis free or
batch → ``DP``; every kept axis reduced → ``1-D TP``; both → ``hybrid``.

(:func:`~einshard.analysis.einsum.model.pick_weight` picks the weight: the text reader asks it too.)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ...core.layout import Layout, MeshAxis
from ...parsing import format_name
from ..cost import Collective, Profile, human_bytes, human_time
from . import model
from .model import BATCH, CONTRACTED, HEAD_NAMES, LONE, SEQ_NAMES, Candidate

__all__ = ["EinsumPlan", "roles", "side_string", "strategy_name", "tutorial_view", "type_string"]


def _axis_name(name: str) -> str:
    """An axis as the user wrote it; axes under ``...`` print as ``…0``, ``…1``, ..."""
    return "…" + name[3:] if name.startswith("...") else format_name(name)


def type_string(lay: Layout, dtype: str) -> str:
    """JAX's type notation: ``f32[64@data,256]{U:model}``."""
    parts = []
    for size, d in zip(lay.shape, lay.dims, strict=False):
        text = str(size)
        if d:
            text += "@" + (d[0] if len(d) == 1 else "(" + ",".join(d) + ")")
        parts.append(text)
    text = f"{dtype}[{','.join(parts)}]"
    if lay.unreduced:
        text += "{U:" + ",".join(m.name for m in lay.mesh if m.name in lay.unreduced) + "}"
    return text


def side_string(lay: Layout) -> str:
    """A layout written as an einshard side: ``b y@model {U:data}``."""
    parts = []
    for name, d in zip(lay.axes, lay.dims, strict=False):
        text = _axis_name(name)
        if d:
            text += "@" + (d[0] if len(d) == 1 else "(" + ",".join(d) + ")")
        parts.append(text)
    text = " ".join(parts)
    if lay.unreduced:
        text += (" " if text else "") + "{U:" + ",".join(m.name for m in lay.mesh if m.name in lay.unreduced) + "}"
    return text


@dataclass(frozen=True, repr=False)
class EinsumPlan:
    """One way to compute an einsum on a mesh: layouts, collectives, FLOPs, time, the strategy's name.

    ``alternatives`` holds the other ways (each a EinsumPlan without alternatives),
    cheapest first.  Sizes are per device; times are α–β estimates on
    ``profile``.  The text (``expression``, ``strategy``, ``roles``,
    ``tutorial_view``, ``why``) is written on first read, from the fields and
    the candidate the plan was built from: analysis stays fast when unread.
    """

    mesh: tuple[MeshAxis, ...]
    dtype: str
    itemsize: int
    profile: Profile
    operands: tuple[Layout, ...]
    operands_used: tuple[Layout, ...]
    out_layout: Layout
    computed_layout: Layout
    collectives: tuple[Collective, ...]
    flops: int
    total_flops: int
    compute_time: float
    comm_time: float
    time: float
    classes: dict[str, str]
    choice: tuple[tuple[str, str | None], ...]
    resolution: str
    weight: int | None
    more: Callable[[], tuple[EinsumPlan, ...]] | None = field(default=None, compare=False, repr=False)
    # The candidate it was built from (its operands as the moves start: ``why`` names a local sum first).
    candidate: Candidate | None = field(default=None, compare=False, repr=False)

    @classmethod
    def trusted(
        cls,
        mesh: tuple[MeshAxis, ...],
        dtype: str,
        itemsize: int,
        profile: Profile,
        operands: tuple[Layout, ...],
        operands_used: tuple[Layout, ...],
        out_layout: Layout,
        computed_layout: Layout,
        collectives: tuple[Collective, ...],
        flops: int,
        total_flops: int,
        compute_time: float,
        comm_time: float,
        time: float,
        classes: dict[str, str],
        choice: tuple[tuple[str, str | None], ...],
        resolution: str,
        weight: int | None,
        more: Callable[[], tuple[EinsumPlan, ...]] | None,
        candidate: Candidate | None,
    ) -> EinsumPlan:
        """The one constructor for the analyzer's plans (one per plan and per alternative, built from a candidate
        valid by construction): the fields filled directly (a frozen dataclass without slots: as the generated
        ``__init__``'s ``object.__setattr__`` would), checked with ``EINSHARD_CHECKS=1``."""
        new = object.__new__(cls)
        new.__dict__.update(
            mesh=mesh,
            dtype=dtype,
            itemsize=itemsize,
            profile=profile,
            operands=operands,
            operands_used=operands_used,
            out_layout=out_layout,
            computed_layout=computed_layout,
            collectives=collectives,
            flops=flops,
            total_flops=total_flops,
            compute_time=compute_time,
            comm_time=comm_time,
            time=time,
            classes=classes,
            choice=choice,
            resolution=resolution,
            weight=weight,
            more=more,
            candidate=candidate,
        )
        if model.CHECKS:
            check_plan(new)
        return new

    @functools.cached_property
    def alternatives(self) -> tuple[EinsumPlan, ...]:
        """The other ways, cheapest first (built on first use: analysis stays fast when unused)."""
        return self.more() if self.more is not None else ()

    # -- text, written on first read ---------------------------------------------
    @functools.cached_property
    def expression(self) -> str:
        """The einsum with the operands' layouts and the delivered result's: ``b@data x, x y -> b@data y``."""
        return ", ".join([side_string(o) for o in self.operands]) + " -> " + side_string(self.out_layout)

    @functools.cached_property
    def roles(self) -> dict[str, str]:
        """Each mesh axis's role (this module's doc), mesh axes of size 1 left out."""
        return roles(self.operands, self._cand, self.classes, self.weight)

    @functools.cached_property
    def strategy(self) -> str:
        """The strategy's name: ``'data parallel'``, ``'hybrid DP×TP'``, ... (this module's doc)."""
        return strategy_name(self.roles)

    @functools.cached_property
    def tutorial_view(self) -> str:
        """The einshard-tutorial name: ``DP``, ``1-D TP``, ``hybrid`` or ``replicated``."""
        return tutorial_view(self._cand, self.classes)

    @functools.cached_property
    def why(self) -> str:
        """One line: per mesh axis, what it keeps and what that asks of each operand."""
        return explain_choice(self.operands, self._cand, self.classes, {m.name: m.size for m in self.mesh})

    @property
    def _cand(self) -> Candidate:
        if self.candidate is not None:
            return self.candidate
        return Candidate(  # a plan built by hand: its own fields say the same
            self.choice,
            self.operands_used,
            self.collectives,
            self.computed_layout,
            self.out_layout,
            self.resolution,
            self.flops,
            self.time,
            self.comm_bytes,
        )

    def __repr__(self) -> str:
        # the fields and the text in the order they were printed when the text was fields too
        return f"{type(self).__qualname__}(" + ", ".join(f"{n}={getattr(self, n)!r}" for n in _REPR) + ")"

    # -- derived -------------------------------------------------------------
    @property
    def out_spec(self) -> Any:
        """The result's ``PartitionSpec``; pending partial sums as ``unreduced={...}``."""
        from jax.sharding import PartitionSpec

        entries = self.out_layout.spec_entries()
        if self.out_layout.unreduced:
            try:
                return PartitionSpec(*entries, unreduced=set(self.out_layout.unreduced))
            except TypeError:  # a JAX without unreduced specs: the pending sums are in out_layout only
                return PartitionSpec(*entries)
        return PartitionSpec(*entries)

    @property
    def in_specs(self) -> tuple[Any, ...]:
        """The operands' ``PartitionSpec``s as given."""
        from jax.sharding import PartitionSpec

        return tuple(PartitionSpec(*op.spec_entries()) for op in self.operands)

    @property
    def comm_bytes(self) -> int:
        """Bytes each device sends, all collectives together."""
        return sum(c.bytes for c in self.collectives)

    @property
    def operand_bytes(self) -> tuple[int, ...]:
        """Bytes per device of each operand as given."""
        return tuple(op.bytes_per_device(self.itemsize) for op in self.operands)

    @property
    def out_bytes(self) -> int:
        return self.out_layout.bytes_per_device(self.itemsize)

    @property
    def needs_communication(self) -> bool:
        return bool(self.collectives)

    @property
    def devices(self) -> int:
        return math.prod(m.size for m in self.mesh)

    @property
    def options(self) -> tuple[EinsumPlan, ...]:
        """This plan and its alternatives, cheapest first."""
        return tuple(sorted((self, *self.alternatives), key=lambda p: p.time))

    def legal_outputs(self) -> list[tuple[Any, float, str]]:
        """Distinct result layouts among the options: (out_spec, best time, why), cheapest first.

        This is the list JAX's explicit mode asks you to choose from when it
        says "Contracting dimensions are sharded and it is ambiguous".
        """
        seen: dict[tuple[Any, ...], tuple[Any, float, str]] = {}
        for p in self.options:
            key = (p.out_layout.dims, p.out_layout.unreduced)
            if key not in seen:
                seen[key] = (p.out_spec, p.time, p.why)
        return list(seen.values())

    # -- output ----------------------------------------------------------------
    def to_dict(self, alternatives: bool = True) -> dict[str, Any]:
        d: dict[str, Any] = {
            "expression": self.expression,
            "mesh": {m.name: m.size for m in self.mesh},
            "dtype": self.dtype,
            "profile": self.profile.name,
            "strategy": self.strategy,
            "tutorial_view": self.tutorial_view,
            "roles": dict(self.roles),
            "classes": dict(self.classes),
            "weight": self.weight,
            "operands": [
                {"layout": side_string(o), "type": type_string(o, self.dtype), "bytes_per_device": b}
                for o, b in zip(self.operands, self.operand_bytes, strict=False)
            ],
            "operands_used": [side_string(o) for o in self.operands_used],
            "out": {
                "layout": side_string(self.out_layout),
                "type": type_string(self.out_layout, self.dtype),
                "spec": str(self.out_spec),
                "bytes_per_device": self.out_bytes,
            },
            "computed": side_string(self.computed_layout),
            "collectives": [c.to_dict() for c in self.collectives],
            "comm_bytes": self.comm_bytes,
            "flops": self.flops,
            "total_flops": self.total_flops,
            "compute_time": self.compute_time,
            "comm_time": self.comm_time,
            "time": self.time,
            "why": self.why,
            "resolution": self.resolution,
        }
        if alternatives:
            d["alternatives"] = [a.to_dict(alternatives=False) for a in self.alternatives]
        return d

    def __str__(self) -> str:
        return format_plan(self)


def check_plan(plan: EinsumPlan) -> None:
    """An EinsumPlan's invariants (``EINSHARD_CHECKS=1``): its candidate's, and the fields it copies from the
    candidate saying the same, its times adding up."""
    cand = plan.candidate
    if cand is not None:
        model.check_candidate(cand)
        copied = (plan.operands_used, plan.out_layout, plan.computed_layout, plan.collectives, plan.flops)
        if copied != (cand.targets, cand.out, cand.computed, cand.steps, cand.flops) or plan.time != cand.time:
            raise model.broken(plan, "says otherwise than the candidate it was built from")
    if any(op.mesh != plan.mesh for op in (*plan.operands, *plan.operands_used, plan.out_layout)):
        raise model.broken(plan, f"has a layout off its mesh {plan.mesh}")
    if len(plan.operands) != len(plan.operands_used):
        raise model.broken(plan, f"uses {len(plan.operands_used)} operands for {len(plan.operands)}")
    # (a margin: Python 3.12's float sum compensates rounding, so totals may differ by an ulp)
    if abs(plan.comm_time - sum([c.time for c in plan.collectives])) > 1e-12 * max(plan.time, 1e-30):
        raise model.broken(plan, f"takes {plan.comm_time} s to communicate, its collectives {plan.collectives}")
    if plan.flops > plan.total_flops:
        raise model.broken(plan, f"does {plan.flops} FLOPs per device of {plan.total_flops} in all")


_REPR = (
    "expression", "mesh", "dtype", "itemsize", "profile", "operands", "operands_used", "out_layout",
    "computed_layout", "collectives", "flops", "total_flops", "compute_time", "comm_time", "time", "classes",
    "choice", "strategy", "roles", "tutorial_view", "why", "resolution", "weight",
)  # fmt: skip

COLLECTIVE_COLUMNS = ("collective", "mesh axes", "group", "tensor", "buffer", "sent/device", "time", "why")


def collective_rows(plan: EinsumPlan) -> list[tuple[str, ...]]:
    """One row per collective of the plan, in :data:`COLLECTIVE_COLUMNS` order (plain and rich tables share it)."""
    return [
        (
            c.kind,
            ",".join(c.axes),
            str(c.group_size),
            c.tensor,
            human_bytes(c.array_bytes),
            human_bytes(c.bytes),
            human_time(c.time),
            c.why,
        )
        for c in plan.collectives
    ]


def format_plan(plan: EinsumPlan, max_alternatives: int = 8) -> str:
    """The plain-text table ``str(plan)`` prints."""
    mesh = " ".join(str(m) for m in plan.mesh)
    lines = [
        f"einsum    {plan.expression}",
        f"mesh      {mesh} ({plan.devices} devices), {plan.dtype}, profile {plan.profile.name}",
        f"strategy  {plan.strategy}"
        + (f" ({'; '.join(f'{m}: {r}' for m, r in plan.roles.items())})" if plan.roles else "")
        + f"  [tutorial view: {plan.tutorial_view}]",
        "axes      " + ", ".join(f"{_axis_name(e)} {c}" for e, c in plan.classes.items()),
        "",
    ]
    rows: list[tuple[str, ...]] = [("tensor", "axes", "type (per device bytes)", "")]
    for i, (op, used) in enumerate(zip(plan.operands, plan.operands_used, strict=False)):
        note = "" if used == op else f"computed as {type_string(used, plan.dtype)}"
        rows.append(
            (
                f"operand {i + 1}" + (" (weight)" if plan.weight == i else ""),
                side_string(op),
                f"{type_string(op, plan.dtype)} ({human_bytes(op.bytes_per_device(plan.itemsize))})",
                note,
            )
        )
    note = (
        ""
        if plan.computed_layout == plan.out_layout
        else f"computed as {type_string(plan.computed_layout, plan.dtype)}"
    )
    rows.append(
        (
            "result",
            side_string(plan.out_layout),
            f"{type_string(plan.out_layout, plan.dtype)} ({human_bytes(plan.out_bytes)})",
            note,
        )
    )
    lines += _table(rows)
    lines.append("")
    if plan.collectives:
        rows = [COLLECTIVE_COLUMNS, *collective_rows(plan)]
        lines += _table(rows)
    else:
        lines.append("no communication")
    lines.append("")
    lines.append(
        f"per device: {plan.flops:.4g} FLOPs ({human_time(plan.compute_time)}), sends {human_bytes(plan.comm_bytes)} "
        f"({human_time(plan.comm_time)}); estimated {human_time(plan.time)}"
    )
    lines.append(f"why: {plan.why}")
    if plan.alternatives:
        lines.append("")
        lines.append("alternatives (cheapest first):")
        rows = [("", "time", "result", "collectives", "why")]
        for k, alt in enumerate(plan.alternatives[:max_alternatives], 1):
            comm = ", ".join(f"{c.kind}@{','.join(c.axes)}({c.tensor})" for c in alt.collectives) or "none"
            rows.append((f"{k}.", human_time(alt.time), type_string(alt.out_layout, alt.dtype), comm, alt.why))
        lines += _table(rows)
        if len(plan.alternatives) > max_alternatives:
            lines.append(f"   ... {len(plan.alternatives) - max_alternatives} more (plan.alternatives)")
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)).rstrip() for r in rows]


def explain_choice(
    operands: tuple[Layout, ...], cand: Candidate, classes: dict[str, str], sizes: dict[str, int]
) -> str:
    """One line: per mesh axis, what it keeps and what that asks of each operand.

    Each action named is one the candidate's collectives carry out: an operand
    whose lone-reduced axes are summed locally first is read as the candidate
    moves it (``sum z locally``, then its pending sums are reduced, not gathered).
    """
    sources = cand.sources or operands
    parts = []
    for i, (op, src) in enumerate(zip(operands, sources, strict=False)):
        if src is not op and src.axes != op.axes:
            summed = [a for a in op.axes if a not in src.axes]
            parts.append(f"op{i + 1}: sum {', '.join(_axis_name(a) for a in summed)} locally first")
    for m, e in cand.choice:
        if sizes[m] == 1:
            continue
        acts = []
        for i, op in enumerate(sources):
            pos = next((a for a, d in zip(op.axes, op.dims, strict=False) if m in d), None)
            tag = f"op{i + 1}"
            if m in op.unreduced:
                carried = m in cand.targets[i].unreduced
                acts.append(f"carry {tag}'s partial sums" if carried else f"reduce {tag}")
            if e is None:
                if pos is not None:
                    acts.append(f"gather {tag}")
            elif pos == e:
                continue
            elif pos is not None and e in op.axes:
                acts.append(f"all-to-all {tag} {_axis_name(pos)}→{_axis_name(e)}")
            elif pos is not None:
                acts.append(f"gather {tag}")
            elif e in op.axes:
                acts.append(f"slice {tag}")
        if e is None and m in cand.computed.unreduced:
            head = f"{m}: partial sums carried through the einsum"
        elif e is None:
            head = f"{m}: replicate (compute duplicated)"
        elif classes[e] in (CONTRACTED, LONE):
            head = f"{m}: keep {_axis_name(e)} split ({classes[e]}) → partial sums"
        else:
            head = f"{m}: keep {_axis_name(e)} split ({classes[e]})"
        parts.append(head + (" [" + ", ".join(acts) + "]" if acts else ""))
    res = {
        "complete": "",
        "requested": "",
        "reduce-scatter": "; reduce-scatter the result",
        "unreduced": "; leave the result as pending sums",
    }[cand.resolution]
    return ("; ".join(parts) or "nothing sharded") + res


def roles(operands: tuple[Layout, ...], cand: Candidate, classes: dict[str, str], weight: int | None) -> dict[str, str]:
    """Each mesh axis's role in the candidate (module doc), mesh axes of size 1 left out."""
    out: dict[str, str] = {}
    sizes = {m.name: m.size for m in cand.out.mesh}
    for m, e in cand.choice:
        if sizes[m] == 1:
            continue
        if e is None:
            out[m] = "replicated"
            continue
        cls = classes[e]
        if cls in (CONTRACTED, LONE):
            role = "row-parallel TP"
        elif weight is not None and e in operands[weight].axes and cls != BATCH:
            role = "column-parallel TP"
        elif e in SEQ_NAMES:
            role = "sequence parallel"
        elif e in HEAD_NAMES:
            role = "head-parallel TP"
        else:
            role = "data parallel"
            if weight is not None:
                w_src = operands[weight]
                if any(m in d for d in w_src.dims) and not any(m in d for d in cand.targets[weight].dims):
                    role = "FSDP"
        out[m] = f"{role} on {'…' + e[3:] if e.startswith('...') else e}"
    return out


def strategy_name(role_of: dict[str, str]) -> str:
    """Combine per-axis roles into one name (module doc)."""
    kinds = {r.split(" on ")[0] for r in role_of.values()} - {"replicated"}
    if not kinds:
        return "replicated"
    tp = {k for k in kinds if "TP" in k}
    dp = kinds - tp
    if tp and dp:
        if "FSDP" in dp:
            return "FSDP×TP"
        if dp == {"sequence parallel"}:
            return "sequence parallel × TP"
        return "hybrid DP×TP"
    if len(tp) == 2:
        return "2-D TP"
    if len(kinds) == 1:
        return kinds.pop()
    if "FSDP" in kinds:
        return "FSDP"
    return " + ".join(sorted(kinds))


def tutorial_view(cand: Candidate, classes: dict[str, str]) -> str:
    """The einshard-tutorial name: DP (all kept axes free/batch), 1-D TP (all reduced), hybrid, replicated."""
    kept = [classes[e] for m, e in cand.choice if e is not None]
    if not kept:
        return "replicated"
    reduced = [c in (CONTRACTED, LONE) for c in kept]
    if all(reduced):
        return "1-D TP"
    if not any(reduced):
        return "DP"
    return "hybrid"
