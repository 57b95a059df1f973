"""``transition(src, dst)``: the collectives that take one layout of a tensor to another, in XLA's order.

The order (reductions, regroups, free slices, all-to-alls, gathers, permutes) and why it is XLA's is in
the module doc of :mod:`einshard.analysis.primitives`, whose collectives this composes.
"""

from __future__ import annotations

from ..core.layout import Layout
from ..errors import EinshardError
from .cost import PROFILES, Collective, Profile
from .primitives import (
    _derived,
    _name,
    _sizes,
    _trivial,
    all_gather,
    all_reduce,
    all_to_all,
    collective_permute,
    dynamic_slice,
    reduce_scatter,
    regroup,
)

__all__ = ["transition"]

_CPU = PROFILES["cpu"]


def transition(
    src: Layout,
    dst: Layout,
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    shortcuts: bool = True,
) -> tuple[Layout, tuple[Collective, ...]]:
    """The collectives that take ``src`` to ``dst`` (same tensor, same mesh), cheapest order (module doc).

    ``shortcuts=False`` takes the general steps even for the common moves (free slices, one all-reduce,
    gathers) that have a quicker path to the same answer; tests compare the two.

    Raises EinshardError if ``dst`` holds pending sums ``src`` does not (a
    complete value cannot become a pending sum by communication).

    Example:
        >>> from einshard.core.layout import Layout, MeshAxis
        >>> mesh = (MeshAxis("x", 4),)
        >>> a = Layout(("a", "b"), (16, 32), mesh, (("x",), ()))
        >>> _, steps = transition(a, a.with_dims(((), ("x",))))
        >>> [(c.kind, c.array_bytes) for c in steps]      # V11: one all-to-all of the local shard
        [('all-to-all', 512)]
    """
    if src.dims == dst.dims and src.unreduced == dst.unreduced and src.axes == dst.axes and src.shape == dst.shape:
        return src, ()  # nothing to do (the common case, kept fast)
    if (
        shortcuts
        and src.unreduced == dst.unreduced
        and src.axes == dst.axes
        and src.shape == dst.shape
        and _only_slices(src, dst)
    ):
        return dst, ()  # the next most common: free slices of a replicated operand (what step 2 alone would do)
    # Mesh axes of size 1 split nothing: x@(a,b) with |a| = 1 is x@b.  Compare without them.
    if not _trivial(src) and not _trivial(dst):  # the common mesh: no axis of size 1
        return _transition(src, dst, itemsize, profile, tensor, shortcuts)
    src_n, dst_n = _drop_trivial(src), _drop_trivial(dst)
    if src_n is not src or dst_n is not dst:
        if src_n.dims == dst_n.dims and src_n.unreduced == dst_n.unreduced:
            if src.axes != dst.axes or src.shape != dst.shape:
                raise EinshardError(f"transition between different tensors: {src} and {dst}")
            return dst, ()
        _, steps = _transition(src_n, dst_n, itemsize, profile, tensor, shortcuts)
        return dst, steps
    return _transition(src, dst, itemsize, profile, tensor, shortcuts)


def _only_slices(src: Layout, dst: Layout) -> bool:
    """Whether ``dst`` only splits ``src`` further (each dimension's mesh axes extended at the minor end by
    mesh axes ``src`` neither splits nor sums over), every split dividing its dimension: then
    :func:`_transition` would only slice, which is free.  False sends the general path the rest (and its
    errors)."""
    for sd, dd in zip(src.dims, dst.dims, strict=True):  # the cheap test first: most moves are not slices
        if dd[: len(sd)] != sd:
            return False
    sizes = _sizes(src)
    used = set(src.unreduced)
    for d in src.dims:
        used.update(d)
    for s, sd, dd in zip(src.shape, src.dims, dst.dims, strict=True):
        if dd == sd:
            continue
        if dd[: len(sd)] != sd:
            return False
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


def _drop_trivial(lay: Layout) -> Layout:
    """The layout without mesh axes of size 1 (itself if it has none)."""
    trivial = _trivial(lay)
    if not trivial:  # the common mesh: no axis of size 1
        return lay
    sizes = _sizes(lay)
    if all(sizes[m] > 1 for d in lay.dims for m in d) and all(sizes[m] > 1 for m in lay.unreduced):
        return lay
    dims = tuple(tuple(m for m in d if sizes[m] > 1) for d in lay.dims)
    return _derived(lay, dims, frozenset(m for m in lay.unreduced if sizes[m] > 1))


