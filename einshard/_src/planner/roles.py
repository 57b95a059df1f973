"""What each axis of a weight does in the program: contracted with the activations (``in``) or kept (``out``).

A strategy label must not guess from the axis order: an Equinox ``Linear``
stores ``(out, in)``, Flax ``(in, out)``, attention kernels are 3-D
(``(d, heads, head_dim)`` for q/k/v, ``(heads, head_dim, d)`` for the output).
Splitting an axis the first matmul *contracts* is row-parallel (its result is
a partial sum); splitting an axis it *keeps* is column-parallel.  So the
roles are read from the traced program: the parameter's value is followed
through dtype casts, copies, transposes, slices (``w[:k]``, a stacked layer's
``w[i]``: ``slice`` / ``dynamic_slice`` then ``squeeze``), new axes
(``broadcast_in_dim``: ``w[None]``), reshapes that only add or drop unit axes,
and nested calls to the first ``dot_general`` that consumes it.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["Role", "Parallel", "weight_roles", "megatron_pairs"]

Role = Literal["in", "out"]

_PASS = {"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier"}
# A slice of the weight keeps its axes (fewer elements along some): the value is still the weight, axis by axis.
_SLICES = {"slice", "dynamic_slice"}
# A tracked position that is no axis of the parameter (a unit axis a reshape added).
_NO_AXIS = -1


def weight_roles(jaxpr: Any, leaf: int, axes: tuple[int, ...] | None = None, depth: int = 0) -> dict[int, Role]:
    """Per axis of the parameter fed as ``jaxpr.invars[leaf]``: ``'in'`` (contracted) or ``'out'`` (kept).

    Empty when no ``dot_general`` consumes it (an embedding table read by a gather, a norm scale).
    """
    if depth > 8 or leaf >= len(jaxpr.invars):
        return {}
    # tracked: jaxpr var -> the parameter's axis at each of the var's positions
    rank = len(getattr(jaxpr.invars[leaf].aval, "shape", ()))
    # A scan's body sees one slice of a stacked value: the leading (layer) axes are gone.
    start = tuple(range(rank)) if axes is None else axes[len(axes) - rank :]
    tracked: dict[Any, tuple[int, ...]] = {jaxpr.invars[leaf]: start}
    for eqn in jaxpr.eqns:
        hits = [(k, tracked[v]) for k, v in enumerate(eqn.invars) if not hasattr(v, "val") and v in tracked]
        if not hits:
            continue
        k, axes = hits[0]
        name = eqn.primitive.name
        if name == "dot_general":
            (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
            contract = lc if k == 0 else rc
            batch = lb if k == 0 else rb
            return {
                a: ("in" if pos in contract else "out")
                for pos, a in enumerate(axes)
                if pos not in batch and a != _NO_AXIS
            }
        if name in _PASS or (name in _SLICES and k == 0):  # (a dynamic_slice's other operands are its indices)
            tracked[eqn.outvars[0]] = axes
        elif name == "squeeze":
            dropped = set(eqn.params["dimensions"])
            tracked[eqn.outvars[0]] = tuple(a for pos, a in enumerate(axes) if pos not in dropped)
        elif name == "broadcast_in_dim" and k == 0:  # jnp.expand_dims, w[None]: the new axes are no axis of w
            out_rank = len(eqn.outvars[0].aval.shape)
            placed = dict(zip(eqn.params["broadcast_dimensions"], axes))
            tracked[eqn.outvars[0]] = tuple(placed.get(pos, _NO_AXIS) for pos in range(out_rank))
        elif name == "reshape" and k == 0:
            kept = _unit_reshape(axes, eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape)
            if kept is not None:
                tracked[eqn.outvars[0]] = kept
        elif name == "transpose":
            perm = eqn.params["permutation"]
            tracked[eqn.outvars[0]] = tuple(axes[p] for p in perm)
        else:
            sub = _sub(eqn)
            if sub is not None and len(eqn.invars) >= len(sub.invars):
                offset = len(eqn.invars) - len(sub.invars)
                if k >= offset:
                    inner = weight_roles(sub, k - offset, axes, depth + 1)
                    if inner:
                        return inner
    return {}


def _unit_reshape(axes: tuple[int, ...], before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...] | None:
    """The parameter axis at each position after a reshape that only adds or drops unit axes (None for any other
    reshape: merged or split axes are no longer one parameter axis each)."""
    if [d for d in before if d != 1] != [d for d in after if d != 1]:
        return None
    real = iter(a for a, d in zip(axes, before) if d != 1)
    return tuple(next(real) if d != 1 else _NO_AXIS for d in after)


def _sub(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is None:
            continue
        inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        if hasattr(inner, "eqns"):
            return inner
    return None


# -- Megatron pairs: which weights are column- and which row-parallel ------------------------------------------------

Parallel = Literal["col", "row"]

# Ops through which a value is still "the weight" (a layer's slice of a stacked weight, a reshaped kernel).
_WEIGHT_VIEWS = _PASS | {"transpose", "reshape", "squeeze", "expand_dims", "slice", "dynamic_slice"}


def megatron_pairs(jaxpr: Any, group_of: dict[int, int]) -> dict[int, Parallel]:
    """Per parameter group, ``'col'`` or ``'row'``: how Megatron tensor parallelism splits it.

    ``group_of`` maps ``jaxpr.invars`` indices (parameter leaves) to their group.  The program is followed
    forward from the inputs: each value carries the set of weights whose matmul last produced it (through
    every op that is not a matmul with a weight: activations, attention, norms, residual adds).  At a
    weight's first ``dot_general`` the weights upstream of its activation operand are its producers.  In
    program order a weight whose producers include a column-parallel one is row-parallel (it contracts the
    split axis, so the activation between them is never gathered); every other one is column-parallel.  That
    is the alternation of Megatron-LM (q/k/v and the MLP's up/gate projections column, the attention output
    and the MLP's down projection row), read from the program rather than from names or axis orders, so it
    holds for Flax, Equinox, Keras or hand-written steps alike.  Groups no ``dot_general`` consumes (an
    embedding table read by a gather, a norm scale) are absent.
    """
    producers: dict[int, frozenset[int]] = {}
    order: list[int] = []
    weights = {jaxpr.invars[i]: g for i, g in group_of.items() if i < len(jaxpr.invars)}
    _flow(jaxpr, {}, weights, producers, order, 0)
    kind: dict[int, Parallel] = {}
    for g in order:
        kind[g] = "row" if any(kind.get(p) == "col" for p in producers[g]) else "col"
    return kind


def _flow(
    jaxpr: Any,
    upstream: dict[Any, frozenset[int]],
    weight: dict[Any, int],
    producers: dict[int, frozenset[int]],
    order: list[int],
    depth: int,
) -> list[frozenset[int]]:
    """One forward pass over ``jaxpr`` (nested jaxprs recursed): the upstream weights of each output."""

    def up(v: Any) -> frozenset[int]:
        return frozenset() if hasattr(v, "val") else upstream.get(v, frozenset())

    for eqn in jaxpr.eqns:
        ins = [up(v) for v in eqn.invars]
        owners = [None if hasattr(v, "val") else weight.get(v) for v in eqn.invars]
        name = eqn.primitive.name
        everything = frozenset().union(*ins) if ins else frozenset()
        sub = _sub(eqn) if depth < 8 else None
        held = [(i, o) for i, o in enumerate(owners) if o is not None]
        if name == "dot_general" and len(held) == 1:
            k, g = held[0]
            if g not in producers:
                producers[g] = ins[1 - k]
                order.append(g)
            outs = [frozenset({g})] * len(eqn.outvars)
        elif name in _WEIGHT_VIEWS and owners and owners[0] is not None:
            weight[eqn.outvars[0]] = owners[0]
            outs = [ins[0]] * len(eqn.outvars)
        elif sub is not None and len(eqn.invars) >= len(sub.invars):
            offset = len(eqn.invars) - len(sub.invars)
            inner_up = {iv: ins[offset + i] for i, iv in enumerate(sub.invars)}
            inner_w = {iv: owners[offset + i] for i, iv in enumerate(sub.invars) if owners[offset + i] is not None}
            got = _flow(sub, inner_up, inner_w, producers, order, depth + 1)  # type: ignore[arg-type]
            outs = got if len(got) == len(eqn.outvars) else [everything] * len(eqn.outvars)
        else:
            outs = [everything] * len(eqn.outvars)
        for v, u in zip(eqn.outvars, outs):
            upstream[v] = u
    return [up(v) for v in jaxpr.outvars]
