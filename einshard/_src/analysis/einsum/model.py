"""The records every step of the einsum analysis shares: the :class:`Problem` (one einsum to analyse), a
:class:`Candidate` (one way to compute it), the axis classes and which operand is the weight.

The bottom of the chain ``model < options < search < read < plan < analyze``: it imports nothing of
the analysis but the cost records.

Each record has one trusted constructor (``trusted``): the analyzer builds thousands of them per einsum from
values that are valid by construction, so the constructor fills the fields without the generated
``__init__``'s frame; with ``EINSHARD_CHECKS=1`` in the environment (as JAX's ``jax_enable_checks``) it checks
each record's invariants too, so a bug in the construction surfaces where it happens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ...core.layout import Layout, MeshAxis
from ...errors import EinshardError
from ..cost import Collective, Profile

__all__ = [
    "BATCH",
    "CONTRACTED",
    "FREE",
    "LONE",
    "AxisClass",
    "Candidate",
    "Problem",
    "Resolution",
    "broken",
    "check_candidate",
    "check_problem",
    "checks_enabled",
    "classify",
    "pick_weight",
    "pick_weight_of_axes",
]

AxisClass = Literal["batch", "free", "contracted", "lone-reduced"]
BATCH: AxisClass = "batch"
FREE: AxisClass = "free"
CONTRACTED: AxisClass = "contracted"
LONE: AxisClass = "lone-reduced"

# How a candidate delivers the result: as requested; complete (pending sums all-reduced); reduce-scattered
# onto an output axis; or as pending sums.
Resolution = Literal["requested", "complete", "reduce-scatter", "unreduced"]
RESOLUTIONS: frozenset[str] = frozenset({"requested", "complete", "reduce-scatter", "unreduced"})

# Read once, at import (as JAX reads its flags): the trusted constructors test one module-level bool (tests
# set it with monkeypatch).
CHECKS = os.environ.get("EINSHARD_CHECKS", "") not in ("", "0")


def checks_enabled() -> bool:
    """Whether the trusted constructors check what they build (``EINSHARD_CHECKS=1`` in the environment)."""
    return CHECKS


@dataclass(frozen=True)
class Problem:
    """One einsum to analyse: operand layouts, the output's axes, the requested output layout if any."""

    operands: tuple[Layout, ...]
    out_axes: tuple[str, ...]
    sizes: tuple[tuple[str, int], ...]
    mesh: tuple[MeshAxis, ...]
    requested: Layout | None
    itemsize: int
    profile: Profile
    # Without a requested layout, which complete results the choice is among.  A user's ``-> b? y?`` asks for
    # the cheapest complete result, and a result reduce-scattered onto an output axis is complete (issue 22:
    # a 22.7 µs reduce-scatter lost to a 38.4 µs gather); an op inside a traced program leaves its result as
    # computed, its pending sums all-reduced, and its consumer decides any other layout (a reshard there).
    scatter_chosen: bool = False

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    @classmethod
    def trusted(
        cls,
        operands: tuple[Layout, ...],
        out_axes: tuple[str, ...],
        sizes: tuple[tuple[str, int], ...],
        mesh: tuple[MeshAxis, ...],
        requested: Layout | None,
        itemsize: int,
        profile: Profile,
        scatter_chosen: bool = False,
    ) -> Problem:
        """The one constructor for values valid by construction: the fields filled directly (a frozen
        dataclass without slots: as the generated ``__init__``'s ``object.__setattr__`` would), checked
        with ``EINSHARD_CHECKS=1``."""
        new = object.__new__(cls)
        new.__dict__.update(
            operands=operands,
            out_axes=out_axes,
            sizes=sizes,
            mesh=mesh,
            requested=requested,
            itemsize=itemsize,
            profile=profile,
            scatter_chosen=scatter_chosen,
        )
        if CHECKS:
            check_problem(new)
        return new


@dataclass(frozen=True)
class Candidate:
    """One way to compute the einsum."""

    choice: tuple[tuple[str, str | None], ...]  # (mesh axis, einsum axis kept or None), mesh order
    targets: tuple[Layout, ...]  # operand layouts the local einsum runs on
    steps: tuple[Collective, ...]  # operand collectives, then result collectives
    computed: Layout  # the result as the local einsums leave it
    out: Layout  # the result as delivered
    resolution: str  # a Resolution: 'requested', 'complete', 'reduce-scatter', 'unreduced'
    flops: int  # per device
    time: float
    comm_bytes: int
    # The operands as the moves start from: as given, or with lone-reduced axes summed locally first.
    sources: tuple[Layout, ...] = ()
    # Gathers a mesh axis that every operand holding its einsum axis already splits the same way
    # (``b@x d, b@x f -> d f`` computed whole on every device).  XLA never does this: it keeps an
    # agreed split (partial sums or a batch split); ranked after every candidate that keeps it.
    unsplits_agreed: bool = False

    @classmethod
    def trusted(
        cls,
        choice: tuple[tuple[str, str | None], ...],
        targets: tuple[Layout, ...],
        steps: tuple[Collective, ...],
        computed: Layout,
        out: Layout,
        resolution: str,
        flops: int,
        time: float,
        comm_bytes: int,
        sources: tuple[Layout, ...],
        unsplits_agreed: bool,
    ) -> Candidate:
        """The one constructor for the search's candidates (one per way to deliver each part's result, where
        the generated ``__init__`` is most of the cost): the fields filled directly, checked with
        ``EINSHARD_CHECKS=1``."""
        new = object.__new__(cls)
        new.__dict__.update(
            choice=choice,
            targets=targets,
            steps=steps,
            computed=computed,
            out=out,
            resolution=resolution,
            flops=flops,
            time=time,
            comm_bytes=comm_bytes,
            sources=sources,
            unsplits_agreed=unsplits_agreed,
        )
        if CHECKS:
            check_candidate(new)
        return new


