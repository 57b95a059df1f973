"""Naming a candidate the way users talk: data parallel, column/row-parallel TP, FSDP, ...

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
"""

from __future__ import annotations

from ..core.layout import Layout
from .rule import BATCH, CONTRACTED, LONE, Candidate

__all__ = ["pick_weight", "roles", "strategy_name", "tutorial_view"]

BATCH_NAMES = frozenset({"b", "batch", "bs", "batch_size", "B"})
HEAD_NAMES = frozenset({"h", "head", "heads", "H"})
SEQ_NAMES = frozenset({"s", "seq", "sequence", "t", "time", "l", "len", "length", "tokens", "token", "S", "T", "L"})


def pick_weight(operands: tuple[Layout, ...], classes: dict[str, str]) -> int | None:
    """The index of the operand taken as the weight, or None (module doc)."""
    if len(operands) < 2:
        return None
    candidates = [
        i
        for i, op in enumerate(operands)
        if not any(a in BATCH_NAMES or a in SEQ_NAMES or classes.get(a) == BATCH for a in op.axes)
    ]
    return candidates[-1] if candidates else None


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
