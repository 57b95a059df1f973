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

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ...core.layout import Layout

if TYPE_CHECKING:
    from .costing import OpCosts
    from .oplog import OpLog

__all__ = [
    "WalkerLike",
    "Rule",
    "RULES",
    "register",
    "unfollowed",
    "call_rule",
    "sub_jaxpr",
    "sharding_degree",
    "inherit",
]


class WalkerLike(Protocol):
    """What a rule may use of the walk (:class:`.walker.Walker` is the one implementation, and the planner's
    ``DependencyWalker`` a subclass): the rules type against this, so that they never import the walker, which
    steps through them (the registry's import cycle, issue 23)."""

    costs: OpCosts
    quiet: bool  # a dry run (a scan carry's fixed point): nothing is recorded
    ops: OpLog  # list-like; a replayed stretch's ops made when read
    env: dict[Any, Layout]  # the layouts bound so far by the innermost walk
    uses: dict[int, list[tuple[Any, int]]]
    summed: dict[int, frozenset[str]]
    program_outputs: set[int]
    pinned: set[int]  # values whose layout the user fixed (arguments, sharding constraints), by id
    pulled: dict[int, tuple[tuple[str, ...], ...]]  # values a loop's fixed carry pulls to its split, by id
    hoisted: dict[int, int]  # loop bodies' constants, by id: their gathers run at the loop's own repeat
    requested: dict[int, tuple[tuple[str, ...], ...]]
    asked_answers: dict[Any, Any]
    sub_envs: dict[tuple[int, ...], dict[Any, Layout]]
    call_path: tuple[int, ...]

    def __init__(self, costs: OpCosts, quiet: bool = False) -> None: ...

    def replicated(self, aval: Any) -> Layout: ...

    def free(self, aval: Any) -> Layout: ...

    def relayout(self, aval: Any, dims: Sequence[tuple[str, ...]]) -> Layout: ...
    def relay(self, v: Any, lay: Layout) -> Layout: ...

    def settle_repeats(
        self, eqn: Any, phase: str, out_aval: Any, dims: Sequence[tuple[str, ...]], repeat: int, why: str
    ) -> list[tuple[str, ...]]: ...

    def record(
        self,
        eqn: Any,
        phase: str,
        expression: str,
        out: Layout | None,
        collectives: tuple[Any, ...],
        flops: float,
        time_s: float,
        repeat: int,
        note: str = "",
    ) -> None: ...

    def change(self, eqn: Any, phase: str, src: Layout, dst: Layout, dtype: Any, repeat: int, why: str) -> None: ...

    def bind_copy(self, v: Any, lay: Layout) -> None: ...

    def bind_dot_copy(self, eqn: Any, p: int, lay: Layout) -> None: ...

    def bind_sent(self, eqn: Any, lay: Layout) -> None: ...

    def already_moved(self, ins: list[Layout], c: Any, as_move: bool = False, group: tuple[str, ...] = ()) -> bool: ...

    def no_rule(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]: ...

    def walk(
        self,
        jaxpr: Any,
        in_layouts: list[Layout],
        repeat: int,
        phase_hint: str | None,
        env: dict[Any, Layout] | None = None,
    ) -> list[Layout]: ...

    def walk_call(
        self,
        eqn: Any,
        body: Any,
        ins: list[Layout],
        repeat: int,
        phase_hint: str | None,
        leaving: tuple[int, ...] = (),
        asked: tuple[tuple[int, tuple[tuple[str, ...], ...]], ...] = (),
    ) -> list[Layout]: ...

    def dtype(self, eqn: Any) -> Any: ...


Rule = Callable[[WalkerLike, Any, list[Layout], int, str], list[Layout]]

RULES: dict[str, Rule] = {}


def register(*names: str) -> Callable[[Rule], Rule]:
    """Register a rule for primitives by name (names, not objects: they move between JAX versions)."""

    def deco(rule: Rule) -> Rule:
        for name in names:
            RULES[name] = rule
        return rule

    return deco


def unfollowed(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """The default rule: priced as XLA runs an op it cannot partition, named in the report (:meth:`Walker.no_rule`)."""
    return w.no_rule(eqn, ins, repeat, phase)


def sub_jaxpr(eqn: Any) -> Any:
    """The jaxpr a call-like equation runs (``jaxpr``, ``call_jaxpr`` or ``fun_jaxpr``), or None."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None and (hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns")):
            return sub
    return None


def call_rule(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
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
    from .rules_indexing import asked_of_call_result

    # A layout asked of the call's result is asked of its body's.
    asked = tuple(
        (k, want)
        for k, (v, iv) in enumerate(zip(eqn.outvars, inner.outvars))
        if not hasattr(iv, "val") and (want := asked_of_call_result(w, v, iv, inner)) is not None
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
