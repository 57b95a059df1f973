"""The one layout algebra: collectives as pure functions on :class:`~einshard.core.layout.Layout`, unpriced.

Each move takes a layout and returns the new layout with the :class:`Move` it is (``None`` for a
dynamic-slice, which moves no data).  What a move costs is :func:`einshard.analysis.cost.price`'s
business; the lowering runs the :class:`~einshard.core.collectives.Step`\\ s the priced record names and
tracks the layout through them with :func:`apply_to_layout`.

* ``all_gather(lay, axes)``            ``x@a → x``           (mesh axes ``a`` leave the tensor axis they split)
* ``dynamic_slice(lay, axes, x)``      ``x → x@a``           (a replicated tensor keeps its own block: free)
* ``all_reduce(lay, axes)``            ``{U:a} → (complete)``
* ``reduce_scatter(lay, axes, x)``     ``{U:a} → x@a``
* ``all_to_all(lay, axes, x, y)``      ``x@a y → x y@a``
* ``collective_permute(lay, dims)``    ``x@(a,b) → x@(b,a)`` (same blocks, other devices)

``transition(src, dst)`` composes them in XLA's order: reductions (RS onto
a dimension the target shards, slicing that dimension further in the same
step; else AR), then free slices (so everything after moves less), then
all-to-alls, then gathers (which grow the data: last), and a permute if only the order of mesh axes differs.  This is
XLA's reshard rule set (docs/theory.md: "slices are free; one AG'd dim gives an
AG; one AG'd dim plus one sliced dim gives an AllToAll").  Gathering a mesh
axis that is not the minor-most one of its dimension first permutes it
there, which is what XLA emits (``[a@(x,y)] → [a@y]`` compiles to a
collective-permute then an all-gather over x), and a dimension re-split from
one group of mesh axes to another whose size divides or is divided by it is
permuted, then gathered by the remaining factor (:func:`regroup`), as XLA does.

XLA's partitioner reshards by tile counts per dimension, not by mesh axes, and transition follows it where
the two differ (each measured on the compiled reshard, tests/test_core_moves.py): a dimension an all-to-all
fills gives up its other mesh axes first; all-to-alls empty a dimension before filling it; two dimensions
that trade their counts are one all-to-all by the factor and a permute (:func:`_swapped_counts`); a layout
coarser or as split in every dimension is a permute, then gathers by factors (:func:`_coarsened`); the
source's tiling shifted one dimension major-ward moves whole blocks and slices after
(:func:`_shifted_tiling`); mesh axes fanning out of or into one dimension where the counts do not trade are
gathered whole (:func:`_shifts_fan`).  An all-to-all or gather over part of a mesh axis's devices is priced
as XLA runs it; a shard_map cannot name it, so the lowering runs an alternative.

Example:
    >>> from einshard.placement import Layout, MeshAxis
    >>> mesh = (MeshAxis("data", 4),)
    >>> a = Layout(("b", "d"), (64, 32), mesh, (("data",), ()))
    >>> b, move = all_gather(a, ("data",))
    >>> b.dims, move.kind, move.axes, move.group_size, move.dim
    (((), ()), 'all-gather', ('data',), 4, 0)
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

from ..errors import EinshardError
from .collectives import CollectiveKind, Step
from .layout import Layout, MeshAxis

__all__ = [
    "Move",
    "all_gather",
    "dynamic_slice",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "regroup",
    "transition",
    "apply_to_layout",
    "drop_trivial",
    "derived",
    "trivial_axes",
    "mesh_sizes",
    "remember_mesh",
]


class Move(NamedTuple):
    """One collective on one tensor's layout, unpriced (:func:`einshard.analysis.cost.price` prices it).

    A NamedTuple, not a dataclass: the analyzer makes one per collective of every candidate it weighs, and
    a tuple is built at a fraction of a frozen dataclass's cost.

    Attributes:
        kind: one of :data:`~einshard.core.collectives.KINDS`.
        axes: the mesh axes it runs over (one collective over their devices together).
        group_size: devices per group: the product of ``axes``' sizes, except a regroup's gather, which
            runs over a factor of them.
        before, after: the tensor's layout before and after.
        why: one line of reason.
        dim: the tensor dimension it gathers, scatters onto, or moves a split away from.
        to_dim: an all-to-all's dimension that becomes split.
    """

    kind: CollectiveKind
    axes: tuple[str, ...]
    group_size: int
    before: Layout
    after: Layout
    why: str = ""
    dim: int | None = None
    to_dim: int | None = None


# ---------------------------------------------------------------------------
# Per-mesh facts, computed once per mesh tuple.
#
# Not Layout.mesh_sizes: a cached_property takes a lock on first use (Python 3.11), and the analyzer
# makes many short-lived layouts that share one mesh tuple; keyed by its identity (the tuple is kept
# alive in the entry, so the id cannot be reused while cached).

_MeshFacts = tuple[tuple[MeshAxis, ...], dict[str, int], frozenset[str]]
_FACTS: dict[int, _MeshFacts] = {}
_LAST: list[_MeshFacts] = [((), {}, frozenset())]  # the mesh asked about last (one analysis asks about one mesh)


def _mesh_facts(mesh: tuple[MeshAxis, ...]) -> _MeshFacts:
    last = _LAST[0]
    if last[0] is mesh:
        return last
    hit = _FACTS.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        _LAST[0] = hit
        return hit
    sizes = {m.name: m.size for m in mesh}
    return remember_mesh(mesh, sizes, frozenset([m for m, s in sizes.items() if s == 1]))


def remember_mesh(mesh: tuple[MeshAxis, ...], sizes: dict[str, int], trivial: frozenset[str]) -> _MeshFacts:
    """Record ``mesh``'s facts from a caller that has them (analyze's entry reads the sizes from its dict
    mesh): ``sizes`` its axis sizes by name in mesh order, ``trivial`` those of size 1."""
    if len(_FACTS) > 512:
        _FACTS.clear()
    facts = (mesh, sizes, trivial)
    _FACTS[id(mesh)] = facts
    _LAST[0] = facts
    return facts


def mesh_sizes(lay: Layout) -> dict[str, int]:
    """The axis sizes by name of ``lay``'s mesh, in mesh order (shared: do not modify)."""
    last = _LAST[0]
    if last[0] is lay.mesh:  # (_mesh_facts's first test, without its call: this runs for every move)
        return last[1]
    return _mesh_facts(lay.mesh)[1]


def trivial_axes(lay: Layout) -> frozenset[str]:
    """The mesh axes of size 1 (they split nothing)."""
    return _mesh_facts(lay.mesh)[2]


