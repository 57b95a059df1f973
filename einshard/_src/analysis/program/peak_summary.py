"""Peak memory by stretches: a costing's liveness walk folds one summary per stretch of the program.

:func:`.memory._peak` walks every step of the flattened program once per costing, so a planner costing an
unrolled decoder hundreds of times paid for every layer in every costing.  Here the steps are cut, once per
flattening and liveness (both layout-free, kept by :class:`.memory.PeakCache`), into *stretches*: the copies
of the runs of steps that repeat (a layer's forward, its remat call inlined with its backward, the glue between
them; found as :func:`.segments.repeated_runs` finds the top-level ones), and the glue between those runs.

What the walk does over a stretch depends on the layouts only through a few numbers: the bytes of each buffer it
makes or frees or writes into (its own and those made before it that die in it or are donated to it), the bytes
of its pending partial sums, each step's scratch and the gathered copies that end in it.  Given those, its walk
is a :class:`Summary`: what it adds to the live bytes and the held partial sums, what gathered bytes it ends,
and its highest point above the live bytes it entered with.  Two stretches with the same structure
(:attr:`Stretch.form`: the same steps on buffers named in order of first use, the same of them made before
it) and the same numbers have the same summary, so a summary is computed once (:class:`SummaryMemo`) and
reused by every layer laid out alike, in this costing and the later ones; the peak is the fold of the
summaries (:func:`fold`).  The fold is exact: equal to the whole-program walk for every program and layout
(tests/test_peak_incremental.py draws them).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from .segments import Run, repeated_runs

__all__ = ["Steps", "Stretch", "Summary", "SummaryMemo", "stretches", "fold", "fold_runs"]

Key = Any

# A reference to a value made further back than this many steps is signed as "far" when looking for repeats:
# a layer's backward reads the forward's saved values from a distance that grows with the layers between.
_NEAR = 48
# Glue between runs is cut into pieces of at most this many steps, so that a costing that changes the layout of
# one stretch of it re-walks that piece only (the others' summaries are reused from the earlier costings).
_GLUE = 64
# A run whose copies are shorter than this many steps is cut again by the types its steps make (_typed_cuts).
_SHORT = 4


@dataclass(frozen=True)
class Steps:
    """The flattened program as the cutter reads it: each step's op, the buffers it reads and makes, and the
    liveness of :func:`.memory._liveness` (who makes each buffer, which are fused, pending sums, written into or
    freed where).  ``sized``: the steps whose scratch may change with the layouts; ``ends``: the steps where a
    gathered argument's copy may be freed."""

    names: Sequence[str]
    ins: Sequence[tuple[Key, ...]]
    outs: Sequence[tuple[Key, ...]]
    producer: dict[Key, int]
    args: frozenset[Key]
    fused: frozenset[Key]
    leaves: frozenset[Key]
    donors: dict[int, tuple[Key, ...]]
    dies: dict[int, list[Key]]
    sized: frozenset[int]
    ends: frozenset[int]


@dataclass(frozen=True)
class Stretch:
    """Steps ``start`` to ``stop`` of a flattened program, and what its walk reads of a costing's layouts."""

    start: int
    stop: int
    form: int  # equal for stretches whose walks are alike given equal numbers (interned structure)
    # The buffers it makes, frees or writes into, named in order of first use: those it makes (fused ones left
    # out: they hold no bytes whatever their layout), and those live when it starts (made before it, or arguments).
    made: tuple[Key, ...]
    entering: tuple[Key, ...]
    kept: tuple[int, ...]  # which of ``made`` a later stretch frees or writes into (their bytes are remembered)
    leaves: tuple[Key, ...]  # the values it makes whose pending partial sums wait for the combined all-reduce
    sized: tuple[int, ...]  # the steps whose scratch the layouts size (a loop's iteration, a dot's copies)
    ends: tuple[int, ...]  # the steps at which a gathered argument copy may end (an argument's last use)


class Summary(NamedTuple):
    """A stretch's walk, relative to the live bytes it starts with."""

    grows: int  # bytes it leaves live, less those it frees (of its own and of earlier buffers)
    holds: int  # bytes of pending partial sums it adds
    ends: int  # gathered argument bytes freed in it
    top: int | None  # its highest point above its start: live, partial sums and scratch (None: no steps)