def _transition(
    src: Layout, dst: Layout, itemsize: int, profile: Profile, tensor: str, shortcuts: bool = True
) -> tuple[Layout, tuple[Collective, ...]]:
    if src.axes != dst.axes or src.shape != dst.shape:
        raise EinshardError(f"transition between different tensors: {src} and {dst}")
    extra = dst.unreduced - src.unreduced
    if extra:
        raise EinshardError(
            f"cannot reach {dst} from {src}: a complete value does not become a pending sum over "
            f"{', '.join(sorted(extra))} by communication"
        )
    kw = {"itemsize": itemsize, "profile": profile, "tensor": tensor}
    steps: list[Collective] = []
    cur = src
    order = _sizes(src)  # the mesh axes' names in mesh order (the keys of its sizes: no list built)
    # The two most common moves, as the general steps below would do them, without their bookkeeping:
    if shortcuts and src.dims == dst.dims:  # only sums to complete: step 1's all-reduce
        summed = src.unreduced - dst.unreduced
        # in mesh order (one mesh axis, the common sum: itself)
        rest = tuple(summed) if len(summed) < 2 else tuple([m for m in order if m in summed])
        if rest:
            cur, c = all_reduce(cur, rest, why="sum the partial results", **kw)  # type: ignore[arg-type]
            _add(steps, c)
        return cur, tuple(steps)
    leaving: dict[str, int] | None = None
    if shortcuts and src.unreduced == dst.unreduced:
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
        for i, ms in gathered.items():
            # in the dimension's order (one mesh axis, the common gather: itself; each is in cur.dims[i])
            ms_ordered = (ms[0],) if len(ms) == 1 else tuple([m for m in cur.dims[i] if m in ms])
            cur, c = all_gather(cur, ms_ordered, why=f"gather {_name(src, i)}", **kw)  # type: ignore[arg-type]
            _add(steps, c)
        return cur, tuple(steps)
    src_at = {m: i for i, d in enumerate(src.dims) for m in d}
    dst_at = {m: i for i, d in enumerate(dst.dims) for m in d}

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
        cur, c = reduce_scatter(
            cur,
            ms_ordered,
            j,
            order=final,
            why="sum the partial results and keep one block each",
            **kw,  # type: ignore[arg-type]
        )
        _add(steps, c)
    rest = tuple(m for m in pending if m not in dst_at)
    if rest:
        cur, c = all_reduce(cur, rest, why="sum the partial results", **kw)  # type: ignore[arg-type]
        _add(steps, c)

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
        cur, st = regroup(cur, j, gone, new, **kw)  # type: ignore[arg-type]
        for c in st:
            _add(steps, c)
        slice_now -= set(new)
        regrouped |= set(gone)

    # 2. Free slices, in the target's mesh-axis order within each dimension.
    for j, d in enumerate(dst.dims) if slice_now else ():
        new = tuple(m for m in d if m in slice_now)
        if new:
            cur, _ = dynamic_slice(cur, new, j)

    # 3. Mesh axes that move from one tensor axis to another: all-to-all (grouped by source and target).
    moves: dict[tuple[int, int], list[str]] = {}
    for m in order:
        if m in src_at and m in dst_at and src_at[m] != dst_at[m]:
            moves.setdefault((src_at[m], dst_at[m]), []).append(m)
    for (i, j), ms in moves.items():
        cur = _to_minor(cur, i, ms, steps, kw)
        cur, c = all_to_all(
            cur,
            tuple(ms),
            i,
            j,
            why=f"move the split from {_name(src, i)} to {_name(src, j)}",
            **kw,  # type: ignore[arg-type]
        )
        _add(steps, c)

    # 4. Gathers, grouped by the dimension they leave.
    gathers: dict[int, list[str]] = {}
    for m in order:
        if m in src_at and m not in dst_at and m not in regrouped:
            gathers.setdefault(src_at[m], []).append(m)
    for i, ms in gathers.items():
        cur = _to_minor(cur, i, ms, steps, kw)
        ms_ordered = tuple(m for m in cur.dims[i] if m in ms)
        cur, c = all_gather(cur, ms_ordered, why=f"gather {_name(src, i)}", **kw)  # type: ignore[arg-type]
        _add(steps, c)

    # 5. Same mesh axes per dimension, other order: the blocks sit on other devices.
    if cur.dims != dst.dims:
        cur, c = collective_permute(cur, dst.dims, why="reorder the mesh axes of a split", **kw)  # type: ignore[arg-type]
        _add(steps, c)
    return cur, tuple(steps)


def _add(steps: list[Collective], c: Collective) -> None:
    """Record a collective unless its groups are single devices (a mesh axis of size 1: a no-op)."""
    if c.group_size > 1:
        steps.append(c)


def _to_minor(cur: Layout, i: int, ms: list[str], steps: list[Collective], kw: dict) -> Layout:  # type: ignore[type-arg]
    """Permute mesh axes ``ms`` to the minor end of dimension ``i`` if they are not there."""
    d = cur.dims[i]
    want = tuple(m for m in d if m not in ms) + tuple(m for m in d if m in ms)
    if want == d:
        return cur
    new, c = collective_permute(
        cur, cur.dims[:i] + (want,) + cur.dims[i + 1 :], why="bring the mesh axes to move to the minor end", **kw
    )
    _add(steps, c)
    return new