def derived(lay: Layout, dims: tuple[tuple[str, ...], ...], unreduced: frozenset[str] | None = None) -> Layout:
    """``lay.with_dims(dims, unreduced)`` through the trusted constructor (:meth:`Layout._derive`): each move
    checks what its step could break (divisibility of a new split, a mesh axis used twice)."""
    return Layout._derive(lay.axes, lay.shape, lay.mesh, dims, lay.unreduced if unreduced is None else unreduced)


def _shards(lay: Layout, i: int) -> int:
    sizes = mesh_sizes(lay)
    n = 1
    for m in lay.dims[i]:
        n *= sizes[m]
    return n


def _group(lay: Layout, axes: tuple[str, ...]) -> int:
    sizes = mesh_sizes(lay)
    n = 1
    for a in axes:
        n *= sizes[a]
    return n


def _where(lay: Layout, mesh_axis: str) -> int | None:
    for i, d in enumerate(lay.dims):
        if mesh_axis in d:
            return i
    return None


def _check_axes(lay: Layout, axes: tuple[str, ...]) -> None:
    sizes = mesh_sizes(lay)
    for a in axes:
        if a not in sizes:
            raise EinshardError(f"mesh axis {a!r} is not an axis of the mesh ({', '.join(str(m) for m in lay.mesh)})")


def _dim_index(lay: Layout, axis: str | int) -> int:
    if isinstance(axis, int):
        return axis
    try:
        return lay.axes.index(axis)
    except ValueError:
        raise EinshardError(f"{axis!r} is not an axis of the tensor {lay}") from None


def _name(lay: Layout, i: int) -> str:
    return repr(lay.axes[i])


# ---------------------------------------------------------------------------
# The moves


def all_gather(lay: Layout, axes: tuple[str, ...], *, why: str = "") -> tuple[Layout, Move]:
    """Gather mesh axes ``axes`` (which all split one tensor axis, as its minor-most axes) out of ``lay``."""
    sizes = mesh_sizes(lay)
    for a in axes:
        if a not in sizes:
            _check_axes(lay, axes)  # raises, naming the mesh
    if len(axes) == 1:  # the common gather: one mesh axis (the set below, without its comprehension)
        i = _where(lay, axes[0])
        if i is None:
            raise EinshardError(f"all-gather over {axes} needs them to split one axis of {lay}")
    else:
        where = {_where(lay, a) for a in axes}
        if len(where) != 1 or None in where:
            raise EinshardError(f"all-gather over {axes} needs them to split one axis of {lay}")
        i = where.pop()
    if i is None:  # (excluded above; narrows the type)
        raise EinshardError(f"all-gather over {axes} needs them to split one axis of {lay}")
    d = lay.dims[i]
    if d[len(d) - len(axes) :] != tuple(axes):
        raise EinshardError(
            f"all-gather over {axes}: they are not the minor-most mesh axes of {lay.axes[i]!r} in {lay}"
        )
    after = derived(lay, lay.dims[:i] + (d[: len(d) - len(axes)],) + lay.dims[i + 1 :])
    n = math.prod(map(sizes.__getitem__, axes))
    return after, Move("all-gather", tuple(axes), n, lay, after, why, i)


def dynamic_slice(lay: Layout, axes: tuple[str, ...], axis: str | int) -> tuple[Layout, None]:
    """Split tensor axis ``axis`` further over mesh axes ``axes`` (minor-most), which the tensor is replicated over.

    Free: each device keeps its own block.
    """
    _check_axes(lay, axes)
    i = _dim_index(lay, axis)
    for a in axes:
        if _where(lay, a) is not None or a in lay.unreduced:
            raise EinshardError(f"dynamic-slice over {a!r}: {lay} is not replicated over it")
    after = derived(lay, lay.dims[:i] + (lay.dims[i] + tuple(axes),) + lay.dims[i + 1 :])
    if lay.shape[i] % _shards(after, i):
        raise EinshardError(
            f"axis {lay.axes[i]!r} has size {lay.shape[i]}, which does not split into {_shards(after, i)} shards"
        )
    return after, None


def all_reduce(lay: Layout, axes: tuple[str, ...], *, why: str = "") -> tuple[Layout, Move]:
    """Sum the pending partial sums over mesh axes ``axes``: ``{U:a} → complete``."""
    sizes = mesh_sizes(lay)
    for a in axes:
        if a not in sizes:
            _check_axes(lay, axes)  # raises, naming the mesh
    if not lay.unreduced.issuperset(axes):
        raise EinshardError(f"all-reduce over {axes}: {lay} holds no pending sums over them")
    after = derived(lay, lay.dims, lay.unreduced.difference(axes))
    n = math.prod(map(sizes.__getitem__, axes))
    return after, Move("all-reduce", tuple(axes), n, lay, after, why)


def reduce_scatter(
    lay: Layout, axes: tuple[str, ...], axis: str | int, *, order: tuple[str, ...] | None = None, why: str = ""
) -> tuple[Layout, Move]:
    """Sum pending partial sums over ``axes`` and leave each device one block of tensor axis ``axis``.

    ``order`` (optional) is the split of ``axis`` afterwards: the current
    mesh axes, ``axes`` and mesh axes the tensor is replicated over, in any
    order.  A reduce-scatter can hand each device any block (its input chunks
    are reordered locally first), so slicing more mesh axes into the same
    dimension in the same step is free; XLA's CPU form, all-reduce then
    dynamic-slice, does exactly that.
    """
    _check_axes(lay, axes)
    if not set(axes) <= lay.unreduced:
        raise EinshardError(f"reduce-scatter over {axes}: {lay} holds no pending sums over them")
    i = _dim_index(lay, axis)
    new = lay.dims[i] + tuple(axes) if order is None else tuple(order)
    extra = set(new) - set(lay.dims[i]) - set(axes)
    if (
        len(set(new)) != len(new)
        or not set(lay.dims[i]) <= set(new)
        or not set(axes) <= set(new)
        or any(_where(lay, m) is not None or m in lay.unreduced for m in extra)
    ):
        raise EinshardError(f"reduce-scatter over {axes}: cannot split {lay.axes[i]!r} as {new} from {lay}")
    after = derived(lay, lay.dims[:i] + (new,) + lay.dims[i + 1 :], lay.unreduced - set(axes))
    if lay.shape[i] % _shards(after, i):
        raise EinshardError(
            f"axis {lay.axes[i]!r} has size {lay.shape[i]}, which does not split into {_shards(after, i)} shards"
        )
    return after, Move("reduce-scatter", tuple(axes), _group(lay, axes), lay, after, why, i)


