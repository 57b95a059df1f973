"""The one collective vocabulary: the kinds, and the :class:`Step` record the analyzer plans and the lowering runs.

Every layer names collectives with these strings: the analyzer's
:class:`~einshard.analysis.cost.Collective` (a step plus what it costs), the
lowering's shard_map bodies (:func:`einshard.lowering.apply_step` runs a
:class:`Step`), and the HLO reader of :mod:`einshard.testing` (which counts
what XLA compiled).  A ``dynamic-slice`` is a step too (each device keeps its
own block of a replicated dimension), but no collective: it moves no data.

A :class:`Step` says everything needed to run it on one device's block:
which tensor (an operand's position or ``'out'``), which dimension, which
mesh axes.  The analyzer fills these in when it plans the collective, so the
lowering reads them off and never re-derives them from layouts.

Example:
    >>> Step("all-gather", 0, ("data",), dim=1)
    Step(kind='all-gather', operand=0, mesh_axes=('data',), dim=1, to_dim=None, shift=1, reorder=None)
    >>> str(Step("all-to-all", "out", ("model",), dim=0, to_dim=1))
    'all-to-all[model](out dim 0->1)'
    >>> "dynamic-slice" in KINDS, "dynamic-slice" in STEP_KINDS
    (False, True)
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Literal, get_args

from ..errors import EinshardError

__all__ = ["CollectiveKind", "StepKind", "KINDS", "STEP_KINDS", "Target", "Step", "reorder_pairs"]

CollectiveKind = Literal["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"]
StepKind = Literal["all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute", "dynamic-slice"]

#: The collectives (what moves data between devices, what XLA's HLO prints).
KINDS: tuple[CollectiveKind, ...] = get_args(CollectiveKind)
#: Every step a program runs: the collectives and the free local ``dynamic-slice``.
STEP_KINDS: tuple[StepKind, ...] = get_args(StepKind)

#: Which tensor a step acts on: an operand's position (0-based) or ``'out'``, the einsum's result.
Target = int | Literal["out"]

_NEEDS_DIM = ("all-gather", "dynamic-slice", "reduce-scatter", "all-to-all")


@dataclass(frozen=True)
class Step:
    """One step on one block, inside a shard_map body.

    Attributes:
        kind: one of :data:`STEP_KINDS`.
        operand: the operand's position, or ``'out'`` for the einsum's result.
        mesh_axes: the mesh axes it runs over, major to minor (one ring over their product).
        dim: the block's tensor dimension it acts on: gathered (all-gather), sliced
            (dynamic-slice), scattered (reduce-scatter), or the one whose split
            moves away (all-to-all).  None for all-reduce and collective-permute.
        to_dim: all-to-all only: the dimension that becomes split.
        shift: collective-permute only: device ``j`` sends to ``j + shift`` (mod the ring size).
        reorder: collective-permute only, instead of ``shift``: ``(before, after)``, the mesh
            axes of each tensor dimension before and after (the same axes per dimension, in
            another order): each block moves to the device that holds it in ``after``.
    """

    kind: StepKind
    operand: Target
    mesh_axes: tuple[str, ...]
    dim: int | None = None
    to_dim: int | None = None
    shift: int = 1
    reorder: tuple[tuple[tuple[str, ...], ...], tuple[tuple[str, ...], ...]] | None = None

    def __post_init__(self) -> None:
        if self.kind not in STEP_KINDS:
            raise EinshardError(f"unknown step kind {self.kind!r}; the kinds are {', '.join(STEP_KINDS)}")
        if isinstance(self.mesh_axes, str):  # a lone name is a one-axis tuple
            object.__setattr__(self, "mesh_axes", (self.mesh_axes,))
        _check_fields(self)
        if not self.mesh_axes:
            raise EinshardError(f"a {self.kind} step needs at least one mesh axis (mesh_axes=)")
        if self.kind in _NEEDS_DIM and self.dim is None:
            raise EinshardError(f"a {self.kind} step needs dim=")
        if self.kind == "all-to-all" and (self.to_dim is None or self.to_dim == self.dim):
            raise EinshardError("an all-to-all step needs to_dim=, different from dim=")
        if self.reorder is not None:
            before, after = self.reorder
            if self.kind != "collective-permute" or len(before) != len(after):
                raise EinshardError(f"reorder= is for a collective-permute between two splits of one tensor: {self}")
            try:
                reorder_pairs(self.mesh_axes, {m: 1 for m in self.mesh_axes} | _unit_sizes(self.reorder), before, after)
            except (ValueError, KeyError):
                raise EinshardError(
                    f"reorder= {self.reorder}: each changed dimension's mesh axes must be among mesh_axes "
                    f"{self.mesh_axes}, and no dimension may end coarser than it was"
                ) from None

    def __str__(self) -> str:
        axes = ",".join(self.mesh_axes)
        where = "" if self.dim is None else f" dim {self.dim}" + ("" if self.to_dim is None else f"->{self.to_dim}")
        if self.reorder is not None:
            where = " " + " ".join(
                f"dim {d} {','.join(b)}->{','.join(a)}" for d, (b, a) in enumerate(zip(*self.reorder)) if a != b
            )
        return f"{self.kind}[{axes}]({self.operand}{where})"


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(step: Step) -> None:
    """Each field's type (a Step is also built by users, for einsum_shard_map): an EinshardError naming it."""
    if not (step.operand == "out" or _is_index(step.operand)):
        raise EinshardError(f"Step: operand= takes an operand position (0, 1, ...) or 'out', got {step.operand!r}")
    axes = step.mesh_axes
    if not isinstance(axes, tuple) or not all(isinstance(m, str) and m for m in axes) or len(set(axes)) != len(axes):
        raise EinshardError(f"Step: mesh_axes= takes a tuple of distinct mesh axis names, got {axes!r}")
    for name in ("dim", "to_dim"):
        value = getattr(step, name)
        if value is not None and not _is_index(value):
            raise EinshardError(f"Step: {name}= takes a dimension (an integer >= 0) or None, got {value!r}")
    if not isinstance(step.shift, int) or isinstance(step.shift, bool):
        raise EinshardError(f"Step: shift= takes an integer, got {step.shift!r}")
    if step.reorder is not None and (not isinstance(step.reorder, tuple) or len(step.reorder) != 2):
        raise EinshardError(
            f"Step: reorder= takes (before, after), the mesh axes of each dimension, got {step.reorder!r}"
        )


