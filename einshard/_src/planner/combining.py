"""Collective combining: which of ``explain``'s collectives XLA merges into one op, and the latency that saves.

XLA's combiners (``AllReduceCombiner``, ``AllGatherCombiner``,
``ReduceScatterCombiner``) merge collectives of one kind over the same
device groups into one tuple-shaped op when neither depends on the other:
a data-parallel step's gradient all-reduces (29 of them in a 2-layer Flax
transformer) run as *one* all-reduce.  ``explain`` charges every collective
its own α (per-hop latency); the planner charges α once per combined op and
keeps every byte (the merged op sends the same bytes).

To know which collectives are independent, the walk is repeated by
:class:`DependencyWalker`, a :class:`~einshard.analysis.program.walker.Walker`
that also follows, per value, the set of collectives upstream of it (a
bitmask).  Collectives are then grouped greedily in program order (a
topological order): one joins the first group of its kind, mesh axes and
repeat count none of whose members is upstream of it.  Sub-jaxprs (calls,
scan bodies) map their inputs and outputs positionally onto the call's.
The byte threshold XLA puts on a combined op (tens of MiB) is not modelled.

Which kinds merge is the backend's (:data:`COMBINER_RULES`, keyed by the profile's name): XLA:CPU runs its
all-reduce combiner only (two independent all-gathers stay two ops) and compiles a reduce-scatter as an
all-reduce whose result is sliced, so an FSDP step's gradient reduce-scatters merge with the loss's all-reduce
into one tuple op (tests/test_combining_outputs.py compiles each case and counts XLA's ops).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

from ..analysis.program import ProgramReport, TracedProgram
from ..analysis.program.report import OpReport
from ..analysis.program.segment_memo import PlainTable, plain_table, record_table
from ..analysis.program.walker import Walker
from ..core.layout import Layout

__all__ = ["COMBINER_RULES", "CombinedCollectives", "CombinerRule", "DependencyWalker", "combined_report"]


@dataclass(frozen=True)
class CombinedCollectives:
    """What combining changes: ops XLA runs (each repeat counted), and the latency it saves per device."""

    ops: int
    saved_s: float


@dataclass(frozen=True)
class CombinerRule:
    """What one backend's XLA merges: the kinds its combiners take, and the kind each collective is compiled as
    (a kind compiled as another merges with that one)."""

    merged: frozenset[str]
    compiled_as: tuple[tuple[str, str], ...] = ()

    def kind_of(self, kind: str) -> str | None:
        """The kind ``kind`` merges as, or None where it is never merged."""
        kind = dict(self.compiled_as).get(kind, kind)
        return kind if kind in self.merged else None


_EVERY_KIND = CombinerRule(
    frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"})
)

# By profile name; a profile not named here merges every kind with its own kind (GPU and TPU run the all-reduce,
# all-gather and reduce-scatter combiners; measured on XLA:CPU only, jax 0.10.2).
COMBINER_RULES: dict[str, CombinerRule] = {
    "cpu": CombinerRule(frozenset({"all-reduce"}), (("reduce-scatter", "all-reduce"),)),
}


class _Coll(NamedTuple):
    """One collective as the combiner groups it (a tuple: a deep model's replays make hundreds of thousands per
    plan, each at C speed, :meth:`DependencyWalker._append_replayed`)."""

    kind: str
    axes: tuple[str, ...]
    group_size: int
    repeat: int
    upstream: int  # bitmask of the collectives this one depends on
    bit: int


class DependencyWalker(Walker):
    """A walker that also knows, per value, which collectives it depends on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # id(jaxpr var) -> bitmask of upstream collectives (a table logged while a stretch is recorded: segment_begin)
        self.masks: dict[int, int] = PlainTable()
        self.colls: list[_Coll] = []
        self._eqns: list[Any] = []  # the equations being stepped (innermost last)
        self._change_mask: int | None = None
        self._last_outs: list[int] | None = None

    def _mask_of(self, vars_: Any) -> int:
        # Literals are never keys of ``masks`` (only the jaxprs' variables are), so they read as 0.
        masks = self.masks
        m = 0
        for v in vars_:
            m |= masks.get(id(v), 0)
        return m

    def record(self, eqn: Any, phase: str, expression: str, out: Layout | None, collectives: Any, *rest: Any) -> None:
        n = len(self.ops)
        super().record(eqn, phase, expression, out, collectives, *rest)
        if len(self.ops) == n or not collectives:
            return
        op: OpReport = self.ops[-1]
        if self._change_mask is not None:
            base = self._change_mask
        elif hasattr(eqn, "invars"):
            # An equation's collectives come after its operands' upstream ones.  The program's end (``output``:
            # an output brought to its layout, a pending sum settled) reads the one output value it is given as
            # ``invars``: its settlement waits for that value's own upstream collectives only, so a data-parallel
            # step's gradient all-reduces are independent of each other and XLA's AllReduceCombiner merges them
            # into one tuple op (tests/test_combining_outputs.py).
            base = self._mask_of(eqn.invars)
        else:
            # Nothing says what it reads: after everything so far.
            base = (1 << len(self.colls)) - 1
        dot = op.primitive == "dot_general"
        chain = 0
        for c in collectives:
            # A dot's operand moves are independent of each other; its result's reduction and
            # every step of a layout change come after what precedes them.
            independent = dot and str(getattr(c, "tensor", "")).startswith("operand")
            bit = len(self.colls)
            up = base if independent else base | chain
            self.colls.append(_Coll(c.kind, tuple(c.axes), c.group_size, op.repeat, up, bit))
            chain |= 1 << bit

    def change(self, eqn: Any, phase: str, src: Layout, dst: Layout, dtype: Any, repeat: int, why: str) -> None:
        source = self._source.get(id(src))
        prev = self._change_mask
        if source is not None:
            self._change_mask = self.masks.get(source[1], 0)
        elif eqn.primitive.name == "output":
            self._change_mask = None
        try:
            super().change(eqn, phase, src, dst, dtype, repeat, why)
        finally:
            self._change_mask = prev

    def walk(
        self, jaxpr: Any, in_layouts: list[Layout], repeat: int, phase_hint: str | None, env: Any = None
    ) -> list[Layout]:
        if self._eqns and not self.quiet:
            outer = self._eqns[-1]
            outer_vars = list(getattr(outer, "invars", ()))
            inner = list(jaxpr.invars)
            if len(outer_vars) >= len(inner):
                tail = outer_vars[len(outer_vars) - len(inner) :]
                for v, o in zip(inner, tail):
                    self.masks[id(v)] = self._mask_of([o])
            else:
                every = self._mask_of(outer_vars)
                for v in inner:
                    self.masks[id(v)] = every
        outs = super().walk(jaxpr, in_layouts, repeat, phase_hint, env)
        self._last_outs = [self._mask_of([v]) for v in jaxpr.outvars]
        return outs

    def step(self, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
        before = len(self.colls)
        mask_in = self._mask_of(eqn.invars)
        self._eqns.append(eqn)
        self._last_outs = None
        try:
            outs = super().step(eqn, ins, repeat, phase)
        finally:
            self._eqns.pop()
        inner = self._last_outs
        masks = self.masks
        if inner is not None and len(inner) == len(eqn.outvars):
            # A call: each result depends on what its inner result depends on.
            for v, m in zip(eqn.outvars, inner):
                masks[id(v)] = mask_in | m
        else:
            after = len(self.colls)
            m = mask_in | ((1 << after) - (1 << before)) if after > before else mask_in  # + the step's own
            for v in eqn.outvars:
                masks[id(v)] = m
        self._last_outs = None
        return outs

    # A call body's tape (einshard.analysis.program.blocks) keeps each collective's dependences as
    # (which of the body's operands, which of the body's own earlier collectives): operand k is
    # given bit k while the body is recorded, the body's collectives the bits after them.
    def tape_begin(self, box: Walker, body: Any) -> None:
        box = cast(DependencyWalker, box)  # the sandbox is a walker of this one's type
        for k, v in enumerate(body.invars):
            box.masks[id(v)] = 1 << k
            box.colls.append(_Coll("", (), 1, 1, 0, k))  # a placeholder: a group of one is never combined

    def tape_extra(self, box: Walker, body: Any) -> Any:
        box = cast(DependencyWalker, box)
        n = len(body.invars)
        operands = (1 << n) - 1
        colls = tuple(
            (c.kind, c.axes, c.group_size, c.repeat, c.upstream & operands, c.upstream >> n) for c in box.colls[n:]
        )
        outs = tuple((m & operands, m >> n) for m in (box._mask_of([v]) for v in body.outvars))
        return n, colls, outs

    def tape_replay(self, tape: Any, eqn: Any) -> None:
        n, colls, outs = tape.extra
        if self.quiet:
            return
        outer = list(eqn.invars)
        if len(outer) >= n:
            entering = [self._mask_of([o]) for o in outer[len(outer) - n :]]
        else:
            entering = [self._mask_of(outer)] * n
        real = self._append_replayed(colls, entering)
        self._last_outs = [real(operands, own) for operands, own in outs]

    # A repeated top-level stretch's tape (einshard.analysis.program.segment_memo) keeps each collective's and
    # each value's dependences as (which of the stretch's entering values, which of its own collectives): while
    # it is recorded, entering value k carries a placeholder bit of its own; at its end the placeholders are
    # put back as the entering values' real masks, and a dependence on anything else opens it (not kept).
    def segment_begin(self, copy: Any, rec: Any) -> Any:
        start, n = len(self.colls), len(copy.entering)
        saved = [self.masks.get(id(v)) for v in copy.entering]
        for k, v in enumerate(copy.entering):
            self.colls.append(_Coll("", (), 1, 1, 0, start + k))
            self.masks[id(v)] = 1 << (start + k)
        self.masks = record_table(self.masks, rec, "masks")
        return start, n, saved

    def segment_end(self, copy: Any, begun: Any, rec: Any) -> tuple[Any, bool]:
        start, n, saved = begun
        self.masks = plain_table(self.masks)
        entering = [m or 0 for m in saved]
        low = (1 << start) - 1
        closed = True

        def split(m: int) -> tuple[int, int]:
            nonlocal closed
            if m & low:
                closed = False
            return (m >> start) & ((1 << n) - 1), m >> (start + n)

        def real(m: int) -> int:
            operands, own = split(m)
            out = (m & low) | (own << start)
            k = 0
            while operands:
                if operands & 1:
                    out |= entering[k]
                operands >>= 1
                k += 1
            return out

        new = self.colls[start + n :]
        colls = tuple((c.kind, c.axes, c.group_size, c.repeat, *split(c.upstream)) for c in new)
        self.colls[start:] = [
            _Coll(c.kind, c.axes, c.group_size, c.repeat, real(c.upstream), start + i) for i, c in enumerate(new)
        ]
        masks = []
        for tok in dict.fromkeys(rec.masks):
            if tok[0] == "e":
                closed = False
                continue
            v = id(copy.value(tok))
            if tok in copy.escaping:
                # Only a value read after the copy has its mask read again (a later step's operands, a later
                # copy's entering values, the program's outputs): a replay sets those only.
                masks.append((tok, *split(self.masks[v])))
            self.masks[v] = real(self.masks[v])
        for v, m in zip(copy.entering, saved):
            if m is None:
                self.masks.pop(id(v), None)
            else:
                self.masks[id(v)] = m
        return (colls, tuple(masks)), closed

    def segment_replay(self, extra: Any, copy: Any) -> None:
        colls, masks = extra
        get = self.masks.get
        real = self._append_replayed(colls, [get(i, 0) for i in copy.entering_ids])
        if masks:
            # The ids of the values whose masks it sets at this copy, found once per copy and tape (OpCosts'
            # segment_masks: a deep model replays each tape at every layer of every costing it is kept for).
            kept = self.costs.segment_masks
            hit = kept.get((id(copy), id(masks)))
            if hit is None or hit[0] is not copy or hit[1] is not masks:
                hit = kept[(id(copy), id(masks))] = (copy, masks, [id(copy.value(tok)) for tok, _, _ in masks])
            table = self.masks
            for ident, (_, operands, own) in zip(hit[2], masks):
                table[ident] = real(operands, own)

    def _append_replayed(self, colls: Any, entering: list[int]) -> Callable[[int, int], int]:
        """Append a tape's collectives with their dependency masks made real here; returns that reading.

        A tape keeps each mask as (the entering values it depends on, as bits ``operands``; the tape's own
        collectives, as bits ``own`` counted from the tape's first): here the own bits move to where the tape's
        collectives now start and the entering values' masks are or-ed in."""
        start = len(self.colls)
        made: dict[int, int] = {0: 0}  # operands -> the or of their masks (a tape's collectives share a few)
        # The entering values that depend on any collective (a layer's weights, the program's arguments, depend on
        # none): only their bits of ``operands`` add to a mask, so the others are dropped before it is made or
        # looked up (fewer distinct operands, and fewer bits to or).
        live = 0
        for k, m in enumerate(entering):
            if m:
                live |= 1 << k

        def real(operands: int, own: int) -> int:
            operands &= live
            mask = made.get(operands)
            if mask is None:
                mask = made[operands] = _or_of(operands, entering)
            return mask | (own << start)

        # A deep model replays its layers' collectives at every layer of every costing: each is made here without
        # a call per mask, as a tuple made at C speed (the NamedTuple's own __new__ is a Python call).
        append, new, get = self.colls.append, tuple.__new__, made.get
        for i, (kind, axes, size, repeat, operands, own) in enumerate(colls, start):
            operands &= live
            mask = get(operands)
            if mask is None:
                mask = made[operands] = _or_of(operands, entering)
            append(new(_Coll, (kind, axes, size, repeat, mask | (own << start), i)))
        return real

    def combined(self, profile: Any, sizes: dict[str, int]) -> CombinedCollectives:
        """Greedy grouping in program order; α charged once per group (per repeat).

        A collective joins the first group of its kind, axes and repeat none of whose members is upstream of it.
        The groups before the one that took the latest collective of that key upstream of it are never tried:
        each is known to hold one of that collective's own upstream collectives (it was tried and refused them)
        or that collective itself, and an upstream mask holds its collectives' upstream masks (a value's mask is
        its operands' and its own collectives').  Without that, a chain of layers (each layer's tensor-parallel
        all-reduce upstream of the next's: a group per layer) tries every earlier layer's group at every layer,
        quadratic in the depth; with it each collective tries the groups from there on (:func:`greedy_groups`
        is the plain greedy: tests/test_segment_memo.py checks both agree)."""
        return _combine(self.colls, profile, sizes, skip_upstream=True)


def _or_of(operands: int, entering: list[int]) -> int:
    """The or of the masks ``entering[k]`` for each bit ``k`` set in ``operands`` (its set bits only: a copy's
    collective depends on a few of its entering values, at any of their positions)."""
    mask = 0
    while operands:
        low = operands & -operands
        mask |= entering[low.bit_length() - 1]
        operands ^= low
    return mask


def greedy_groups(colls: list[_Coll], profile: Any, sizes: dict[str, int]) -> CombinedCollectives:
    """The combining of ``colls`` as the greedy grouping states it, every open group tried in order (the reference
    :meth:`DependencyWalker.combined` is checked against)."""
    return _combine(colls, profile, sizes, skip_upstream=False)


def _combine(colls: list[_Coll], profile: Any, sizes: dict[str, int], skip_upstream: bool) -> CombinedCollectives:
    groups: dict[tuple[Any, ...], list[int]] = {}  # key -> members' bitmask per open group
    members_of_key: dict[tuple[Any, ...], int] = {}  # key -> the bits of its collectives
    group_of: dict[int, int] = {}  # a collective's bit -> the index of its group among its key's
    alphas: dict[tuple[Any, ...], float] = {}
    rule = COMBINER_RULES.get(getattr(profile, "name", ""), _EVERY_KIND)
    saved = 0.0
    ops = 0
    # The kind each kind merges as, asked once per kind (a deep model's costing has thousands of collectives of a
    # few kinds; rule.kind_of builds its table at every call).
    merged_kinds: dict[str, str | None] = {}
    for c in colls:
        kind, axes, size, repeat, upstream, bit = c  # (a tuple: unpacked at C speed, thousands per costing)
        if size <= 1:
            continue
        if kind in merged_kinds:
            merged_as = merged_kinds[kind]
        else:
            merged_as = merged_kinds[kind] = rule.kind_of(kind)
        if merged_as is None:
            ops += repeat  # an op of its own
            continue
        key = (merged_as, axes, repeat)
        open_groups = groups.setdefault(key, [])
        first = 0
        own = 1 << bit  # (masks run to thousands of bits in a deep model: made once)
        members = members_of_key.get(key, 0)
        if skip_upstream:
            upstream_here = upstream & members
            if upstream_here:
                first = group_of[upstream_here.bit_length() - 1] + 1
        for i in range(first, len(open_groups)):
            if upstream & open_groups[i] == 0:
                open_groups[i] |= own
                group_of[bit] = i
                at = (kind, axes, size)
                alpha = alphas.get(at)
                if alpha is None:
                    alpha = alphas[at] = _alpha(profile, c, sizes)
                saved += alpha * repeat
                break
        else:
            group_of[bit] = len(open_groups)
            open_groups.append(own)
            ops += repeat
        members_of_key[key] = members | own
    return CombinedCollectives(ops, saved)


def _alpha(profile: Any, c: _Coll, sizes: dict[str, int]) -> float:
    """The latency part of one collective's α–β time (what a combined op pays once)."""
    axis_sizes = tuple(sizes[a] for a in c.axes) if all(a in sizes for a in c.axes) else None
    n = math.prod(axis_sizes) if axis_sizes else c.group_size
    return float(profile.collective_time(c.kind, n, 0.0, 0.0, axis_sizes))


def combined_report(
    traced: TracedProgram, in_specs: Any, out_specs: Any = None
) -> tuple[ProgramReport, CombinedCollectives]:
    """``traced.report(in_specs, out_specs)`` walked by a :class:`DependencyWalker`, with its combining."""
    walker = DependencyWalker(traced.costs)
    with _collector_paused():
        # No forks (alternatives.py): the planner ranks by costs, which forks leave as they are, and a fork is a walk
        # more.
        report = traced.report(in_specs, out_specs, walker=walker, forks=0)
        # the latency a merged op saves, as the profile prices collectives (not as the walk ranks them)
        return report, walker.combined(traced.costs.profile.pricing(), {m.name: m.size for m in traced.mesh})


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector held off for one costing.

    A costing allocates hundreds of thousands of small objects (layouts, ops, tape entries) that reference counting
    frees, and next to them the traced program's caches (tapes, layouts, summaries) live on: each of the collector's
    full passes, triggered by the allocations alone, walks all of those, and the more layers the more there is to
    walk (an unrolled 24-layer llama spent a fifth of its plan's CPU time there).  The cycles a costing leaves are
    collected by the next pass after it.  Where the collector is off already, it stays off.

    On the way out, what the costing allocated and still holds (its report's ops, the tapes and summaries it kept)
    goes straight to the oldest generation (``gc.freeze()`` then ``gc.unfreeze()``: two list splices) instead of
    waiting for the young pass that the costing's allocations have long overdue: that pass walked every object the
    costing kept, then the middle one walked them again, one more pass per costing the more layers there are (at 80
    layers ~5 s of a ~23 s plan, a fifth).  Objects the planner keeps end up in the oldest generation anyway; the
    cycles a costing leaves are collected by the next full pass.  Where the process has frozen objects of its own
    (``gc.freeze()`` before a fork), they stay frozen: the costing's objects take the young pass as before."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        _promote_young()
        gc.enable()


def _promote_young() -> None:
    """Move every object the collector tracks into its oldest generation, without a pass over them (and the count
    of new allocations back to zero), unless the process froze objects itself (``unfreeze`` would thaw them)."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()