def all_to_all(
    lay: Layout, axes: tuple[str, ...], src: str | int, dst: str | int, *, why: str = ""
) -> tuple[Layout, Move]:
    """Move mesh axes ``axes`` (the minor-most of tensor axis ``src``) onto tensor axis ``dst`` (minor-most)."""
    _check_axes(lay, axes)
    i, j = _dim_index(lay, src), _dim_index(lay, dst)
    d = lay.dims[i]
    if i == j or d[len(d) - len(axes) :] != tuple(axes):
        raise EinshardError(
            f"all-to-all over {axes}: they are not the minor-most mesh axes of {lay.axes[i]!r} in {lay}"
        )
    dims = list(lay.dims)
    dims[i] = d[: len(d) - len(axes)]
    dims[j] = dims[j] + tuple(axes)
    after = derived(lay, tuple(dims))
    if lay.shape[j] % _shards(after, j):
        raise EinshardError(
            f"axis {lay.axes[j]!r} has size {lay.shape[j]}, which does not split into {_shards(after, j)} shards"
        )
    return after, Move("all-to-all", tuple(axes), _group(lay, axes), lay, after, why, i, j)


def collective_permute(lay: Layout, dims: tuple[tuple[str, ...], ...], *, why: str = "") -> tuple[Layout, Move]:
    """Give each tensor axis the same mesh axes in another order: the blocks move to other devices."""
    if len(dims) != len(lay.dims) or any(set(a) != set(b) for a, b in zip(dims, lay.dims, strict=False)):
        raise EinshardError(f"collective-permute changes only the order of mesh axes within an axis of {lay}")
    moved = tuple(m for a, b in zip(dims, lay.dims, strict=False) if a != b for m in b)
    after = derived(lay, tuple(dims))
    return after, Move("collective-permute", moved, _group(lay, moved) if moved else 1, lay, after, why)


def regroup(
    lay: Layout, axis: str | int, gone: tuple[str, ...], new: tuple[str, ...]
) -> tuple[Layout, tuple[Move, ...]]:
    """Re-split tensor axis ``axis`` from its minor-most mesh axes ``gone`` to ``new`` (replicated ones).

    When the new split refines the old one or the old one refines the new
    (the group sizes divide), XLA does not gather: it sends each device a
    block of the new split with a collective-permute, and, if the new split
    is coarser by a factor f, all-gathers over groups of f.  Otherwise the
    old axes are gathered and the new ones sliced.

    Example:
        >>> from einshard.placement import Layout, MeshAxis
        >>> a = Layout(("c",), (16,), (MeshAxis("x", 4), MeshAxis("y", 2)), (("x",),))
        >>> b, moves = regroup(a, "c", ("x",), ("y",))
        >>> b.dims, [(m.kind, m.axes, m.group_size) for m in moves]
        ((('y',),), [('collective-permute', ('x', 'y'), 4), ('all-gather', ('x',), 2)])
    """
    i = _dim_index(lay, axis)
    sizes = mesh_sizes(lay)
    p = math.prod(sizes[m] for m in gone)
    q = math.prod(sizes[m] for m in new)
    d = lay.dims[i]
    keep = d[: len(d) - len(gone)]
    after = derived(lay, lay.dims[:i] + (keep + tuple(new),) + lay.dims[i + 1 :])
    if lay.shape[i] % _shards(after, i):
        raise EinshardError(f"axis {lay.axes[i]!r} does not split over {new}")
    why = f"re-split {_name(lay, i)} from {','.join(gone)} to {','.join(new)}"
    if p % q == 0:
        f = p // q
        mid = derived(lay, after.dims)  # the permute's result: the new split's blocks, f copies of each group
        moves = [Move("collective-permute", gone + new, p, lay, mid, why)]
        if f > 1:
            moves.append(Move("all-gather", gone, f, mid, after, why, i))
        return after, tuple(moves)
    if q % p == 0:
        return after, (Move("collective-permute", gone + new, q, lay, after, why),)
    cur, c = all_gather(lay, gone, why=why)
    cur, _ = dynamic_slice(cur, new, i)
    return cur, (c,)


# ---------------------------------------------------------------------------
# transition: the moves that take one layout of a tensor to another


def transition(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]]:
    """The moves that take ``src`` to ``dst`` (same tensor, same mesh), cheapest order (module doc).

    Moves whose groups are single devices (mesh axes of size 1) are left out: they are no-ops.

    Raises EinshardError if ``dst`` holds pending sums ``src`` does not (a
    complete value cannot become a pending sum by communication).

    Example:
        >>> from einshard.placement import Layout, MeshAxis
        >>> mesh = (MeshAxis("x", 4),)
        >>> a = Layout(("a", "b"), (16, 32), mesh, (("x",), ()))
        >>> _, moves = transition(a, a.with_dims(((), ("x",))))
        >>> [(m.kind, m.dim, m.to_dim) for m in moves]      # V11: one all-to-all
        [('all-to-all', 0, 1)]
    """
    if src.dims == dst.dims and src.unreduced == dst.unreduced and src.axes == dst.axes and src.shape == dst.shape:
        return src, ()  # nothing to do (the common case, kept fast)
    if src.unreduced == dst.unreduced and src.axes == dst.axes and src.shape == dst.shape and _only_slices(src, dst):
        return dst, ()  # the next most common: free slices of a replicated operand (what step 2 alone would do)
    # Mesh axes of size 1 split nothing: x@(a,b) with |a| = 1 is x@b.  Compare without them.
    if not trivial_axes(src) and not trivial_axes(dst):  # the common mesh: no axis of size 1
        return _transition(src, dst)
    src_n, dst_n = drop_trivial(src), drop_trivial(dst)
    if src_n is not src or dst_n is not dst:
        if src_n.dims == dst_n.dims and src_n.unreduced == dst_n.unreduced:
            if src.axes != dst.axes or src.shape != dst.shape:
                raise EinshardError(f"transition between different tensors: {src} and {dst}")
            return dst, ()
        _, moves = _transition(src_n, dst_n)
        return dst, moves
    return _transition(src, dst)


def _only_slices(src: Layout, dst: Layout) -> bool:
    """Whether ``dst`` only splits ``src`` further (each dimension's mesh axes extended at the minor end by
    mesh axes ``src`` neither splits nor sums over), every split dividing its dimension: then
    :func:`_transition` would only slice, which is free.  False sends the general path the rest (and its
    errors)."""
    for sd, dd in zip(src.dims, dst.dims, strict=True):  # the cheap test first: most moves are not slices
        if dd[: len(sd)] != sd:
            return False
    sizes = mesh_sizes(src)
    used = set(src.unreduced)
    for d in src.dims:
        used.update(d)
    for s, sd, dd in zip(src.shape, src.dims, dst.dims, strict=True):
        if dd == sd:
            continue
        n = 1
        for m in dd:
            k = sizes.get(m)
            if k is None:
                return False
            n *= k
        for m in dd[len(sd) :]:
            if m in used:
                return False
            used.add(m)
        if s % n:
            return False
    return True


