"""The registry of per-primitive layout rules (JAX's own pattern: a dict from primitive to rule).

A rule takes the walker, the jaxpr equation, its operands' layouts, how many
times it runs (scan bodies) and its phase, and returns its results' layouts.
It charges the communication it implies through ``walker.change`` (a layout
change, priced by the analyzer's ``transition``) or ``walker.record``.

A primitive with no rule goes to :func:`unfollowed`: its split operands are
all-gathered (charged), its results are replicated, and its name and source
line are listed in the report, which says on its first line that it is
incomplete: never a silent guess.  Primitives that carry a sub-jaxpr and have no rule of their
own (``pjit``, ``remat``, ``custom_jvp_call``, ...) are walked into by
:func:`call_rule`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout

if TYPE_CHECKING:
    from .walker import Walker

__all__ = ["Rule", "RULES", "register", "unfollowed", "call_rule", "sub_jaxpr", "sharding_degree", "inherit"]

Rule = Callable[["Walker", Any, list[Layout], int, str], list[Layout]]

RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for primitives by name (names, not objects: they move between JAX versions)."""

    def deco(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule

    return deco


def unfollowed(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """The default rule: priced as XLA runs an op it cannot partition, named in the report (:meth:`Walker.no_rule`)."""
    return w.no_rule(eqn, ins, repeat, phase)


def sub_jaxpr(eqn: Any) -> Any:
    """The jaxpr a call-like equation runs (``jaxpr``, ``call_jaxpr`` or ``fun_jaxpr``), or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and (hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns")):
            return sub
    return None


def call_rule(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """A nested call (jit, remat, custom derivatives): walk its body with the operands' layouts."""
    from .costing import is_free

    sub = sub_jaxpr(eqn)
    inner = sub.jaxpr if hasattr(sub, "jaxpr") else sub
    # A call's result that leaves the program (a remat'd layer's weight gradient in a scanned stack) leaves it
    # from inside the call too: its dot's sum stays pending for the consumer outside to settle.
    leaving = tuple(
        k
        for k, (ov, iv) in enumerate(zip(eqn.outvars, inner.outvars))
        if id(ov) in w.program_outputs and not hasattr(iv, "val")
    )
    from .rules_indexing import requested_dims

    # A layout asked of the call's result is asked of its body's.
    asked = tuple(
        (k, want)
        for k, (v, iv) in enumerate(zip(eqn.outvars, inner.outvars))
        if not hasattr(iv, "val") and (want := requested_dims(w, v)) is not None
    )
    # Walked once per structure, entering layouts, leaving and asked-for results, replayed after (identical
    # blocks: see .blocks); the body's environment is kept under this call's path (peak memory inlines the call:
    # Walker.sub_envs).
    inner_outs = w.walk_call(
        eqn, inner, ins[-len(inner.invars) :] if inner.invars else [], repeat, inherit(phase), leaving, asked
    )
    # A sub-jaxpr's broadcast constants stay free: their consumer decides their layout.
    # Pending sums leave the call pending: the consumer outside settles them.
    return [
        w.free(v.aval) if is_free(lay) else _pending(w.relayout(v.aval, lay.dims), lay.unreduced)
        for v, lay in zip(eqn.outvars, inner_outs)
    ]


def _pending(lay: Layout, unreduced: frozenset[str]) -> Layout:
    return lay.with_dims(lay.dims, unreduced) if unreduced else lay


def sharding_degree(lay: Layout) -> int:
    """How many ways a layout splits its tensor (cheap: elementwise ops ask this a lot)."""
    sizes = lay.mesh_sizes
    n = 1
    for d in lay.dims:
        for m in d:
            n *= sizes[m]
    return n


def inherit(phase: str) -> str | None:
    """Sub-jaxprs of a backward op are backward (their own name stacks do not say so)."""
    return "backward" if phase == "backward" else None
