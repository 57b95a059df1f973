"""Parameter groups (leaves that share a layout) and their candidate layouts; the batch's candidates."""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ..core.layout import MeshAxis
from .inputs import itemsize_of, shape_of

__all__ = ["Candidate", "Group", "param_groups", "param_candidates", "batch_candidates", "search_candidates"]

_STACK_KEY = re.compile(r"layer|block|stack|scan|repeat", re.IGNORECASE)


@dataclass(frozen=True)
class Candidate:
    """One layout for a group: which mesh axes split each tensor axis.

    For the batch group ``dims`` is ``(batch axes, sequence axes)`` and applies
    to every data leaf (the sequence axes to leaves of rank ≥ 2).
    """

    dims: tuple[tuple[str, ...], ...]

    @property
    def sharded(self) -> int:
        return sum(len(d) for d in self.dims)


@dataclass(frozen=True)
class Group:
    """Parameter leaves that share one layout (or the batch: every data leaf).

    Attributes:
        pattern: the regular expression of ``rules`` (``einshard(params, rules)`` matches it on paths).
        display: the path with indices generalised, ``['layers'][*]['w1']``.
        names: the tensor axis names of its expressions (``l`` = a stacked layer axis).
        shapes: the shapes of its leaves.
        leaves: indices of its leaves among the parameters' leaves.
        nbytes: bytes of all its leaves.
        candidates: its candidate layouts, replicated first.
    """

    pattern: str
    display: str
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    leaves: tuple[int, ...]
    nbytes: int
    stacked: bool
    candidates: tuple[Candidate, ...] = ()
    is_batch: bool = False

    def expression(self, cand: Candidate, rank: int | None = None) -> str:
        """The einshard expression of ``cand`` for this group (a data leaf of rank ``rank``)."""
        if self.is_batch:
            names = _data_names(rank or 0)
            dims = [cand.dims[0], cand.dims[1] if len(names) >= 2 else ()] + [()] * max(0, len(names) - 2)
            dims = dims[: len(names)]
        else:
            names, dims = list(self.names), list(cand.dims)
        left = " ".join(names)
        right = " ".join(_item(n, d) for n, d in zip(names, dims))
        return f"{left} -> {right}"


def _item(name: str, axes: tuple[str, ...]) -> str:
    if not axes:
        return name
    return f"{name}@{axes[0]}" if len(axes) == 1 else f"{name}@({','.join(axes)})"


def _data_names(rank: int) -> list[str]:
    base = ["b", "s", "d", "e", "f", "g", "h"]
    return (
        base[:rank] if rank <= 2 else ["b", "s", *base[2:rank]] if rank <= len(base) else [f"a{i}" for i in range(rank)]
    )


def _param_names(rank: int, stacked: bool) -> tuple[str, ...]:
    letters = ["x", "y", "z", "w", "v", "u", "t"]
    rest = rank - 1 if stacked else rank
    names = letters[:rest] if rest <= len(letters) else [f"a{i}" for i in range(rest)]
    return tuple(["l", *names] if stacked else names)


_INDEX = re.compile(r"\[(\d+)\]")