def drop_trivial(lay: Layout) -> Layout:
    """The layout without mesh axes of size 1 (itself if it uses none): splitting over one device is no
    split, and summing over one device no sum, so neither needs a step."""
    trivial = trivial_axes(lay)
    if not trivial:  # the common mesh: no axis of size 1
        return lay
    if not any(m in trivial for d in lay.dims for m in d) and not (lay.unreduced & trivial):
        return lay
    dims = tuple(tuple(m for m in d if m not in trivial) for d in lay.dims)
    return derived(lay, dims, lay.unreduced - trivial)


def _transition(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]]:
    """The general path (:func:`_stepwise`), or one slice-and-permute where every target block lies in one
    source block and the steps would move more (:func:`_permuted_tiles`)."""
    cur, moves = _stepwise(src, dst)
    if src.unreduced or dst.unreduced or not moves:
        return cur, moves  # free slices
    if len(moves) == 1 and moves[0].kind == "collective-permute" and _moves_no_more(moves[0], dst):
        return cur, moves  # already one permute, of no more than the target's block
    permuted = _permuted_tiles(src, dst)
    return permuted if permuted is not None else (cur, moves)


def _moves_no_more(permute: Move, dst: Layout) -> bool:
    """Whether a permute sends no more than ``dst``'s block (it sends the smaller of its two)."""
    sent = min(permute.before.bytes_per_device(1), permute.after.bytes_per_device(1))
    return sent <= dst.bytes_per_device(1)


def _stepwise(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]]:
    if src.axes != dst.axes or src.shape != dst.shape:
        raise EinshardError(f"transition between different tensors: {src} and {dst}")
    extra = dst.unreduced - src.unreduced
    if extra:
        raise EinshardError(
            f"cannot reach {dst} from {src}: a complete value does not become a pending sum over "
            f"{', '.join(sorted(extra))} by communication"
        )
    moves: list[Move] = []
    cur = src
    order = mesh_sizes(src)  # the mesh axes' names in mesh order (the keys of its sizes: no list built)
    # The two most common moves, as the general steps below would do them, without their bookkeeping:
    if src.dims == dst.dims:  # only sums to complete: step 1's all-reduce
        summed = src.unreduced - dst.unreduced
        # in mesh order (one mesh axis, the common sum: itself)
        rest = tuple(summed) if len(summed) < 2 else tuple([m for m in order if m in summed])
        if rest:
            cur, c = all_reduce(cur, rest, why="sum the partial results")
            _add(moves, c)
        return cur, tuple(moves)
    leaving: dict[str, int] | None = None
    if src.unreduced == dst.unreduced:
        leaving = {}
        for i, (sd, dd) in enumerate(zip(src.dims, dst.dims, strict=True)):
            if dd != sd[: len(dd)]:
                leaving = None
                break
            for m in sd[len(dd) :]:
                leaving[m] = i
    if leaving is not None:  # only minor-most mesh axes leave their dimensions: step 4's gathers
        gathered: dict[int, list[str]] = {}
        for m in order:
            if m in leaving:
                gathered.setdefault(leaving[m], []).append(m)
        for i, ms in _last_dim_first(gathered):
            # in the dimension's order (one mesh axis, the common gather: itself; each is in cur.dims[i])
            ms_ordered = (ms[0],) if len(ms) == 1 else tuple([m for m in cur.dims[i] if m in ms])
            cur, c = all_gather(cur, ms_ordered, why=f"gather {_name(src, i)}")
            _add(moves, c)
        return cur, tuple(moves)
    src_at = {m: i for i, d in enumerate(src.dims) for m in d}
    dst_at = {m: i for i, d in enumerate(dst.dims) for m in d}
    if not src.unreduced and not dst.unreduced:
        direct = _swapped_tiles(src, dst) or _swapped_counts(_fresh_sliced(src, dst), dst) or _coarsened(src, dst)
        if direct is not None:
            return direct
    if not src.unreduced and (
        _gathers_and_shifts_one_dim(src, src_at, dst_at)
        or _shift_meets_slice(dst, src_at, dst_at)
        or _shifts_fan(src, dst, src_at, dst_at)
    ):
        return _rematerialized(src, dst)

    # 1. Pending sums: reduce-scatter onto the dimension the target splits with them (slicing in the same
    #    step whatever else the target splits that dimension with), else all-reduce.  Reductions come
    #    before slices of other dimensions, as XLA orders them (it all-reduces the whole local result).
    pending = [m for m in order if m in src.unreduced and m not in dst.unreduced] if src.unreduced else []
    slice_now = {m for d in dst.dims for m in d if m not in src_at and m not in src.unreduced}
    by_dim: dict[int, list[str]] = {}
    for m in pending:
        if m in dst_at:
            by_dim.setdefault(dst_at[m], []).append(m)
    for j, ms in by_dim.items():
        ms_ordered = tuple(m for m in dst.dims[j] if m in ms)
        keep = cur.dims[j]
        tail = tuple(m for m in dst.dims[j] if m in ms or m in slice_now)
        final = tuple(m for m in dst.dims[j] if m in keep) + tail if dst.dims[j][: len(keep)] == keep else keep + tail
        slice_now -= set(final)
        cur, c = reduce_scatter(cur, ms_ordered, j, order=final, why="sum the partial results and keep one block each")
        _add(moves, c)
    rest = tuple(m for m in pending if m not in dst_at)
    if rest:
        cur, c = all_reduce(cur, rest, why="sum the partial results")
        _add(moves, c)

    # 1b. A dimension whose split changes from mesh axes A (gathered) to B (sliced) where one split
    #     refines the other: XLA permutes blocks instead of gathering all of A (regroup, module doc).
    regrouped: set[str] = set()
    gone_any = slice_now and any(m not in dst_at for m in src_at)
    for j in range(len(dst.dims)) if gone_any else ():
        d_src, d_dst = cur.dims[j], dst.dims[j]
        gone = tuple(m for m in d_src if m not in dst_at)
        new = tuple(m for m in d_dst if m in slice_now)
        keep = d_src[: len(d_src) - len(gone)]
        if not gone or not new or d_src[len(keep) :] != gone or d_dst[: len(keep)] != keep:
            continue
        if d_dst[len(keep) :] != new:
            continue
        cur, st = regroup(cur, j, gone, new)
        for c in st:
            _add(moves, c)
        slice_now -= set(new)
        regrouped |= set(gone)

    # 2. Mesh axes that move from one tensor axis to another (all-to-alls below), grouped by source and target,
    #    a dimension emptied before it is filled (XLA's partitioner: [., y@a, z@b] -> [x@b, ., z@a] moves b to
    #    x, then a to z, and needs no permute).
    shifts = _ordered_shifts(order, src_at, dst_at)
    receiving = {j for (_, j), _ in shifts}

    # 2a. Free slices, in the target's mesh-axis order within each dimension, before the all-to-alls (so those
    #     move less), except where the target is the source's tiling shifted one dimension major-ward with the
    #     replicated mesh axes splitting the last dimension (:func:`_shifted_tiling`): there XLA's partitioner
    #     moves the source's blocks whole and slices after.
    if slice_now and not _shifted_tiling(src, dst):
        for j, d in enumerate(dst.dims):
            new = tuple(m for m in d if m in slice_now)
            if new:
                cur, _ = dynamic_slice(cur, new, j)
        slice_now = set()

    # 2b. A dimension an all-to-all fills gives up what the target does not split it over first (XLA's
    #     partitioner: [x@a, y@b] -> [x, y@a] gathers b, then moves a; the other order needs a permute).
    gathers: dict[int, list[str]] = {}
    for m in order:
        if m in src_at and m not in dst_at and m not in regrouped:
            gathers.setdefault(src_at[m], []).append(m)
    for i in sorted(gathers.keys() & receiving, reverse=True):
        first = gathers.pop(i)
        cur = _to_minor(cur, i, first, moves)
        ms_ordered = tuple(m for m in cur.dims[i] if m in first)
        cur, c = all_gather(cur, ms_ordered, why=f"gather {_name(src, i)}")
        _add(moves, c)

    # 3. The all-to-alls.
    for (i, j), ms in shifts:
        cur = _to_minor(cur, i, ms, moves)
        ms_ordered = tuple(m for m in cur.dims[i] if m in ms)  # moved as the group they are, in their order
        cur, c = all_to_all(cur, ms_ordered, i, j, why=f"move the split from {_name(src, i)} to {_name(src, j)}")
        _add(moves, c)

    # 3b. The other free slices, after the all-to-alls: XLA's partitioner moves the source's blocks whole and
    #     slices the result ([x, y@a] -> [x@a, y@b] on (4, 2): one all-to-all of [16, 4], then a slice).
    for j, d in enumerate(dst.dims) if slice_now else ():
        new = tuple(m for m in d if m in slice_now)
        if new:
            cur, _ = dynamic_slice(cur, new, j)

    # 4. Gathers, grouped by the dimension they leave.
    for i, ms in _last_dim_first(gathers):
        cur = _to_minor(cur, i, ms, moves)
        ms_ordered = tuple(m for m in cur.dims[i] if m in ms)
        cur, c = all_gather(cur, ms_ordered, why=f"gather {_name(src, i)}")
        _add(moves, c)

    # 5. Same mesh axes per dimension, other order: the blocks sit on other devices.
    if cur.dims != dst.dims:
        cur, c = collective_permute(cur, dst.dims, why="reorder the mesh axes of a split")
        _add(moves, c)
    return cur, tuple(moves)


