"""Layout rules for ``while`` and ``cond``: loops and branches with split operands.

* ``cond``: XLA compiles every branch, and each branch's collectives are in the program (one runs per
  step).  Every branch is walked with the operands' layouts and its collectives recorded (as the HLO
  lists them); the result takes the first branch's layout and the other branches' results are brought
  to it.
* ``while``: as a ``scan`` carry, the loop's carry settles to the layout the body makes of it (walked
  once quietly, the initial carry moved there once, outside the loop), then the condition and the body
  are walked for real.  A counted loop (``i < N``, ``i`` from a literal, stepped by 1: what XLA's loop
  analysis recognises) counts its body N times, as the HLO reader does; any other ``while_loop``'s trip
  count is a run-time value: its body's collectives are counted once, and the ops are marked approximate
  (per step they are ×trips).  A gather of one of the body's constants is loop-invariant: XLA makes it once,
  outside the loop (as for a ``scan``), and so is every collective of an op computed from the constants alone
  (:func:`invariant_values`: a concatenation of split kernels, all-to-all'd once).  ``fori_loop`` with static bounds is a ``scan`` in the jaxpr.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ...core.layout import Layout
from .costing import is_free
from .movement import APPROXIMATE
from .registry import WalkerLike, inherit, register

__all__ = ["cond", "invariant_values", "while_loop", "trip_count"]


def _inner(jaxpr: Any) -> Any:
    return jaxpr.jaxpr if hasattr(jaxpr, "consts") else jaxpr


@register("cond")
def cond(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
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
def while_loop(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
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
    trips = trip_count(eqn)
    runs = repeat * (trips if trips is not None else 1)
    w.walk(cond_j, [*cconsts, *settled], runs, inherit(phase))
    outer_path = w.call_path
    env: dict[Any, Layout] = {}  # kept: peak memory counts one iteration's buffers (memory's loop steps)
    w.call_path = (*outer_path, id(eqn))
    # The body's constants: a gather of one is loop-invariant, made once outside the loop, as XLA hoists it
    # (measured: x[b@a] @ w[d@a, f] in a counted loop gathers w once, as in a scan).
    hoisted = {k: repeat for k in invariant_values(body, body.invars[:nb]) if k not in w.hoisted}
    w.hoisted.update(hoisted)
    try:
        res = w.walk(body, [*bconsts, *settled], runs, inherit(phase), env=env)
    finally:
        w.call_path = outer_path
        for k in hoisted:
            w.hoisted.pop(k, None)
    if not w.quiet:
        w.sub_envs[(*outer_path, id(eqn))] = env
    if trips is None and not w.quiet and len(w.ops) > start:
        note = f"{APPROXIMATE}: a while loop's trip count is known at run time; its body's collectives counted once"
        for i in range(start, len(w.ops)):
            w.ops[i] = replace(w.ops[i], note=note)
    return [w.relayout(v.aval, lay.dims) if not is_free(lay) else lay for v, lay in zip(eqn.outvars, res)]


def invariant_values(body: Any, consts: list[Any]) -> set[int]:
    """The ids of a loop body's constants and of the values it computes from them alone, without growing them.

    XLA's while-loop invariant code motion moves such computations out of the loop, and a gather of their
    result with them (measured: Flax's ``OptimizedLSTMCell`` under ``nn.RNN`` concatenates its four gates'
    kernels in the body; on FSDP, x[b@data] @ concat(kernels)[d@data, 4f] gathers the concatenated kernel once,
    outside the loop, not per step: tests/test_loop_rules.py).  Not an op that makes more bytes than it reads
    (a broadcast: XLA leaves size-inflating ops in the loop), nor one with effects or a body of its own.
    """
    invariant = {id(v) for v in consts}
    for e in body.eqns:
        ins = [v for v in e.invars if not hasattr(v, "val")]
        if not ins or e.effects or any(id(v) not in invariant for v in ins):
            continue
        if any(hasattr(p, "eqns") or hasattr(p, "jaxpr") for p in e.params.values()):
            continue
        read = sum(_nbytes(v.aval) for v in ins)
        if sum(_nbytes(v.aval) for v in e.outvars) <= read:
            invariant.update(id(v) for v in e.outvars)
    return invariant


def _nbytes(aval: Any) -> int:
    size = 1
    for n in getattr(aval, "shape", ()):
        size *= int(n)
    return size * getattr(getattr(aval, "dtype", None), "itemsize", 4)


def trip_count(eqn: Any) -> int | None:
    """The trip count of a counted loop (``i < N`` with ``i`` a literal start stepped by 1), as XLA finds it.

    XLA's while-loop analysis recognises the same pattern and the HLO reader counts the body's
    collectives that many times; any other loop's count is a run-time value (None).
    """
    p = eqn.params
    cj, bj = _inner(p["cond_jaxpr"]), _inner(p["body_jaxpr"])
    nc, nb = int(p["cond_nconsts"]), int(p["body_nconsts"])
    if len(cj.eqns) != 1 or cj.eqns[0].primitive.name != "lt":
        return None
    counter, bound = cj.eqns[0].invars
    carried = list(cj.invars[nc:])
    if not hasattr(bound, "val") or not any(counter is v for v in carried):
        return None
    k = next(i for i, v in enumerate(carried) if v is counter)
    init = eqn.invars[nc + nb + k]
    step = next((e for e in bj.eqns if e.outvars and e.outvars[0] is bj.outvars[k]), None)
    if not hasattr(init, "val") or step is None or step.primitive.name != "add":
        return None
    x, one = step.invars
    if x is not bj.invars[nb + k] or not hasattr(one, "val") or int(one.val) != 1:
        return None
    return max(0, int(bound.val) - int(init.val))