class SummaryMemo:
    """Summaries by (form, numbers), kept across the costings of one program (see :class:`.memory.PeakCache`)."""

    # Bounded: a long search meets new layouts for ever; past this many, the oldest half is dropped.
    LIMIT = 20_000

    def __init__(self) -> None:
        self.known: dict[tuple[int, tuple[Any, ...]], Summary] = {}
        self.forms: dict[Hashable, int] = {}  # stretch structures, interned (Stretch.form)
        self.walked = 0  # stretches walked step by step (counted, for tests)
        self.reused = 0  # stretches whose summary was known
        self.sized = 0  # buffer sizings computed (one per shape, split, type and tiling met in a costing)

    def get(self, key: tuple[int, tuple[Any, ...]]) -> Summary | None:
        """The summary of a stretch of this form walked with these numbers, if one was (counted)."""
        hit = self.known.get(key)
        if hit is not None:
            self.reused += 1
        return hit

    def put(self, key: tuple[int, tuple[Any, ...]], summary: Summary) -> Summary:
        """Keep ``summary``, the walk of a stretch of this form with these numbers (counted)."""
        self.walked += 1
        if len(self.known) >= self.LIMIT:
            for old in list(self.known)[: self.LIMIT // 2]:
                del self.known[old]
        self.known[key] = summary
        return summary


def fold(peak: int, summaries: Sequence[Summary], level: int) -> int:
    """The peak of a walk that has reached ``peak`` and enters the stretches with ``level`` bytes (live,
    gathered, held), summary by summary: each stretch's top above the level it began at."""
    for s in summaries:
        if s.top is not None and level + s.top > peak:
            peak = level + s.top
        level += s.grows + s.holds - s.ends
    return peak


def fold_runs(peak: int, runs: Sequence[tuple[Summary, int]], level: int) -> int:
    """:func:`fold` of ``runs``: each ``(summary, count)`` stands for ``count`` consecutive stretches with that
    summary (the layers of a stack laid out alike), folded in one step whatever the count.

    The ``j``-th copy of a run entering at ``level`` starts at ``level + j·d`` (``d``: what one copy adds: grown,
    held, less the gathered bytes it ends) and tops at that plus ``top``: the run's highest point is its first
    copy's where ``d <= 0``, its last's where ``d > 0``.
    """
    for s, count in runs:
        if count <= 0:
            continue
        d = s.grows + s.holds - s.ends
        if s.top is not None:
            highest = level + s.top + max(0, (count - 1) * d)
            if highest > peak:
                peak = highest
        level += count * d
    return peak


def stretches(steps: Steps, forms: dict[Hashable, int]) -> tuple[Stretch, ...]:
    """The program's steps cut into stretches, in order, covering every step once.

    ``forms``: the structures met so far (a :class:`SummaryMemo`'s), each by its number, to which new ones are
    added.
    """
    names, ins, outs, producer, fused, donors, dies = (
        steps.names,
        steps.ins,
        steps.outs,
        steps.producer,
        steps.fused,
        steps.donors,
        steps.dies,
    )
    n = len(names)
    sigs: dict[Hashable, int] = {}
    signature: list[int] = []
    made_at, sized, ends = producer.get, steps.sized, steps.ends
    for i in range(n):
        # Each operand (and each buffer freed here) by how far back it was made: "in" (no step made it), the
        # distance, or "far" past _NEAR.  (Loops, not a helper per operand: tens of thousands of steps.)
        refs = []
        for k in ins[i]:
            m = made_at(k)
            refs.append("in" if m is None else i - m if i - m <= _NEAR else "far")
        gone = []
        for k in dies.get(i, ()):
            m = made_at(k)
            gone.append("in" if m is None else i - m if i - m <= _NEAR else "far")
        sig = (names[i], tuple(refs), tuple(gone), tuple([k in fused for k in outs[i]]), i in sized, i in ends)
        signature.append(sigs.setdefault(sig, len(sigs)))
    bounds: list[tuple[int, int]] = []
    at = 0
    for run in repeated_runs(signature):
        bounds.extend(_pieces(at, run.start))
        if run.period < _SHORT:
            # Copies of a step or two: read again by the types they make (a stacked weight's rows sliced first, each
            # weight's in turn, repeat at the layer's length), where a stretch per step would cost each costing a
            # reading per step.
            bounds.extend(_typed_cuts(run, signature, outs))
        else:
            bounds.extend((r.start, r.stop) for r in run.copies())
        at = run.stop
    bounds.extend(_pieces(at, n))
    # The buffers a stretch frees or writes into that an earlier one made: sized there, remembered for it.
    later = {
        k
        for a, b in bounds
        for i in range(a, b)
        for k in (*dies.get(i, ()), *donors.get(i, ()))
        if producer.get(k, b) < a and k not in fused
    }
    return tuple(_stretch(a, b, steps, forms, later) for a, b in bounds)


def _typed_cuts(run: Run, signature: list[int], outs: Sequence[tuple[Key, ...]]) -> list[tuple[int, int]]:
    """``run``'s steps cut by their signatures and the types of the buffers they make: the copies of the runs those
    repeat in (the layers' rows of a stack, a copy per layer), glue between them; the run's own copies where the
    types repeat no longer."""
    types: dict[Hashable, int] = {}
    typed = [
        types.setdefault((signature[i], tuple([_type_of(k) for k in outs[i]])), len(types))
        for i in range(run.start, run.stop)
    ]
    cuts: list[tuple[int, int]] = []
    at = 0
    for sub in repeated_runs(typed):
        if sub.period <= run.period:
            continue  # (no longer: as the run's own copies below)
        cuts.extend(_copies_between(run, at, sub.start))
        cuts.extend((run.start + r.start, run.start + r.stop) for r in sub.copies())
        at = sub.stop
    cuts.extend(_copies_between(run, at, len(typed)))
    return cuts


def _copies_between(run: Run, a: int, b: int) -> list[tuple[int, int]]:
    """``run``'s steps ``a`` to ``b`` (counted from its start) as its own copies, a part of one as glue."""
    return [(run.start + s, run.start + min(s + run.period, b)) for s in range(a, b, run.period)]


def _type_of(k: Key) -> Hashable:
    """A buffer's type (its value's shape and element type)."""
    aval = getattr(k[1] if isinstance(k, tuple) else k, "aval", None)
    return (tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")))


def _pieces(a: int, b: int) -> list[tuple[int, int]]:
    return [(s, min(s + _GLUE, b)) for s in range(a, b, _GLUE)]


def _stretch(a: int, b: int, steps: Steps, forms: dict[Hashable, int], later: set[Key]) -> Stretch:
    """Steps ``a`` to ``b`` as a :class:`Stretch`: its buffers named by first use, its structure interned."""
    names, outs, producer, args, fused, leaves = (
        steps.names,
        steps.outs,
        steps.producer,
        steps.args,
        steps.fused,
        steps.leaves,
    )
    donors, dies, sized, ends = steps.donors, steps.dies, steps.sized, steps.ends
    local: dict[Key, int] = {}
    name = local.setdefault  # (each buffer's number: the count of those named before it, passed in order)

    shape = []
    for i in range(a, b):
        made = tuple([name(k, len(local)) for k in outs[i]])
        given = tuple([name(k, len(local)) for k in donors.get(i, ())])
        gone = tuple([name(k, len(local)) for k in dies.get(i, ())])
        flags = tuple([(k in fused, k in leaves) for k in outs[i]])
        shape.append((names[i], made, flags, given, gone, i in sized, i in ends))
    touched = tuple(local)
    # How each buffer stands when the stretch starts: live (an argument, or made before it), not made yet, or
    # never made (an input no step makes: nothing to free).
    state = tuple(
        (
            "arg" if k in args else "before" if producer.get(k, b) < a else "here" if k in producer else "none",
            k in fused,  # its bytes: none if fused (not among the numbers)
        )
        for k in touched
    )
    form = forms.setdefault((tuple(shape), state), len(forms))
    made = tuple(k for k, (s, f) in zip(touched, state) if s == "here" and not f)
    return Stretch(
        a,
        b,
        form,
        made,
        tuple(k for k, (s, _) in zip(touched, state) if s in ("arg", "before")),
        tuple(j for j, k in enumerate(made) if k in later),
        tuple(k for i in range(a, b) for k in outs[i] if k in leaves),
        tuple(i for i in range(a, b) if i in sized),
        tuple(i for i in range(a, b) if i in ends),
    )
