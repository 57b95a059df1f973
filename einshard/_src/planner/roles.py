"""What each axis of a weight does in the program: contracted with the activations (``in``) or kept (``out``).

A strategy label must not guess from the axis order: an Equinox ``Linear``
stores ``(out, in)``, Flax ``(in, out)``, attention kernels are 3-D
(``(d, heads, head_dim)`` for q/k/v, ``(heads, head_dim, d)`` for the output).
Splitting an axis the first matmul *contracts* is row-parallel (its result is
a partial sum); splitting an axis it *keeps* is column-parallel.  So the
roles are read from the traced program: the parameter's value is followed
through dtype casts, copies, transposes and nested calls to the first
``dot_general`` that consumes it.
"""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["Role", "weight_roles"]

Role = Literal["in", "out"]

_PASS = {"convert_element_type", "copy", "copy_p", "reduce_precision", "optimization_barrier"}


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
            return {a: ("in" if pos in contract else "out") for pos, a in enumerate(axes) if pos not in batch}
        if name in _PASS:
            tracked[eqn.outvars[0]] = axes
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


def _sub(eqn: Any) -> Any:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is None:
            continue
        inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
        if hasattr(inner, "eqns"):
            return inner
    return None
