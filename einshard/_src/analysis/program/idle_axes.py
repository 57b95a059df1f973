"""A dot whose gathered operand XLA moves onto the mesh axes neither operand uses (``rules_indexing.dot_general``).

Where one operand splits a contracted axis over mesh axes ``M`` that its partner uses on a free or batch axis
(a recurrent cell's hidden state ``h[b, f@model]`` against ``W[3f@model, f]``: the state comes out of the
gates split where the weight splits its rows), the analyzer gathers the operand over ``M``: one all-gather.
XLA's partitioner does that only while the idle mesh axes ``U`` (used by neither operand) have fewer devices
than ``M``.  With ``|U| >= |M|`` it first re-splits the operand's contracted axis from ``M`` onto ``U`` (one
collective-permute of the operand's whole bytes / ``|U|``), then either gathers it over ``U`` or slices the
partner's contracted axis alike and all-reduces the partial products over ``U``, whichever buffer is smaller
(the gathered operand on a tie).  Measured on one-op programs, (16, 32) @ (32, 64) and (8, 64) @ (64, 192):

* (4, 2) ``b a@model, a c@model``: permute 512 B, all-gather over ``data`` 2048 B (explain had one all-gather
  over ``model``); ``b@model a, a@model c``: permute 2048 B, all-reduce of the result over ``data``;
* (2, 4) ``b a@data, a c@data`` and ``b@data a, a@data c``: the same over ``model``;
* (2, 2, 2) ``b@a a, a@a c@b``: permute 2048 B, all-reduce over ``c`` 1024 B (``|U| = |M|``);
* (4, 2) ``b@data a, a@data c`` (FSDP's gather, ``|U| = 2 < 4``): the plain all-gather over ``data``.

Only the plain case is rewritten: the dot's one collective is that all-gather, nothing is summed, the
contracted axis divides over ``U``.  tests/test_scan_carry_rules.py holds it against the compiled HLO.

The same route serves a *free* axis (:func:`gather_route`): where two operands split different result axes over
one mesh axis set ``M`` (``x[b, i@model] . y[b, j@model] -> [i, j]``: the clash
``rules_indexing.passthrough_conflict`` settles), the losing operand is made whole along its axis.  With
``|U| >= |M|`` XLA re-splits that axis from ``M`` onto ``U`` (one collective-permute) and gathers it over ``U``;
with fewer idle devices it gathers over ``M``.  Measured on ``(16, 32) . (16, 64)`` contracting the rows: (4, 2)
and (2, 2, 2) meshes split over 'model' permute 512 B and gather 1536 B over the idle axes; a (2, 4) or (8,)
mesh gathers over 'model'; the batch split over 'c' on (2, 2, 2) leaves 'data' alone idle (2 = |M|): permute and
gather over 'data'.  The permute is a move of the value, so a dot that re-split it onto ``U`` already (the
projection's backward of GPT-2's hidden state ``g[b, s, d@model]`` against ``W_o[h@model, k, d]``) shares it
(XLA's CSE): the kernel gradient ``attn[b, s, h@model, k] . g`` then costs the gather alone.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ...core.layout import Layout
from ..cost import Collective, sent_bytes
from .costing import is_free
from .movement import itemsize
from .registry import WalkerLike

__all__ = ["gather_route", "over_idle_axes", "resplit_onto"]


def over_idle_axes(
    w: WalkerLike, eqn: Any, ins: list[Layout], out: Layout, colls: tuple[Any, ...]
) -> tuple[Any, ...] | None:
    """XLA's collectives for the dot ``eqn`` where it moves a gathered operand onto the idle mesh axes, or None
    where it gathers it as the analyzer does (``colls``: the analyzer's, after CSE; ``out``: the result)."""
    if len(colls) != 1 or colls[0].kind != "all-gather" or len(ins) < 2:
        return None
    gather = colls[0]
    tensor = getattr(gather, "tensor", "")
    if not tensor.startswith("operand ") or not tensor.split()[1].isdigit():
        return None
    k = int(tensor.split()[1]) - 1
    if k not in (0, 1) or any(is_free(lay) or lay.unreduced for lay in ins[:2]):
        return None
    own, partner = ins[k], ins[1 - k]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    contracted = (tuple(lc), tuple(rc))[k]
    partner_contracted = (tuple(lc), tuple(rc))[1 - k]
    moved = tuple(gather.axes)
    # The gathered axes split one contracted axis of the operand, and the partner uses them off its contraction.
    split_at = [i for i in contracted if own.dims[i] and set(own.dims[i]) & set(moved)]
    if len(split_at) != 1 or tuple(own.dims[split_at[0]]) != moved:
        return None
    partner_free = {m for a, d in enumerate(partner.dims) if a not in partner_contracted for m in d}
    if not set(moved) <= partner_free:
        return None
    sizes = w.costs.mesh_sizes
    used = {m for lay in ins[:2] for d in lay.dims for m in d}
    idle = tuple(m for m in sizes if m not in used and sizes[m] > 1)
    n_moved, n_idle = math.prod(sizes[m] for m in moved), math.prod(sizes[m] for m in idle)
    axis = split_at[0]
    if not idle or n_idle < n_moved or own.shape[axis] % n_idle:
        return None
    dtype = eqn.outvars[0].aval.dtype
    wire = _wire(w, gather, own, eqn.invars[k].aval.dtype)
    # The operand re-split onto the idle axes: its local block with the contracted axis over U instead of M.
    others = math.prod(sizes[m] for a, d in enumerate(own.dims) if a != axis for m in d)
    permuted = math.prod(own.shape) * wire // (n_idle * others)
    gathered = gather.array_bytes  # the operand whole along the axis, as the analyzer's all-gather holds it
    result = math.prod(out.shard_shape) * itemsize(dtype)
    profile = w.costs.profile
    group = n_moved * n_idle
    why = "the contracted split moved onto mesh axes neither operand uses"
    permute = Collective(
        "collective-permute",
        moved + idle,
        group,
        int(sent_bytes("collective-permute", group, permuted)),
        int(permuted),
        profile.collective_time("collective-permute", group, permuted, permuted),
        tensor,
        why,
    )
    if gathered <= result:
        sent = sent_bytes("all-gather", n_idle, gathered)
        last = replace(
            gather,
            axes=idle,
            group_size=n_idle,
            bytes=int(sent),
            array_bytes=int(gathered),
            time=profile.collective_time("all-gather", n_idle, sent, gathered),
            why=f"{why}, then gathered over them",
        )
    else:
        sent = sent_bytes("all-reduce", n_idle, result)
        last = Collective(
            "all-reduce",
            idle,
            n_idle,
            int(sent),
            int(result),
            profile.collective_time("all-reduce", n_idle, sent, result),
            "result",
            f"{why}; the partner sliced alike, the partial products summed over them",
        )
    return (permute, last)


def resplit_onto(own: Layout, moved: tuple[str, ...], idle: tuple[str, ...]) -> Layout:
    """``own`` with the contracted axis split over ``moved`` split over the ``idle`` mesh axes instead (the
    operand after XLA's collective-permute)."""
    return own.with_dims(tuple(idle if tuple(d) == moved else tuple(d) for d in own.dims))


def _wire(w: WalkerLike, gather: Any, own: Layout, dtype: Any) -> int:
    """Bytes per element on the wire, as the analyzer's all-gather counted them (a narrow float moved wide)."""
    elements = math.prod(own.shard_shape) * math.prod(
        w.costs.mesh_sizes[m] for m in gather.axes
    )  # the gathered block's elements
    return max(1, gather.array_bytes // elements) if elements else itemsize(dtype)


def gather_route(sizes: dict[str, int], src: Layout, dst: Layout, others: tuple[Layout, ...]) -> Layout | None:
    """Where XLA makes ``src`` whole along one axis on its way to ``dst`` through the idle mesh axes: the layout
    between (that axis split over the idle axes instead), or None where it gathers directly.

    ``dst`` is ``src`` with one axis's split ``M`` dropped and nothing else changed; the idle axes ``U`` are the
    mesh axes (of more than one device) that neither ``src`` nor any of ``others`` (the dot's other operand, as
    settled) uses; XLA takes the route where ``|U| >= |M|`` and the axis divides over ``U`` (module docstring).
    """
    if src.unreduced or dst.unreduced or len(src.dims) != len(dst.dims):
        return None
    changed = [a for a, (s, d) in enumerate(zip(src.dims, dst.dims)) if tuple(s) != tuple(d)]
    if len(changed) != 1 or dst.dims[changed[0]]:
        return None
    axis = changed[0]
    moved = tuple(src.dims[axis])
    used = {m for lay in (src, dst, *others) for d in lay.dims for m in d}
    idle = tuple(m for m in sizes if m not in used and sizes[m] > 1)
    n_moved, n_idle = math.prod(sizes[m] for m in moved), math.prod(sizes[m] for m in idle)
    if not idle or n_idle < n_moved or src.shape[axis] % n_idle:
        return None
    return resplit_onto(src, moved, idle)