def _ordered_shifts(
    order: dict[str, int], src_at: dict[str, int], dst_at: dict[str, int]
) -> list[tuple[tuple[int, int], list[str]]]:
    """The mesh axes that change tensor axis, grouped by (source, target) dimension in mesh order, each group
    after the groups that leave its target dimension (where no cycle forbids it)."""
    groups: dict[tuple[int, int], list[str]] = {}
    for m in order:
        if m in src_at and m in dst_at and src_at[m] != dst_at[m]:
            groups.setdefault((src_at[m], dst_at[m]), []).append(m)
    if len(groups) < 2:
        return list(groups.items())
    pending = list(groups.items())
    out: list[tuple[tuple[int, int], list[str]]] = []
    while pending:
        ready = [g for g in pending if not any(h[0][0] == g[0][1] for h in pending if h is not g)]
        pick = ready[0] if ready else pending[0]
        out.append(pick)
        pending.remove(pick)
    return out


def _shifted_tiling(src: Layout, dst: Layout) -> bool:
    """Whether ``dst`` splits every mesh axis, each dimension as many ways as ``src`` splits the next one and the
    last dimension as many ways as ``src`` is replicated, with the mesh axes in the same order (the source's
    replicated ones last, in mesh order), the source's first dimension whole.  XLA's partitioner reshards that
    by all-to-alls of the source's blocks, then slices the last dimension (its partial-replicate to tiled
    all-to-all; measured: [x, y@a] -> [x@a, y@b] on (4, 2) all-to-alls the [16, 4] block, as
    [., ., z@a] -> [., y@a, z@b] and [., y@a, .] -> [x@a, ., z@b] do the [8, 8, 2] and [8, 2, 8] ones, where
    [., y@a, .] -> [x@a, y@b, .] slices first)."""
    if src.dims[0] or src.unreduced or dst.unreduced:
        return False
    sizes = mesh_sizes(src)
    used = [m for d in src.dims for m in d]
    replicated = [m for m in sizes if m not in used and sizes[m] > 1]
    if (
        not replicated
        or [m for d in dst.dims for m in d if sizes[m] > 1] != [m for m in used if sizes[m] > 1] + replicated
    ):
        return False
    counts = [_group(src, d) for d in src.dims[1:]] + [_group(src, tuple(replicated))]
    return [_group(dst, d) for d in dst.dims] == counts


def _last_dim_first(gathers: dict[int, list[str]]) -> list[tuple[int, list[str]]]:
    """Gathers of several dimensions, the last dimension first: XLA's partitioner gathers a tiled value's
    dimensions from the minor end (``[x@a, y@b] -> [x, y]`` gathers y over b, then x over a: the first
    gather moves the smaller block)."""
    return sorted(gathers.items(), reverse=True) if len(gathers) > 1 else list(gathers.items())


def _gathers_and_shifts_one_dim(src: Layout, src_at: dict[str, int], dst_at: dict[str, int]) -> bool:
    """Whether a dimension of ``src`` loses a mesh axis to an all-to-all (the target splits another dimension over
    it) that lies major to one it loses to a gather (the target does not split over it).  XLA's partitioner has
    no direct reshard for that (measured: ``[x@(a,b), y] -> [x, y@a]`` compiles to one all-gather over (a, b)
    and a slice, "Involuntary full rematerialization"), so it gathers the whole value and slices the target's
    block.  The other way round (``[x@(a,b), y] -> [x, y@b]``) it moves b with an all-to-all, then gathers a."""
    for i, d in enumerate(src.dims):
        shifted = [k for k, m in enumerate(d) if m in dst_at and dst_at[m] != i]
        gathered = [k for k, m in enumerate(d) if m not in dst_at]
        if shifted and gathered and min(shifted) < max(gathered):
            return True
    return False