def _unit_sizes(reorder: tuple[tuple[tuple[str, ...], ...], ...]) -> dict[str, int]:
    """Sizes for checking a reorder's shape without the mesh: every axis of size 1 divides."""
    return {m: 1 for dims in reorder for d in dims for m in d}


def reorder_pairs(
    mesh_axes: tuple[str, ...],
    sizes: dict[str, int],
    before: tuple[tuple[str, ...], ...],
    after: tuple[tuple[str, ...], ...],
) -> tuple[list[tuple[int, int]], dict[int, list[int]]]:
    """How a permute moves blocks from the split ``before`` to the split ``after``, on the ring over ``mesh_axes``.

    A device holds, along each dimension, the block whose index is its
    coordinates over that dimension's mesh axes read major to minor.  Where
    ``after`` only reorders the axes, each block moves whole; where it splits
    a dimension finer (``c@x`` to ``c@y`` with ``|x|`` dividing ``|y|``, a
    regroup), each device sends one piece of its block.  Returns the
    ``(source, destination)`` pairs (ring indices) and, per changed dimension,
    which piece of its block each source sends (by ring index).  Raises
    ValueError where no permute does it (``after`` coarser than ``before``).

    Example:
        >>> pairs, pieces = reorder_pairs(("x", "y"), {"x": 2, "y": 2}, (("x", "y"),), (("y", "x"),))
        >>> pairs, pieces
        ([(0, 0), (1, 2), (2, 1), (3, 3)], {0: [0, 0, 0, 0]})
    """
    changed = [d for d, (b, a) in enumerate(zip(before, after, strict=True)) if a != b]

    def count(axes: tuple[str, ...]) -> int:
        n = 1
        for m in axes:
            n *= sizes[m]
        return n

    def index(coords: dict[str, int], axes: tuple[str, ...]) -> int:
        k = 0
        for m in axes:
            k = k * sizes[m] + coords[m]
        return k

    ratio = {}
    for d in changed:
        nb, na = count(before[d]), count(after[d])
        if na % nb or any(m not in mesh_axes for m in (*before[d], *after[d])):
            raise ValueError(f"no permute takes dimension {d} from {before[d]} to {after[d]}")
        ratio[d] = na // nb
    grid = [dict(zip(mesh_axes, c, strict=True)) for c in itertools.product(*(range(sizes[m]) for m in mesh_axes))]
    # Sources by the blocks they hold; each destination takes the next source holding its block.
    holders: dict[tuple[int, ...], list[int]] = {}
    for c in grid:
        holders.setdefault(tuple(index(c, before[d]) for d in changed), []).append(index(c, mesh_axes))
    pairs: list[tuple[int, int]] = []
    pieces: dict[int, list[int]] = {d: [0] * len(grid) for d in changed}
    for c in grid:
        want = {d: index(c, after[d]) for d in changed}
        src = holders[tuple(want[d] // ratio[d] for d in changed)].pop(0)
        pairs.append((src, index(c, mesh_axes)))
        for d in changed:
            pieces[d][src] = want[d] % ratio[d]
    return sorted(pairs), pieces
