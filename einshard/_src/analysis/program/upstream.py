"""A layout conflict settled upstream: XLA carries the winning split back through the ops that computed the
loser, and gathers where that is a plain all-gather.

Measured (tests/test_moe_rules.py: a router's ``one_hot(top_k) · probs`` weighting an expert-split
``[e, t, d]`` activation whose tokens are split over the same mesh axis; the compiled HLO on (4, 2) and
(2, 2, 2) meshes, Auto and Explicit): XLA does not move the routing weights ``[e, t]`` by an all-to-all at the
``mul`` where the two splits meet.  Its sharding propagation gives the weights the expert split and carries it
backward through their producers (transpose, the sum over ``k``, the ``one_hot · p`` product, the one-hot's
``eq`` against an ``iota``, the broadcasts) for as long as reaching the producer's operand needs more than a
plain gather; where it is one (the broadcast top-k indices and probabilities ``[t, k, 1]``: their tokens
gathered, the size-1 expert axis nothing to split), it all-gathers there.  A value has one layout in XLA: where
a value on the route has another reader that wants it as it is, XLA keeps it and makes the all-to-all where the
splits meet (:func:`readers_agree`).  The values on the way are computed
split by experts (the iota is split for free), and in a gradient their cotangents are summed over the experts
and land on the tokens' split: a reduce-scatter, the gather's transpose (rules_indexing.consumer_split).

:func:`plan_upstream` finds that route (or says there is none: a producer that is an argument, a constraint,
a value already read by an op walked before or wanted as it is by another reader, or an op this module does not
carry a split through); :func:`apply`
binds the carried layouts and charges the gathers.  The rules that meet a conflict (elementwise ops) try it
before moving the operand where they meet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout
from .costing import is_free
from .lookahead import home_of
from .registry import sub_jaxpr
from .values import CARRIERS, ELEMENTWISE, REDUCTIONS

if TYPE_CHECKING:
    from .registry import WalkerLike

__all__ = ["Upstream", "plan_upstream", "apply", "readers_agree"]

Dims = tuple[tuple[str, ...], ...]

# Reductions a split carries back through (the reduced axes come back whole); argmax/argmin read along the axis.
_CARRIED_REDUCTIONS = frozenset(REDUCTIONS - {"argmax", "argmin"})
# Calls whose body a split is carried through (jax.nn.one_hot, silu … are jitted functions).
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})
# How far back a conflict is carried (XLA's propagation is global; this bounds the walk on huge programs).
MAX_DEPTH = 24


@dataclass(frozen=True)
class Upstream:
    """How a conflict is settled upstream: the values relaid (computed split by the winner) and the values
    gathered (a plain all-gather each, the first on each route where that is enough)."""

    relaid: tuple[tuple[Any, Dims], ...]
    gathered: tuple[tuple[Any, Dims], ...]


def plan_upstream(w: WalkerLike, v: Any, want: Dims, at: Any) -> Upstream | None:
    """The route that brings computed value ``v`` (read by equation ``at``) to ``want`` by carrying the split
    back through its producers, or None where XLA would not (or this module cannot follow it)."""
    relaid: dict[int, tuple[Any, Dims]] = {}
    gathered: dict[int, tuple[Any, Dims]] = {}
    chain: set[int] = {id(at)}

    def outer(value: Any, dims: Dims, depth: int) -> bool:
        if hasattr(value, "val"):
            return True
        lay = w.env.get(value)
        if lay is None or is_free(lay) or lay.unreduced:
            return lay is not None and not lay.unreduced
        if tuple(lay.dims) == tuple(dims):
            return True
        if _plain_gather(lay.dims, dims):
            prior = gathered.get(id(value))
            if prior is not None and prior[1] != dims:
                return False
            gathered[id(value)] = (value, dims)
            return True
        if depth > MAX_DEPTH or id(value) in w.pinned or id(value) in w.program_outputs:
            return False
        eqn = _producer(w, value)
        if eqn is None or len(eqn.outvars) != 1 or not readers_agree(w, value, dims, chain):
            return False
        prior = relaid.get(id(value))
        if prior is not None:
            return prior[1] == dims
        relaid[id(value)] = (value, dims)
        chain.add(id(eqn))
        return through(eqn, dims, depth, outer)

    def through(eqn: Any, dims: Dims, depth: int, follow: Any) -> bool:
        name = eqn.primitive.name
        if name in _CALLS and sub_jaxpr(eqn) is not None:
            return _through_call(eqn, dims, depth, follow)
        routes = operand_dims(eqn, dims)
        if routes is None:
            return False
        return all(follow(x, d, depth + 1) for x, d in routes)

    def _through_call(eqn: Any, dims: Dims, depth: int, follow: Any) -> bool:
        sub = sub_jaxpr(eqn)
        body = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        if len(body.outvars) != 1 or len(body.invars) != len(eqn.invars):
            return False
        inner_producers = {id(o): e for e in body.eqns for o in e.outvars}
        to_outer = {id(iv): ov for iv, ov in zip(body.invars, eqn.invars)}
        seen: dict[int, Dims] = {}

        def inner(value: Any, d: Dims, depth: int) -> bool:
            if hasattr(value, "val"):
                return True
            if id(value) in to_outer:
                return follow(to_outer[id(value)], d, depth)
            prior = seen.get(id(value))
            if prior is not None:
                return prior == d
            seen[id(value)] = d
            e = inner_producers.get(id(value))
            if e is None or len(e.outvars) != 1 or depth > MAX_DEPTH:
                return False
            if e.primitive.name in _FREE:
                return True
            return through(e, d, depth, inner)

        return inner(body.outvars[0], dims, depth + 1)

    try:
        if not outer_route(w, v, want, outer):
            return None
        return Upstream(tuple(relaid.values()), tuple(gathered.values()))
    finally:
        # ``outer`` names itself, ``through`` and ``_through_call`` each other: their closure cells form cycles,
        # which hold ``w`` (the walker, with every table of its costing) until a pass of the cyclic collector.
        # Emptied here, the walker is freed by reference counting when its costing ends.
        outer = through = _through_call = None  # type: ignore[assignment]


def outer_route(w: WalkerLike, v: Any, want: Dims, outer: Any) -> bool:
    """Start the route at ``v`` itself: it must be computed (never a plain gather: that is no conflict)."""
    lay = w.env.get(v)
    if lay is None or is_free(lay) or _plain_gather(lay.dims, want):
        return False
    return bool(outer(v, want, 0))


# Producers that make their values on every device for themselves: any split is free.
_FREE = frozenset({"iota", "full", "zeros_like", "empty", "empty2", "broadcast_in_dim_const"})


def operand_dims(eqn: Any, dims: Dims) -> list[tuple[Any, Dims]] | None:
    """Each non-literal operand of ``eqn`` with the split it needs for the result to be split as ``dims``
    (None: the op does not carry a split back: it reads across positions or is not one this module knows)."""
    name = eqn.primitive.name
    out_shape = tuple(int(s) for s in eqn.outvars[0].aval.shape)
    if name in _FREE:
        return []
    if name == "transpose":
        perm = eqn.params["permutation"]
        back: list[tuple[str, ...]] = [()] * len(perm)
        for i, p in enumerate(perm):
            back[p] = dims[i]
        return [(eqn.invars[0], tuple(back))]
    if name == "broadcast_in_dim":
        x = eqn.invars[0]
        shape = tuple(int(s) for s in x.aval.shape)
        at = eqn.params["broadcast_dimensions"]
        return [(x, tuple(dims[j] if shape[i] == out_shape[j] else () for i, j in enumerate(at)))]
    if name in _CARRIED_REDUCTIONS:
        axes = set(eqn.params["axes"])
        x = eqn.invars[0]
        kept = iter(dims)
        return [(x, tuple(() if i in axes else next(kept) for i in range(len(x.aval.shape))))]
    if name in ELEMENTWISE or name in CARRIERS or name in {"eq", "ne", "lt", "le", "gt", "ge", "select_n"}:
        routes = []
        for x in eqn.invars:
            if hasattr(x, "val"):
                continue
            shape = tuple(int(s) for s in getattr(x.aval, "shape", ()))
            if not shape:
                continue
            if len(shape) != len(out_shape):
                return None
            routes.append((x, tuple(d if a == b else () for d, a, b in zip(dims, shape, out_shape))))
        return routes
    return None


def _plain_gather(have: Dims, want: Dims) -> bool:
    """Whether ``want`` only drops mesh axes of ``have`` (an all-gather, no data sent across other axes)."""
    return len(have) == len(want) and all(set(b) <= set(a) and b == a[: len(b)] for a, b in zip(have, want))


def readers_agree(w: WalkerLike, value: Any, dims: Dims, chain: set[int]) -> bool:
    """Whether ``value``'s readers off the route can all take it split as ``dims``: none walked yet (it read the
    old split), and no elementwise reader whose other operands of its shape are laid out another way.

    XLA gives a value one layout.  Where one reader wants it as the route does (a gradient's ``dy · expert_out``
    beside ``dy · routing``, both expert-split) the split is carried back; where another reader wants it as it
    is (``sum(a * b, 0)``'s gradient: the broadcast cotangent meets ``a`` split by rows and ``b`` by columns),
    XLA keeps it and moves the operand where the splits meet (measured: two all-to-alls)."""
    for eqn, _ in w.uses.get(id(value), ()):
        if id(eqn) in chain:
            continue
        if any(o in w.env for o in eqn.outvars if not hasattr(o, "val")):
            return False
        if eqn.primitive.name not in _ELEMENTWISE_READERS:
            continue
        shape = tuple(value.aval.shape)
        for x in eqn.invars:
            if x is value or hasattr(x, "val") or tuple(getattr(x.aval, "shape", ())) != shape:
                continue
            lay = w.env.get(x)
            if lay is not None and not is_free(lay) and any(lay.dims) and tuple(lay.dims) != tuple(dims):
                return False
    return True


_ELEMENTWISE_READERS = frozenset(ELEMENTWISE | CARRIERS | {"eq", "ne", "lt", "le", "gt", "ge", "select_n"})


def _producer(w: WalkerLike, value: Any) -> Any:
    """The equation that computes ``value``, if the walk's use lists know it (one of its operands is read in a
    jaxpr walked so far), else None.

    Looked up where the value is made (:func:`.lookahead.home_of`, indexed once per program), not by scanning
    every use list: a route search runs at each conflict of each costing, and the scan was O(program) each time
    (quadratic in an unrolled model's depth)."""
    home = home_of(w.costs, value)
    if home is None:
        return None
    eqn = home.jaxpr.eqns[home.made_at(value)]
    for x in eqn.invars:
        if not hasattr(x, "val") and any(e is eqn for e, _ in w.uses.get(id(x), ())):
            return eqn
    return None


def apply(w: WalkerLike, eqn: Any, route: Upstream, repeat: int, phase: str) -> None:
    """Bind the carried splits and charge the gathers (each at most once per value and split: XLA reuses it)."""
    for value, dims in route.gathered:
        src = w.env[value]
        dst = src.with_dims(tuple(dims))
        w.change(eqn, phase, src, dst, value.aval.dtype, repeat, "split carried back: gather")
        w.bind_copy(value, dst)
    for value, dims in route.relaid:
        w.env[value] = _private(w.relayout(value.aval, dims))


def _private(lay: Layout) -> Layout:
    """A layout object of its own (the walker tells values apart by their layouts' identity)."""
    return Layout(lay.axes, lay.shape, lay.mesh, lay.dims, lay.unreduced)


def moved_bytes(lay: Layout, itemsize: int) -> int:
    return math.prod(lay.shard_shape) * itemsize