def _shift_meets_slice(dst: Layout, src_at: dict[str, int], dst_at: dict[str, int]) -> bool:
    """Whether a dimension of ``dst`` keeps a mesh axis of its own and takes mesh axes from a later dimension (an
    all-to-all) and mesh axes the source does not split over (a slice) at once, every other mesh axis staying
    split.  XLA's partitioner has no direct reshard for that (measured on (2, 2, 2), standalone and as an
    elementwise op's operand: ``[x@a, y@c] -> [x@(a,b,c), y]``, ``-> [x@(a,c,b), y]`` and
    ``[x@b, y@c] -> [x@(b,a,c), y]`` compile to an all-gather of each dimension, "Involuntary full
    rematerialization"), so it gathers the whole value and slices the target's block.  Without a kept mesh axis
    it may slice first and all-to-all (``[x, y@b] -> [x@(a,b), y]`` on (4, 2): one all-to-all; on (2, 2, 2)
    ``[x, y@c] -> [x@(b,c), y]`` is gathered: not modelled), from an earlier dimension too
    (``[x@(a,c), y] -> [x@a, y@(b,c)]``: one all-to-all); where a mesh axis leaves, the fresh one takes its place
    by a permute (``[x@a, y@c] -> [x@(b,c), y]``: an all-to-all and a collective-permute)."""
    if any(m not in dst_at for m in src_at):
        return False
    for j, d in enumerate(dst.dims):
        kept = any(src_at.get(m, -1) == j for m in d)
        later = any(src_at.get(m, j) > j for m in d)
        fresh = any(m not in src_at for m in d)
        if kept and later and fresh:
            return True
    return False


def _permuted_tiles(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]] | None:
    """Every dimension split as many ways as in ``src`` or a multiple of that, over other mesh axes: each
    target block lies inside one source block, so XLA's partitioner slices it where a device holds it and sends
    it with one collective-permute (measured: ``[x@(b,c), y] -> [x@(a,b), y]`` on (2, 2, 2) permutes the block,
    where gathering c and re-splitting would send it three times; ``[x@b, y] -> [x@a, y@b]`` on (4, 2) slices
    and permutes a [4, 8] piece, where an all-to-all would send the [8, 16] one).  None where a dimension's
    split gets coarser (a gather or an all-to-all is part of the move)."""
    if any(_group(dst, dd) % _group(src, sd) for sd, dd in zip(src.dims, dst.dims, strict=True)):
        return None
    moved = tuple(dict.fromkeys(m for sd, dd in zip(src.dims, dst.dims) if sd != dd for m in sd + dd))
    after = derived(src, dst.dims)
    permute = Move(
        "collective-permute", moved, _group(src, moved), src, after, "send each block where the target names it"
    )
    moves: list[Move] = []
    _add(moves, permute)
    return after, tuple(moves)


def _swapped_tiles(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]] | None:
    """One split dimension's whole split moved to another dimension split as many ways (over any mesh axes):
    XLA's partitioner swaps the tiles with one all-to-all over the source's group, then sends each block to the
    device the target names with a collective-permute where the mesh axes differ (measured on (2, 2, 2):
    ``[x@(b,c), y] -> [x, y@(a,b)]`` is an all-to-all over 4 devices and a permute, where gathering the whole
    value would move four times the bytes), where the source's major mesh axis splits the target too.  None
    where the layouts are not so."""
    split_src = [i for i, d in enumerate(src.dims) if d]
    split_dst = [j for j, d in enumerate(dst.dims) if d]
    if len(split_src) != 1 or len(split_dst) != 1 or split_src == split_dst:
        return None
    i, j = split_src[0], split_dst[0]
    if _group(src, src.dims[i]) != _group(dst, dst.dims[j]) or src.dims[i] == dst.dims[j]:
        return None  # other sizes (a gather or a slice is part of it), or a plain all-to-all (the general path)
    if src.dims[i][0] not in dst.dims[j]:
        return None  # the major mesh axis leaves: XLA gathers it (measured: [x@a] -> [y@b] gathers and slices)
    if dst.shape[j] % _group(src, src.dims[i]):
        return None
    mid, a2a = all_to_all(src, src.dims[i], i, j, why=f"move the split from {_name(src, i)} to {_name(src, j)}")
    after = derived(src, dst.dims)
    moved = tuple(dict.fromkeys(src.dims[i] + dst.dims[j]))
    permute = Move("collective-permute", moved, a2a.group_size, mid, after, "send each block where the target names it")
    moves: list[Move] = []
    _add(moves, a2a)
    _add(moves, permute)
    return after, tuple(moves)


def _shifts_fan(src: Layout, dst: Layout, src_at: dict[str, int], dst_at: dict[str, int]) -> bool:
    """Whether the mesh axes that change tensor axis leave one dimension for two, or come from two dimensions
    into one, where the dimensions whose split changes are not split as many ways as one another's were (the
    counts not a permutation).  XLA's partitioner moves splits by all-to-alls between dimensions that trade
    their counts; for the others it has no direct reshard (measured on (4, 2): [., y@a, z@b] -> [x@(a,b), ., .]
    and [., ., z@(a,b)] -> [x@a, y@b, .] gather the whole value and slice it, "Involuntary full
    rematerialization"; on (2, 2, 2) [., y@b, z@(a,c)] -> [x@c, y@(b,a), .] all-to-alls twice and permutes, as
    [x@(b,c), ., .] -> [., y@(a,c), z@b] does, a sliced first)."""
    targets: dict[int, set[int]] = {}
    sources: dict[int, set[int]] = {}
    for m, i in src_at.items():
        j = dst_at.get(m, i)
        if j != i:
            targets.setdefault(i, set()).add(j)
            sources.setdefault(j, set()).add(i)
    if all(len(t) < 2 for t in targets.values()) and all(len(t) < 2 for t in sources.values()):
        return False
    # counted after the free slices of mesh axes the source does not split over (XLA slices those first)
    sliced = [tuple(m for m in dd if m not in src_at) for dd in dst.dims]
    counts = [(_group(src, sd + f), _group(dst, dd)) for sd, dd, f in zip(src.dims, dst.dims, sliced, strict=True)]
    changed = [(a, b) for a, b in counts if a != b]
    return sorted(a for a, _ in changed) != sorted(b for _, b in changed)


