"""Layout rules for ``while`` and ``cond``: loops and branches with split operands.

* ``cond``: XLA compiles every branch, and each branch's collectives are in the program (one runs per
  step).  Every branch is walked with the operands' layouts and its collectives recorded (as the HLO
  lists them); the result takes the first branch's layout and the other branches' results are brought
  to it.
* ``while``: as a ``scan`` carry, the loop's carry settles to the layout the body makes of it (walked
  once quietly, the initial carry moved there once, outside the loop), then the condition and the body
  are walked for real.  The trip count of a ``while_loop`` is a run-time value: its body's collectives
  are counted once, as a static reading of the HLO counts them, and the op is marked approximate when
  the body moves data (per step it is ×trips).  ``fori_loop`` with static bounds is a ``scan`` in the
  jaxpr and counts per iteration.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout
from .costing import is_free
from .movement import APPROXIMATE
from .registry import inherit, register

if TYPE_CHECKING:
    from .walker import Walker

__all__ = ["cond", "while_loop"]


def _inner(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr


@register("cond")
def cond(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    branches = [_inner(b) for b in eqn.params["branches"]]
    operands = ins[1:]
    results = [w.walk(b, list(operands), repeat, inherit(phase)) for b in branches]
    first = results[0]
    outs = []
    for k, v in enumerate(eqn.outvars):
        lay = first[k]
        want = lay if is_free(lay) else w.relayout(v.aval, lay.dims)
        for other in results[1:]:
            got = other[k]
            if not is_free(got) and not is_free(want) and got.dims != want.dims:
                w.change(eqn, phase, got, got.with_dims(want.dims), v.aval.dtype, repeat, "cond branches disagree")
        outs.append(want)
    return outs


@register("while")
def while_loop(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    p = eqn.params
    body, cond_j = _inner(p["body_jaxpr"]), _inner(p["cond_jaxpr"])
    nc, nb = int(p["cond_nconsts"]), int(p["body_nconsts"])
    cconsts, bconsts, carry = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
    quiet = type(w)(w.costs, quiet=True)
    first = quiet.walk(body, [*bconsts, *carry], 1, inherit(phase))
    settled = []
    for v, lay, out in zip(eqn.outvars, carry, first):
        want = w.relayout(v.aval, out.dims) if not is_free(out) else lay
        if not is_free(lay) and lay.dims != want.dims:
            w.change(eqn, phase, lay, lay.with_dims(want.dims), v.aval.dtype, repeat, "while carry settles")
        settled.append(want)
    start = len(w.ops)
    w.walk(cond_j, [*cconsts, *settled], repeat, inherit(phase))
    res = w.walk(body, [*bconsts, *settled], repeat, inherit(phase))
    if not w.quiet and len(w.ops) > start:
        note = f"{APPROXIMATE}: a while loop's trip count is known at run time; its body's collectives counted once"
        for i in range(start, len(w.ops)):
            w.ops[i] = replace(w.ops[i], note=note)
    return [w.relayout(v.aval, lay.dims) if not is_free(lay) else lay for v, lay in zip(eqn.outvars, res)]