def broken(record: object, reason: str) -> EinshardError:
    """The error of a record that breaks its invariants: a bug in einshard, not in the user's input."""
    return EinshardError(f"einshard internal check (EINSHARD_CHECKS=1): {type(record).__name__} {reason}")


def check_problem(problem: Problem) -> None:
    """A Problem's invariants: operands and the requested result on its mesh, their shapes as ``sizes`` says,
    every output axis sized."""
    sizes = dict(problem.sizes)
    if len(sizes) != len(problem.sizes):
        raise broken(problem, f"names an axis twice in sizes={problem.sizes}")
    laid_out = [*problem.operands, *([problem.requested] if problem.requested is not None else [])]
    for k, lay in enumerate(laid_out):
        what = "the requested result" if k == len(problem.operands) else f"operand {k + 1}"
        if not isinstance(lay, Layout):
            raise broken(problem, f"has {what} {lay!r}, not a Layout")
        if lay.mesh != problem.mesh:
            raise broken(problem, f"has {what} on the mesh {lay.mesh}, not {problem.mesh}")
        for a, s in zip(lay.axes, lay.shape, strict=True):
            if sizes.get(a) != s:
                raise broken(problem, f"has {what}'s axis {a!r} of size {s}, but sizes= says {sizes.get(a)}")
    missing = [a for a in problem.out_axes if a not in sizes]
    if missing:
        raise broken(problem, f"has output axes {missing} without a size")
    if problem.requested is not None and problem.requested.axes != problem.out_axes:
        raise broken(problem, f"requests a result with axes {problem.requested.axes}, not {problem.out_axes}")
    if isinstance(problem.itemsize, bool) or not isinstance(problem.itemsize, int) or problem.itemsize < 1:
        raise broken(problem, f"has itemsize {problem.itemsize!r}")


def check_candidate(cand: Candidate) -> None:
    """A Candidate's invariants: one target per operand it starts from, the result computed and delivered with
    the same axes on the same mesh, its bytes the sum of its collectives', its time no less than theirs."""
    if cand.resolution not in RESOLUTIONS:
        raise broken(cand, f"has the resolution {cand.resolution!r}, not one of {sorted(RESOLUTIONS)}")
    if cand.sources and len(cand.sources) != len(cand.targets):
        raise broken(cand, f"moves {len(cand.sources)} operands to {len(cand.targets)} targets")
    if (cand.computed.axes, cand.computed.mesh) != (cand.out.axes, cand.out.mesh):
        raise broken(cand, f"computes {cand.computed} but delivers {cand.out}")
    if cand.comm_bytes != sum([c.bytes for c in cand.steps]):
        raise broken(cand, f"sends {cand.comm_bytes} bytes, but its collectives send {[c.bytes for c in cand.steps]}")
    # (a margin: Python 3.12's float sum compensates rounding, so totals may differ by an ulp)
    if cand.time < sum([c.time for c in cand.steps]) * (1 - 1e-12) or cand.flops < 0:
        raise broken(cand, f"takes {cand.time} s for {cand.flops} FLOPs and collectives of {cand.steps}")


def classify(operand_axes: tuple[tuple[str, ...], ...], out_axes: tuple[str, ...]) -> dict[str, str]:
    """Each einsum axis's class: batch, free, contracted or lone-reduced.

    Example:
        >>> classify((("b", "x", "z"), ("x", "y")), ("b", "y"))
        {'b': 'free', 'x': 'contracted', 'z': 'lone-reduced', 'y': 'free'}
        >>> classify((("b", "i", "j"), ("b", "j", "k")), ("b", "i", "k"))["b"]
        'batch'
    """
    out = set(out_axes)
    classes: dict[str, str] = {}
    for axes in operand_axes:
        for e in axes:
            if e in classes:
                continue
            n = 0  # the operands holding e (a loop: this runs for every axis of every analysis)
            for o in operand_axes:
                if e in o:
                    n += 1
            if e in out:
                classes[e] = BATCH if n >= 2 else FREE
            else:
                classes[e] = CONTRACTED if n >= 2 else LONE
    return classes


# Which operand is "the weight" (plan.py's module doc: it decides column- vs row-parallel and FSDP).  Here,
# below the text reader and the plan, because both ask it: the reader once per expression, from its axis names.
BATCH_NAMES = frozenset({"b", "batch", "bs", "batch_size", "B"})
HEAD_NAMES = frozenset({"h", "head", "heads", "H"})
SEQ_NAMES = frozenset({"s", "seq", "sequence", "t", "time", "l", "len", "length", "tokens", "token", "S", "T", "L"})


def pick_weight_of_axes(operand_axes: tuple[tuple[str, ...], ...], classes: dict[str, str]) -> int | None:
    """The index of the operand taken as the weight, or None, from the operands' axis names (all it reads)."""
    if len(operand_axes) < 2:
        return None
    candidates = [
        i
        for i, axes in enumerate(operand_axes)
        if not any(a in BATCH_NAMES or a in SEQ_NAMES or classes.get(a) == BATCH for a in axes)
    ]
    return candidates[-1] if candidates else None


def pick_weight(operands: tuple[Layout, ...], classes: dict[str, str]) -> int | None:
    """The index of the operand taken as the weight, or None (plan.py's module doc)."""
    return pick_weight_of_axes(tuple([op.axes for op in operands]), classes)