def _swapped_counts(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]] | None:
    """Two dimensions, the others as they are, where one hands a factor f of its split to the other and stays
    split (p, q ways to p/f, q*f).  XLA's partitioner reshards by tile counts: one all-to-all moves the factor,
    then a collective-permute sends each block to the device the target names (measured on (4, 2):
    [x@a, y@b] -> [x@b, y@a] is an all-to-all and a permute of the [4, 8] block, where moving each mesh axis
    would be two all-to-alls; on (2, 2, 2) [x, y@(a,b,c)] -> [x@a, y@(c,b)] is one all-to-all by 2 and a
    permute).  Where the factor is the source dimension's minor mesh axes, the all-to-all is theirs; otherwise
    it runs over part of a mesh axis (not a named split: the lowering runs an alternative).  None where the
    layouts are not so."""
    differ = [d for d, (sd, dd) in enumerate(zip(src.dims, dst.dims, strict=True)) if sd != dd]
    if len(differ) != 2:
        return None
    i, j = differ
    p, q = _group(src, src.dims[i]), _group(src, src.dims[j])
    p2, q2 = _group(dst, dst.dims[i]), _group(dst, dst.dims[j])
    if p2 > p:
        i, j, p, q, p2, q2 = j, i, q, p, q2, p2
    if p2 >= p or p % p2 or q2 != q * (p // p2) or p2 == 1:
        return None  # not a factor handed from i to j, i kept split (a whole split moving: the general path)
    f = p // p2
    d = src.dims[i]
    why = f"move a factor {f} of the split from {_name(src, i)} to {_name(src, j)}"
    moves: list[Move] = []
    k = next((k for k in range(len(d)) if _group(src, d[k:]) == f), None)
    if k is not None and dst.shape[j] % (q * f) == 0:
        cur, c = all_to_all(src, d[k:], i, j, why=why)
    else:
        cur = derived(src, dst.dims)
        c = Move("all-to-all", d, f, src, cur, why, i, j)  # over part of d's devices
    _add(moves, c)
    if cur.dims != dst.dims or k is None:
        moved = tuple(dict.fromkeys(src.dims[i] + src.dims[j]))
        after = derived(src, dst.dims)
        _add(
            moves,
            Move(
                "collective-permute", moved, _group(src, moved), cur, after, "send each block where the target names it"
            ),
        )
        cur = after
    return cur, tuple(moves)


def _fresh_sliced(src: Layout, dst: Layout) -> Layout:
    """``src`` with the mesh axes it does not use sliced into the dimensions ``dst`` splits over them (free: XLA's
    partitioner slices first, then trades counts: [x, y@(a,b)] -> [x@(a,c), y@b] on (2, 2, 2) is one all-to-all
    and a permute of the [4, 8] block)."""
    used = {m for d in src.dims for m in d} | src.unreduced
    fresh = [tuple(m for m in dd if m not in used) for dd in dst.dims]
    if not any(fresh) or _shifted_tiling(src, dst):
        return src  # (the shifted tiling moves the whole blocks, then slices)
    dims = tuple(sd + f for sd, f in zip(src.dims, fresh, strict=True))
    if any(n % _group(src, d) for n, d in zip(src.shape, dims, strict=True)):
        return src
    return derived(src, dims)


def _coarsened(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]] | None:
    """Every dimension split as many ways as in ``src`` or a factor of that, some over other mesh axes (plain
    gathers of minor mesh axes are the fast path).  XLA's partitioner first sends each block with one
    collective-permute to a device of its target group, then all-gathers each dimension by its factor, the last
    dimension first (measured on (4, 2): [x@a, y@b] -> [x@b, y] permutes the [4, 8] block, gathers y over 2,
    then x over 2 devices of a).  A dimension whose target axes are among its own is reordered by the permute
    and gathered over its minor mesh axes; one whose count stays takes the target's axes in the permute; any
    other is gathered over a factor of its mesh axes (not a named split: the lowering runs an alternative).
    None where the layouts are not so, or where no layout after the permute names it."""
    if any(_group(src, sd) % _group(dst, dd) for sd, dd in zip(src.dims, dst.dims, strict=True)):
        return None
    mid_dims = _coarsened_mid(src, dst)
    if mid_dims is None:
        return None
    factor = any(md[: len(dd)] != dd for dd, md in zip(dst.dims, mid_dims, strict=True))  # a gather by a factor
    mid = derived(src, tuple(mid_dims))
    moves: list[Move] = []
    if mid.dims != src.dims or factor:
        moved = tuple(dict.fromkeys(m for sd, dd in zip(src.dims, dst.dims) if dd != sd[: len(dd)] for m in sd + dd))
        _add(
            moves,
            Move("collective-permute", moved, _group(src, moved), src, mid, "send each block to its target group"),
        )
    cur, real = mid, list(mid.dims)  # cur: the layout the moves record; real: each dimension's split
    unnamed = False  # whether a gather runs over part of its mesh axes' devices (the lowering cannot run it)
    for d in reversed(range(len(dst.dims))):
        have, want = real[d], dst.dims[d]
        if have == want:
            continue
        real[d] = want
        f = _group(src, have) // _group(dst, want)
        if cur.dims[d] == have and have[: len(want)] == want:
            cur, c = all_gather(cur, have[len(want) :], why=f"gather {_name(src, d)}")
            _add(moves, c)
            continue
        gone = tuple(m for m in have if m not in want) or have
        unnamed = unnamed or _group(src, gone) != f
        used = [m for k in real for m in k]
        if len(used) == len(set(used)):
            after = derived(src, tuple(real))
        else:  # the split between is no named layout ([x@b, y@a] -> [x, y@b] on (4, 2): y over half of a): a
            # stand-in with its block size, which is all a gather's price reads
            stand_in = _stand_in(src, math.prod(_group(src, k) for k in real))
            if stand_in is None:
                return None
            after = stand_in
        _add(moves, Move("all-gather", gone, f, cur, after, f"gather {_name(src, d)} by a factor {f}", d))
        cur = after
    if factor and not unnamed:
        return None  # named gathers that would not take the permuted blocks there: left to the general path
    return cur, tuple(moves)


def _coarsened_mid(src: Layout, dst: Layout) -> list[tuple[str, ...]] | None:
    """The layout :func:`_coarsened`'s permute leaves: each dimension the target's mesh axes then the ones it gathers
    after (its own where the target does not split elsewhere over them, else mesh axes the target leaves out,
    [x@a, y@c] -> [x@c, y] on (2, 2, 2) permutes to [x@c, y@a] and gathers a), or, where no mesh axes make its
    factor, the source's (gathered over a factor of them).  None where a mesh axis would split two dimensions."""
    sizes = mesh_sizes(src)
    taken = {m for d in dst.dims for m in d}
    pool = [m for d in src.dims for m in d if m not in taken]  # gathered in the end: free for the permute
    mid: list[tuple[str, ...] | None] = []
    for sd, dd in zip(src.dims, dst.dims, strict=True):
        rest = tuple(m for m in sd if m not in dd)
        if set(dd) <= set(sd) and all(m in pool for m in rest):
            mid.append(dd + rest)
            pool = [m for m in pool if m not in rest]
        elif _group(src, sd) == _group(dst, dd):
            mid.append(dd)
        else:
            mid.append(None)
    for k, (sd, dd) in enumerate(zip(src.dims, dst.dims, strict=True)):
        if mid[k] is not None:
            continue
        f = _group(src, sd) // _group(dst, dd)
        extra = next(
            (
                c
                for r in range(1, len(pool) + 1)
                for c in itertools.combinations(pool, r)
                if math.prod(sizes[m] for m in c) == f
            ),
            None,
        )
        if extra is not None:
            mid[k] = dd + extra
            pool = [m for m in pool if m not in extra]
        else:
            mid[k] = sd
    out = [d for d in mid if d is not None]
    used = [m for d in out for m in d]
    return out if len(used) == len(set(used)) else None