def param_groups(params: Any, mesh: tuple[MeshAxis, ...]) -> tuple[list[Group], list[tuple[Any, Any]]]:
    """Parameter groups by role (indices generalised, split again where shapes differ)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = [jax.tree_util.keystr(path) for path, _ in leaves]
    # A stacked layer axis: under a layer-ish key, with a leading size its siblings share.
    leading: dict[str, set[int]] = {}
    for key, (_, x) in zip(keys, leaves):
        m = _STACK_KEY.search(key)
        if m and len(shape_of(x)) >= 2 and not _INDEX.search(key):
            leading.setdefault(key[: m.end()], set()).add(shape_of(x)[0])
    by_pattern: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        general = _INDEX.sub("[*]", key)
        by_pattern.setdefault(general, []).append(i)
    groups: list[Group] = []
    for general, members in by_pattern.items():
        if len({shape_of(leaves[i][1]) for i in members}) == 1:
            parts = [(general, members)]
        else:  # same role, different shapes: each leaf its own group
            parts = [(keys[i], [i]) for i in members]
        for display, part in parts:
            pattern = (
                "^"
                + "".join(
                    r"\[\d+\]" if tok == "[*]" else re.escape(tok) for tok in re.split(r"(\[\*\])", display) if tok
                )
                + "$"
            )
            shape = shape_of(leaves[part[0]][1])
            m = _STACK_KEY.search(display)
            prefix = display[: m.end()] if m else ""
            stacked = bool(
                m
                and "[*]" not in display
                and len(shape) >= 2
                and shape[0] > 1
                and leading.get(prefix) == {shape[0]}
                and sum(1 for k in keys if k.startswith(prefix)) > 1
            )
            nbytes = sum(int(math.prod(shape_of(leaves[i][1]))) * itemsize_of(leaves[i][1]) for i in part)
            groups.append(
                Group(
                    pattern,
                    display,
                    _param_names(len(shape), stacked),
                    tuple(shape_of(leaves[i][1]) for i in part),
                    tuple(part),
                    nbytes,
                    stacked,
                )
            )
    return groups, leaves


def _divides(shapes: Iterable[tuple[int, ...]], dims: Sequence[tuple[str, ...]], sizes: dict[str, int]) -> bool:
    return all(s[i] % math.prod(sizes[m] for m in d) == 0 for s in shapes for i, d in enumerate(dims) if d)


def param_candidates(group: Group, mesh: tuple[MeshAxis, ...], small: bool) -> tuple[Candidate, ...]:
    """Replicated, TP/FSDP on one axis, one axis over two mesh axes, FSDP×TP, pipeline stages."""
    rank = len(group.names)
    sizes = {m.name: m.size for m in mesh}
    axes = [m.name for m in mesh if m.size > 1]
    none: tuple[tuple[str, ...], ...] = tuple(() for _ in range(rank))
    out = [Candidate(none)]
    if small or rank == 0:
        return tuple(out)
    body = range(1, rank) if group.stacked else range(rank)

    def put(assign: dict[int, tuple[str, ...]]) -> None:
        dims = tuple(assign.get(i, ()) for i in range(rank))
        cand = Candidate(dims)
        if cand not in out and _divides(group.shapes, dims, sizes):
            out.append(cand)

    for i in body:
        for a in axes:
            put({i: (a,)})
    for a, b in itertools.combinations(axes, 2):
        for i in body:
            put({i: (a, b)})
        for i, j in itertools.permutations(body, 2):
            put({i: (a,), j: (b,)})
    if len(axes) > 2:
        for i in body:
            put({i: tuple(axes)})
    if group.stacked:
        for a in axes:
            put({0: (a,)})  # pipeline stages: the layer stack split over a mesh axis
    return tuple(out)


def batch_candidates(data_shapes: Sequence[tuple[int, ...]], mesh: tuple[MeshAxis, ...]) -> tuple[Candidate, ...]:
    """Replicated, the batch axis over every set of mesh axes, and sequence parallel."""
    sizes = {m.name: m.size for m in mesh}
    axes = [m.name for m in mesh if m.size > 1]
    batched = [s for s in data_shapes if len(s) >= 1]
    seqd = [s for s in data_shapes if len(s) >= 2]
    out: list[Candidate] = []
    for k in range(0, len(axes) + 1):
        for batch in itertools.combinations(axes, k):
            if not all(s[0] % math.prod(sizes[m] for m in batch) == 0 for s in batched):
                continue
            out.append(Candidate((batch, ())))
            if not seqd:
                continue
            for a in axes:
                if a in batch:
                    continue
                if all(s[1] % sizes[a] == 0 for s in seqd):
                    out.append(Candidate((batch, (a,))))
    return tuple(out)


def search_candidates(
    group: Group, batch_axes: tuple[str, ...], sizes: dict[str, int], for_memory: bool = False
) -> tuple[int, ...]:
    """The candidates of ``group`` worth trying first when the batch is split over ``batch_axes``.

    A split of a weight over a mesh axis that also splits the batch is FSDP:
    the weight is gathered whole before use, so *which* tensor axis carries
    the split changes the gather's shape, not its bytes.  One such placement
    per set of batch axes is kept (on the largest tensor axis that divides,
    the last on ties); a tensor axis never mixes batch and non-batch mesh axes.
    For the ``memory`` objective (``for_memory``) two tensor axes each over its
    own batch axes (``x@data y@model`` under a batch over both) are all kept
    too: such a weight is not gathered whole at once (one mesh axis is
    gathered, the other splits the matmul), so it peaks lower than the same
    split on one tensor axis — the least memory a forward pass reaches, which
    the descent missed by 23.5% when it tried these only in its polish round.
    For step time they send the same bytes as the one-axis placement, so they
    wait for the polish round there: tried first, they cost a memory-bound
    descent evaluations and, on the 80-layer llama-7b under its chip's HBM,
    sent it down a path that fitted 23 evaluations later and ended at 8.19 s
    per step predicted instead of 4.36 s.  Splits over the other mesh axes (tensor parallelism, pipeline stages) are
    all kept: there the axis decides the collectives.  The search tries these
    first and every candidate only when its evaluation budget allows.
    """
    keep = []
    for i, cand in enumerate(group.candidates):
        fsdp_dims = [j for j, d in enumerate(cand.dims) if d and all(m in batch_axes for m in d)]
        mixed = any(d and any(m in batch_axes for m in d) and not all(m in batch_axes for m in d) for d in cand.dims)
        if mixed or (len(fsdp_dims) > 1 and not for_memory):
            continue
        if len(fsdp_dims) == 1 and not (group.stacked and fsdp_dims[0] == 0):
            j = fsdp_dims[0]
            axes = cand.dims[j]
            free = [
                k
                for k in range(1 if group.stacked else 0, len(cand.dims))
                if (k == j or not cand.dims[k])
                and all(s[k] % math.prod(sizes[m] for m in axes) == 0 for s in group.shapes)
            ]
            best = max(free, key=lambda k: (max(s[k] for s in group.shapes), k)) if free else j
            if j != best:
                continue
        keep.append(i)
    return tuple(keep)
