"""Adapters onto the per-einsum analyzer: what one einsum, one layout change costs (memoised).

A traced program costed under many argument layouts (the planner) meets the
same einsums and the same layout changes again and again; :class:`OpCosts`
remembers them, keyed by the layouts involved.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...core.layout import Layout, MeshAxis
from ...errors import EinshardError
from ..cost import shared_profile, transition, wire_itemsize
from ..einsum.analyze import analyze_layouts, dtype_info
from ..einsum.model import Problem
from .blocks import BodyStructures, Tape, WalkCounts

__all__ = ["OpCosts", "DotResult", "FreeLayout", "is_free", "dot_names", "dot_letters", "adopt", "as_hashable"]


@dataclass(frozen=True)
class DotResult:
    out: Layout
    collectives: tuple[Any, ...]
    flops: float
    time_s: float
    expression: str


class OpCosts:
    """Adapters onto the per-einsum analyzer: one einsum, one layout change."""

    def __init__(self, mesh: tuple[MeshAxis, ...], profile: Any) -> None:
        self.mesh = mesh
        self.mesh_sizes = {m.name: m.size for m in mesh}
        # one device's view while all of the mesh's compute: simulated CPU devices share the host's cores
        self.profile = shared_profile(profile, mesh)
        # Per-op costs, keyed by the operands' layouts: a traced program costed
        # under many argument layouts (the planner) meets the same einsums again and again.
        self._dots: dict[tuple[Any, ...], DotResult] = {}
        self._reshards: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        self.layouts: dict[tuple[Any, ...], Layout] = {}  # (shape, dims) -> Layout, as the walk builds them
        self._phases: dict[int, tuple[Any, str]] = {}  # id(equation) -> (the equation, held so the id stays its, phase)
        self._uses: dict[int, tuple[Any, dict[int, list[tuple[Any, int]]]]] = {}
        # Identical blocks costed once (:mod:`.blocks`): call bodies' walks, by structure and entering layouts.
        self.memoise_blocks = True
        self.tapes: dict[tuple[Any, ...], Tape] = {}
        self.structures = BodyStructures()
        self.counts = WalkCounts()
        # The marked ops (ids of equations) whose rule takes XLA's alternative in this walk: set only while
        # :mod:`.alternatives` walks a fork, empty for every walk whose result is reported.
        self.forced: frozenset[int] = frozenset()
        # Repeated top-level stretches walked once per entering state (:mod:`.segment_memo`): on by default.
        self.memoise_segments = True
        self.segment_tapes: dict[Any, Any] = {}
        # The entering states segment keys have held, each by a number (by equality): a key holds the number, so
        # that looking it up hashes a few ints, not the state's tuple of every entering value's fields (a deep
        # model's thousands of copy starts per costing each hashed one).
        self.segment_states: dict[tuple[Any, ...], int] = {}
        # The keys (with the padding their pads' walk read) of copies whose walk was open: walked plainly again.
        self.segment_open: dict[Any, list[Any]] = {}
        # id(tape) -> its writes by slot, id(copy) -> its keys by slot (segment_memo.ready_tape, copy_slots; held).
        self.segment_ready: dict[int, Any] = {}
        self.segment_slots: dict[int, Any] = {}
        self.segment_terms: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # id(tape) -> (it, its ops' cost terms)
        self.segment_plans: dict[int, Any] = {}  # id(jaxpr) -> its SegmentPlan (the jaxpr held in it)
        # (id(copy), id(a tape's masks)) -> (both, held; the ids of the copy's values those masks are set on): the
        # planner's DependencyWalker.segment_replay.
        self.segment_masks: dict[tuple[int, int], tuple[Any, Any, list[int]]] = {}
        # id(jaxpr) -> (it, its open values: .open_values.OpenValues)
        self.open_values: dict[int, tuple[Any, Any]] = {}
        self.segment_structures: dict[Any, int] = {}  # (run, calls, wiring) -> Copy.structure
        # (id(copy), the splits of what its slices slice) -> (the copy, held; the rows its key holds).
        self.segment_rows: dict[tuple[int, Any], tuple[Any, Any]] = {}
        # (id(the copy before), id(copy)) -> (both, held; their wiring: per entering value of the copy, its index
        # among the one before's entering values or -1, and its slot in the one before where that one made it and
        # lets it escape or -1): what a key takes from the copy before it (Walker._carried).
        self.segment_shared: dict[tuple[int, int], tuple[Any, Any, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        # Those wirings, one object per distinct one (a run's copies are wired alike to the one before: the next
        # copy's key state is found by its id, Walker._state_after).
        self.segment_wirings: dict[
            tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]
        ] = {}
        # (copy's start, id(searched value), a step) -> the values a look-ahead from it visits from that step on (None:
        # a check there reads the copy's values): see segment_memo.past_start.
        self.segment_past: dict[tuple[int, int, int], Any] = {}
        # (id(value), transposes followed) -> the chain a layout asked of it is looked for along (rules_indexing's
        # _ask_chain: the program's structure, the value held in it).
        self.ask_chains: dict[tuple[int, bool], Any] = {}
        # id(equation) -> (the naming, the equation, its op's words): see Walker._words_of (both held, so the ids stay).
        self.words: dict[int, tuple[Any, Any, tuple[str, str, tuple[str, ...]]]] = {}

    def uses_of(self, jaxpr: Any) -> dict[int, list[tuple[Any, int]]]:
        """id(value) -> [(equation, operand index)] of one jaxpr (memoised: the planner walks it again and again)."""
        hit = self._uses.get(id(jaxpr))
        if hit is None or hit[0] is not jaxpr:
            uses: dict[int, list[tuple[Any, int]]] = {}
            for eqn in jaxpr.eqns:
                for k, v in enumerate(eqn.invars):
                    if not hasattr(v, "val"):
                        uses.setdefault(id(v), []).append((eqn, k))
            hit = self._uses[id(jaxpr)] = (jaxpr, uses)  # the jaxpr is held, so its id stays its own
        return hit[1]

    def dot(self, lhs: Layout, rhs: Layout, dimension_numbers: Any, dtype: Any) -> DotResult:
        key = (lhs, rhs, as_hashable(dimension_numbers), str(dtype))
        hit = self._dots.get(key)
        if hit is None:
            hit = self._dots[key] = self._dot(lhs, rhs, dimension_numbers, dtype)
        return hit

    def _dot(self, lhs: Layout, rhs: Layout, dimension_numbers: Any, dtype: Any) -> DotResult:
        lnames, rnames, out_names = dot_names(lhs, rhs, dimension_numbers)
        if is_free(lhs) and not is_free(rhs):
            lhs = adopt(lhs, lnames, rhs, rnames, self.mesh_sizes)
        elif is_free(rhs) and not is_free(lhs):
            rhs = adopt(rhs, rnames, lhs, lnames, self.mesh_sizes)
        dname, itemsize = dtype_info(dtype)
        # What XLA sends of the operands and the partial sums (XLA:CPU: bf16 as f32), which also decides its choice.
        itemsize = wire_itemsize(dname, itemsize, self.profile.narrow_floats)
        ops = (_renamed(lhs, lnames), _renamed(rhs, rnames))
        sizes = dict(zip(lnames, lhs.shape)) | dict(zip(rnames, rhs.shape))
        problem = Problem(ops, tuple(out_names), tuple(sizes.items()), self.mesh, None, itemsize, self.profile)
        plan = analyze_layouts(problem, dname)
        out = plan.out_layout
        positional = Layout(tuple(f"d{i}" for i in range(len(out.axes))), out.shape, out.mesh, out.dims, out.unreduced)
        return DotResult(positional, tuple(plan.collectives), float(plan.flops), float(plan.time), plan.expression)

    def reshard(self, src: Layout, dst: Layout, dtype: Any) -> tuple[Any, ...]:
        # Within a program a value's axes are named by where its layout came from: in_specs' names, or
        # positional ones (d0, d1...) for an op's output.  Two layouts of one shape are the same tensor;
        # their splits are compared position by position, so name the target's axes as the source's.
        dst = same_axes(src, dst)
        key = (src, dst, str(dtype))
        hit = self._reshards.get(key)
        if hit is None:
            dname, itemsize = dtype_info(dtype)
            itemsize = wire_itemsize(dname, itemsize, self.profile.narrow_floats)
            try:
                hit = tuple(transition(src, dst, itemsize=itemsize, profile=self.profile)[1])
            except EinshardError:
                # transition found no direct path (an intermediate layout would not divide):
                # gather to replicated, then slice, which always exists.
                whole = src.with_dims(tuple(() for _ in src.dims), src.unreduced)
                hit = tuple(transition(src, whole, itemsize=itemsize, profile=self.profile)[1])
                hit += tuple(transition(whole, dst, itemsize=itemsize, profile=self.profile)[1])
            self._reshards[key] = hit
        return hit

    def phase_of(self, eqn: Any) -> str:
        """``'backward'`` for an equation JAX's transpose made (its name stack says so), else ``'forward'``;
        remembered per equation (the name stack's string is slow to build, and the planner walks each
        equation hundreds of times)."""
        hit = self._phases.get(id(eqn))
        if hit is None or hit[0] is not eqn:
            hit = self._phases[id(eqn)] = (
                eqn,
                "backward" if "transpose" in str(eqn.source_info.name_stack) else "forward",
            )
        return hit[1]

    def compute_time(self, flops: float) -> float:
        return self.profile.compute_time(flops)


def same_axes(src: Layout, dst: Layout) -> Layout:
    """``dst`` with ``src``'s axis names when both have one shape (itself otherwise, or when the names agree):
    transition compares layouts by axis name, and within a program only positions identify an axis."""
    if src.axes == dst.axes or src.shape != dst.shape:
        return dst
    return Layout(src.axes, dst.shape, dst.mesh, dst.dims, dst.unreduced)


def as_hashable(x: Any) -> Any:
    """``x`` as a hashable memo key (lists and nested lists as tuples)."""
    if type(x) is tuple:
        try:
            hash(x)  # a dot's dimension numbers usually are nested tuples already
            return x
        except TypeError:
            pass
    if isinstance(x, (list, tuple)):
        return tuple(as_hashable(e) for e in x)
    return x


def _renamed(lay: Layout, names: Sequence[str]) -> Layout:
    return Layout(tuple(names), lay.shape, lay.mesh, lay.dims, lay.unreduced)


_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _name(i: int) -> str:
    return _LETTERS[i] if i < 26 else _LETTERS[i // 26 - 1] + _LETTERS[i % 26]


def dot_names(lhs: Layout, rhs: Layout, dn: Any) -> tuple[list[str], list[str], list[str]]:
    """Einsum axis names for a dot_general's operands and result (batch, lhs free, rhs free: XLA's order)."""
    lnames, rnames, out = dot_letters(len(lhs.shape), len(rhs.shape), as_hashable(dn))
    return list(lnames), list(rnames), list(out)


@functools.lru_cache(maxsize=4096)
def dot_letters(lrank: int, rrank: int, dn: Any) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """:func:`dot_names` by the operands' ranks (remembered: the planner names each dot of the program in every
    costing, and a model has a handful of kinds)."""
    (lc, rc), (lb, rb) = dn
    counter = iter(range(10**6))
    lnames = [""] * lrank
    rnames = [""] * rrank
    for i, j in zip(lb, rb):
        lnames[i] = rnames[j] = _name(next(counter))
    for i, j in zip(lc, rc):
        lnames[i] = rnames[j] = _name(next(counter))
    for i in range(len(lnames)):
        if not lnames[i]:
            lnames[i] = _name(next(counter))
    for j in range(len(rnames)):
        if not rnames[j]:
            rnames[j] = _name(next(counter))
    out = [lnames[i] for i in lb]
    out += [lnames[i] for i in range(len(lnames)) if i not in lb and i not in lc]
    out += [rnames[j] for j in range(len(rnames)) if j not in rb and j not in rc]
    return tuple(lnames), tuple(rnames), tuple(out)


# Values whose layout their consumer chooses


@dataclass(frozen=True)
class FreeLayout(Layout):
    """A value every device can make for itself (a broadcast constant, an iota, zeros).

    Its layout is whatever its consumer wants, at no cost: XLA propagates
    shardings backwards into such values, so a forward-only walk must not
    charge for bringing a replicated constant to a sharded operand's layout.
    """


def is_free(lay: Layout) -> bool:
    return isinstance(lay, FreeLayout)


def adopt(
    free: Layout, names: Sequence[str], other: Layout, other_names: Sequence[str], sizes: dict[str, int]
) -> Layout:
    """Give a free operand the sharding its partner has on the axes they share."""
    by_name = dict(zip(other_names, other.dims))
    dims = []
    for n, size in zip(names, free.shape):
        d = by_name.get(n, ())
        ok = d and size % math.prod(sizes[m] for m in d) == 0
        dims.append(d if ok else ())
    return Layout(free.axes, free.shape, free.mesh, tuple(dims))