def _stand_in(lay: Layout, blocks: int) -> Layout | None:
    """A layout of ``lay``'s tensor on its mesh in ``blocks`` blocks (one dimension split over mesh axes whose
    sizes multiply to that), or None where there is none."""
    sizes = mesh_sizes(lay)
    names = [m for m in sizes if sizes[m] > 1]
    for r in range(len(names) + 1):
        for pick in itertools.combinations(names, r):
            if math.prod(sizes[m] for m in pick) != blocks:
                continue
            for d, n in enumerate(lay.shape):
                if n % blocks == 0:
                    return derived(lay, tuple(pick if k == d else () for k in range(len(lay.shape))))
    return None


def _rematerialized(src: Layout, dst: Layout) -> tuple[Layout, tuple[Move, ...]]:
    """``src`` gathered whole (each split dimension's mesh axes in one all-gather, the last dimension first),
    then sliced to ``dst`` (free): XLA's last-resort reshard."""
    moves: list[Move] = []
    cur = src
    split = {i: list(d) for i, d in enumerate(src.dims) if d}
    for i, ms in _last_dim_first(split):
        cur, c = all_gather(
            cur, tuple(ms), why=f"gather {_name(src, i)} (no direct reshard: XLA gathers the whole value)"
        )
        _add(moves, c)
    for j, d in enumerate(dst.dims):
        if d:
            cur, _ = dynamic_slice(cur, d, j)
    return cur, tuple(moves)


def _add(moves: list[Move], move: Move) -> None:
    """Record a move unless its groups are single devices (a mesh axis of size 1: a no-op)."""
    if move.group_size > 1:
        moves.append(move)


def _to_minor(cur: Layout, i: int, ms: list[str], moves: list[Move]) -> Layout:
    """Permute mesh axes ``ms`` to the minor end of dimension ``i`` if they are not there."""
    d = cur.dims[i]
    want = tuple(m for m in d if m not in ms) + tuple(m for m in d if m in ms)
    if want == d:
        return cur
    new, c = collective_permute(
        cur, cur.dims[:i] + (want,) + cur.dims[i + 1 :], why="bring the mesh axes to move to the minor end"
    )
    _add(moves, c)
    return new


# ---------------------------------------------------------------------------
# apply_to_layout: the layout a lowering Step leaves (the lowering runs it: lowering.steps.apply_step)


def _fail(reason: str, hint: str | None = None) -> EinshardError:
    return EinshardError(reason, hint=hint)


def apply_to_layout(lay: Layout, step: Step) -> Layout:
    """The layout of a block after ``step`` (or an EinshardError if the step does not fit it).

    Example:
        >>> from einshard.placement import Layout, MeshAxis
        >>> lay = Layout(('b', 'd'), (8, 4), (MeshAxis('data', 2),), ((), ()))
        >>> str(apply_to_layout(lay, Step('dynamic-slice', 0, ('data',), dim=0)))
        '[b:8@data d:4]'
    """
    dims = list(lay.dims)
    axes = tuple(step.mesh_axes)
    for m in axes:
        if m not in lay.mesh_sizes:
            raise _fail(f"step {step}: {m!r} is not a mesh axis (the mesh: {', '.join(map(str, lay.mesh))})")
    n = math.prod(lay.mesh_sizes[m] for m in axes)

    def check_dim(d: int | None) -> int:
        if d is None or not 0 <= d < len(dims):
            raise _fail(f"step {step}: dim {d} is not a dimension of {lay}")
        return d

    def suffix(d: int) -> None:
        if dims[d][len(dims[d]) - len(axes) :] != axes or not dims[d]:
            raise _fail(
                f"step {step}: dimension {d} ({lay.axes[d]}) of {lay} is not split over {axes} as its minor mesh axes"
            )

    def unused(d: int) -> None:
        taken = lay.sharded_mesh_axes | lay.unreduced
        clash = [m for m in axes if m in taken]
        if clash:
            raise _fail(f"step {step}: mesh axis {clash[0]!r} already splits or sums {lay}")
        shards = lay.shards(d) * n
        if lay.shape[d] % shards:
            raise _fail(f"step {step}: {lay.axes[d]} of size {lay.shape[d]} does not split into {shards} blocks")

    if step.kind == "all-gather":
        d = check_dim(step.dim)
        suffix(d)
        dims[d] = dims[d][: len(dims[d]) - len(axes)]
        return lay.with_dims(tuple(dims))
    if step.kind == "dynamic-slice":
        d = check_dim(step.dim)
        unused(d)
        dims[d] = dims[d] + axes
        return lay.with_dims(tuple(dims))
    if step.kind == "all-reduce":
        missing = [m for m in axes if m not in lay.unreduced]
        if missing:
            raise _fail(f"step {step}: {lay} holds no pending sums over {missing[0]!r}")
        return lay.with_dims(tuple(dims), lay.unreduced - set(axes))
    if step.kind == "reduce-scatter":
        d = check_dim(step.dim)
        missing = [m for m in axes if m not in lay.unreduced]
        if missing:
            raise _fail(f"step {step}: {lay} holds no pending sums over {missing[0]!r}")
        shards = lay.shards(d) * n
        if lay.shape[d] % shards:
            raise _fail(f"step {step}: {lay.axes[d]} of size {lay.shape[d]} does not split into {shards} blocks")
        dims[d] = dims[d] + axes
        return lay.with_dims(tuple(dims), lay.unreduced - set(axes))
    if step.kind == "all-to-all":
        d, t = check_dim(step.dim), check_dim(step.to_dim)
        suffix(d)
        dims[d] = dims[d][: len(dims[d]) - len(axes)]
        shards = math.prod(lay.mesh_sizes[m] for m in dims[t]) * n
        if lay.shape[t] % shards:
            raise _fail(f"step {step}: {lay.axes[t]} of size {lay.shape[t]} does not split into {shards} blocks")
        dims[t] = dims[t] + axes
        return lay.with_dims(tuple(dims))
    if step.reorder is not None:
        before, after = step.reorder
        if before != lay.dims:
            raise _fail(f"step {step}: {lay} is not split as {before}")
        return lay.with_dims(after)
    return lay  # a ring shift moves blocks between devices; the layout cannot say which
