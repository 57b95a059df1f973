"""Collectives as pure functions on :class:`~einshard.core.layout.Layout`, and ``transition`` between layouts.

Each primitive takes a layout and returns the new layout with the
:class:`Collective` it costs (``None`` for a dynamic-slice, which is free):

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
XLA's reshard rule set (theory.md: "slices are free; one AG'd dim gives an
AG; one AG'd dim plus one sliced dim gives an AllToAll").  Gathering a mesh
axis that is not the minor-most one of its dimension first permutes it
there, which is what XLA emits (``[a@(x,y)] → [a@y]`` compiles to a
collective-permute then an all-gather over x), and a dimension re-split from
one group of mesh axes to another whose size divides or is divided by it is
permuted, then gathered by the remaining factor (:func:`regroup`), as XLA does.

Example:
    >>> from einshard.core.layout import Layout, MeshAxis
    >>> mesh = (MeshAxis("data", 4),)
    >>> a = Layout(("b", "d"), (64, 32), mesh, (("data",), ()))
    >>> b, c = all_gather(a, ("data",), itemsize=4)
    >>> b.dims, c.kind, c.bytes, c.array_bytes
    (((), ()), 'all-gather', 6144, 8192)
"""

from __future__ import annotations

import math

from ..core.collectives import CollectiveKind
from ..core.layout import Layout, MeshAxis
from ..errors import EinshardError
from .cost import PROFILES, Collective, Profile

__all__ = [
    "all_gather",
    "dynamic_slice",
    "all_reduce",
    "reduce_scatter",
    "all_to_all",
    "collective_permute",
    "regroup",
    "transition",
]

_CPU = PROFILES["cpu"]
_new = object.__new__


_SIZES: dict[int, tuple[tuple[MeshAxis, ...], dict[str, int], frozenset[str]]] = {}


_LAST: list[tuple[tuple[MeshAxis, ...], dict[str, int], frozenset[str]]] = [((), {}, frozenset())]


def _mesh_facts(mesh: tuple[MeshAxis, ...]) -> tuple[tuple[MeshAxis, ...], dict[str, int], frozenset[str]]:
    # Not Layout.mesh_sizes: a cached_property takes a lock on first use (Python 3.11), and the
    # analyzer makes many short-lived layouts that share one mesh tuple; keyed by its identity
    # (the tuple is kept alive in the entry, so the id cannot be reused while cached).
    last = _LAST[0]
    if last[0] is mesh:  # the mesh of the layouts just asked about (one analysis asks about one mesh)
        return last
    hit = _SIZES.get(id(mesh))
    if hit is not None and hit[0] is mesh:
        _LAST[0] = hit
        return hit
    if len(_SIZES) > 512:
        _SIZES.clear()
    sizes = {m.name: m.size for m in mesh}
    facts = (mesh, sizes, frozenset([m for m, s in sizes.items() if s == 1]))
    _SIZES[id(mesh)] = facts
    _LAST[0] = facts
    return facts


def _remember_mesh(mesh: tuple[MeshAxis, ...], sizes: dict[str, int], trivial: frozenset[str]) -> None:
    """What :func:`_mesh_facts` would build for ``mesh``, from a caller that has it (analyze's entry reads
    the sizes from its dict mesh): ``sizes`` its axis sizes by name in mesh order, ``trivial`` those of size 1."""
    if len(_SIZES) > 512:
        _SIZES.clear()
    facts = (mesh, sizes, trivial)
    _SIZES[id(mesh)] = facts
    _LAST[0] = facts


def _sizes(lay: Layout) -> dict[str, int]:
    """The mesh's axis sizes by name."""
    last = _LAST[0]
    if last[0] is lay.mesh:  # (_mesh_facts's first test, without its call: this runs for every record)
        return last[1]
    return _mesh_facts(lay.mesh)[1]


def _trivial(lay: Layout) -> frozenset[str]:
    """The mesh axes of size 1 (they split nothing)."""
    return _mesh_facts(lay.mesh)[2]


def _derived(lay: Layout, dims: tuple[tuple[str, ...], ...], unreduced: frozenset[str] | None = None) -> Layout:
    """``lay.with_dims(dims, unreduced)`` without re-running Layout's validation.

    The analyzer derives thousands of short-lived layouts per einsum from validated ones; each
    primitive checks what its step could break (divisibility of a new split, a mesh axis used
    twice), so re-validating every field (a third of a fresh analysis) is skipped here.
    """
    return _unchecked(lay.axes, lay.shape, lay.mesh, dims, lay.unreduced if unreduced is None else unreduced)


def _unchecked(
    axes: tuple[str, ...],
    shape: tuple[int, ...],
    mesh: tuple[MeshAxis, ...],
    dims: tuple[tuple[str, ...], ...],
    unreduced: frozenset[str],
) -> Layout:
    """A :class:`Layout` the analyzer derived from validated ones (the caller knows it is valid)."""
    new = _new(Layout)
    d = new.__dict__  # a frozen dataclass without slots: fill its fields directly, as object.__setattr__ would
    d["axes"] = axes
    d["shape"] = shape
    d["mesh"] = mesh
    d["dims"] = dims
    d["unreduced"] = unreduced
    return new


def _shards(lay: Layout, i: int) -> int:
    sizes = _sizes(lay)
    n = 1
    for m in lay.dims[i]:
        n *= sizes[m]
    return n


def _group(lay: Layout, axes: tuple[str, ...]) -> int:
    sizes = _sizes(lay)
    n = 1
    for a in axes:
        n *= sizes[a]
    return n


def _local_bytes(lay: Layout, itemsize: int) -> int:
    """``lay.bytes_per_device(itemsize)``, written out: this is the analyzer's innermost loop."""
    sizes = _sizes(lay)
    n = itemsize
    for s, d in zip(lay.shape, lay.dims, strict=False):
        k = 1
        for m in d:
            k *= sizes[m]
        n *= s // k
    return n


def _record(
    kind: CollectiveKind,
    axes: tuple[str, ...],
    n: int,
    sent: float,
    array_bytes: int,
    before: Layout,
    after: Layout,
    profile: Profile,
    tensor: str,
    why: str,
    dim: int | None = None,
    to_dim: int | None = None,
) -> Collective:
    sent_i = int(round(sent))
    per_axis = tuple(map(_sizes(before).__getitem__, axes))
    if math.prod(per_axis) != n:  # a regrouped gather runs over a factor of its axes: one ring of n
        per_axis = (n,)
    # Collective(...) with its fields filled directly (a frozen dataclass without slots, no validation of
    # its own): the analyzer records one per priced move, and the generated __init__ is most of that cost.
    new = object.__new__(Collective)
    new.__dict__.update(
        kind=kind,
        axes=axes,
        group_size=n,
        bytes=sent_i,
        array_bytes=array_bytes,
        time=profile.collective_time(kind, n, sent_i, array_bytes, per_axis),
        tensor=tensor,
        why=why,
        before=before,
        after=after,
        operand=None,
        dim=dim,
        to_dim=to_dim,
    )
    return new


def _where(lay: Layout, mesh_axis: str) -> int | None:
    for i, d in enumerate(lay.dims):
        if mesh_axis in d:
            return i
    return None


def _check_axes(lay: Layout, axes: tuple[str, ...]) -> None:
    sizes = _sizes(lay)
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


def all_gather(
    lay: Layout, axes: tuple[str, ...], *, itemsize: int = 4, profile: Profile = _CPU, tensor: str = "", why: str = ""
) -> tuple[Layout, Collective]:
    """Gather mesh axes ``axes`` (which all split one tensor axis, as its minor-most axes) out of ``lay``."""
    sizes = _sizes(lay)
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
    assert i is not None
    d = lay.dims[i]
    if d[len(d) - len(axes) :] != tuple(axes):
        raise EinshardError(
            f"all-gather over {axes}: they are not the minor-most mesh axes of {lay.axes[i]!r} in {lay}"
        )
    after = _derived(lay, lay.dims[:i] + (d[: len(d) - len(axes)],) + lay.dims[i + 1 :])
    n = math.prod(map(sizes.__getitem__, axes))  # _group(lay, axes)
    v = _local_bytes(after, itemsize)
    return after, _record("all-gather", tuple(axes), n, (n - 1) / n * v, v, lay, after, profile, tensor, why, i)


def dynamic_slice(lay: Layout, axes: tuple[str, ...], axis: str | int) -> tuple[Layout, None]:
    """Split tensor axis ``axis`` further over mesh axes ``axes`` (minor-most), which the tensor is replicated over.

    Free: each device keeps its own block.
    """
    _check_axes(lay, axes)
    i = _dim_index(lay, axis)
    for a in axes:
        if _where(lay, a) is not None or a in lay.unreduced:
            raise EinshardError(f"dynamic-slice over {a!r}: {lay} is not replicated over it")
    after = _derived(lay, lay.dims[:i] + (lay.dims[i] + tuple(axes),) + lay.dims[i + 1 :])
    if lay.shape[i] % _shards(after, i):
        raise EinshardError(
            f"axis {lay.axes[i]!r} has size {lay.shape[i]}, which does not split into {_shards(after, i)} shards"
        )
    return after, None


def all_reduce(
    lay: Layout, axes: tuple[str, ...], *, itemsize: int = 4, profile: Profile = _CPU, tensor: str = "", why: str = ""
) -> tuple[Layout, Collective]:
    """Sum the pending partial sums over mesh axes ``axes``: ``{U:a} → complete``."""
    sizes = _sizes(lay)
    for a in axes:
        if a not in sizes:
            _check_axes(lay, axes)  # raises, naming the mesh
    if not lay.unreduced.issuperset(axes):
        raise EinshardError(f"all-reduce over {axes}: {lay} holds no pending sums over them")
    after = _derived(lay, lay.dims, lay.unreduced.difference(axes))
    n = math.prod(map(sizes.__getitem__, axes))  # _group(lay, axes)
    v = _local_bytes(lay, itemsize)
    return after, _record("all-reduce", tuple(axes), n, 2 * (n - 1) / n * v, v, lay, after, profile, tensor, why)


def reduce_scatter(
    lay: Layout,
    axes: tuple[str, ...],
    axis: str | int,
    *,
    order: tuple[str, ...] | None = None,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    why: str = "",
) -> tuple[Layout, Collective]:
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
    after = _derived(lay, lay.dims[:i] + (new,) + lay.dims[i + 1 :], lay.unreduced - set(axes))
    if lay.shape[i] % _shards(after, i):
        raise EinshardError(
            f"axis {lay.axes[i]!r} has size {lay.shape[i]}, which does not split into {_shards(after, i)} shards"
        )
    n = _group(lay, axes)
    v = _local_bytes(lay, itemsize)
    return after, _record("reduce-scatter", tuple(axes), n, (n - 1) / n * v, v, lay, after, profile, tensor, why, i)


def all_to_all(
    lay: Layout,
    axes: tuple[str, ...],
    src: str | int,
    dst: str | int,
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    why: str = "",
) -> tuple[Layout, Collective]:
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
    after = _derived(lay, tuple(dims))
    if lay.shape[j] % _shards(after, j):
        raise EinshardError(
            f"axis {lay.axes[j]!r} has size {lay.shape[j]}, which does not split into {_shards(after, j)} shards"
        )
    n = _group(lay, axes)
    s = _local_bytes(lay, itemsize)
    return after, _record("all-to-all", tuple(axes), n, (n - 1) / n * s, s, lay, after, profile, tensor, why, i, j)


def collective_permute(
    lay: Layout,
    dims: tuple[tuple[str, ...], ...],
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
    why: str = "",
) -> tuple[Layout, Collective]:
    """Give each tensor axis the same mesh axes in another order: the blocks move to other devices."""
    if len(dims) != len(lay.dims) or any(set(a) != set(b) for a, b in zip(dims, lay.dims, strict=False)):
        raise EinshardError(f"collective-permute changes only the order of mesh axes within an axis of {lay}")
    moved = tuple(m for a, b in zip(dims, lay.dims, strict=False) if a != b for m in b)
    after = _derived(lay, tuple(dims))
    s = _local_bytes(lay, itemsize)
    n = _group(lay, moved) if moved else 1
    return after, _record("collective-permute", moved, n, s if moved else 0, s, lay, after, profile, tensor, why)


def regroup(
    lay: Layout,
    axis: str | int,
    gone: tuple[str, ...],
    new: tuple[str, ...],
    *,
    itemsize: int = 4,
    profile: Profile = _CPU,
    tensor: str = "",
) -> tuple[Layout, tuple[Collective, ...]]:
    """Re-split tensor axis ``axis`` from its minor-most mesh axes ``gone`` to ``new`` (replicated ones).

    When the new split refines the old one or the old one refines the new
    (the group sizes divide), XLA does not gather: it sends each device a
    block of the new split with a collective-permute, and, if the new split
    is coarser by a factor f, all-gathers over groups of f.  Otherwise the
    old axes are gathered and the new ones sliced.

    Example:
        >>> from einshard.core.layout import Layout, MeshAxis
        >>> a = Layout(("c",), (16,), (MeshAxis("x", 4), MeshAxis("y", 2)), (("x",),))
        >>> b, steps = regroup(a, "c", ("x",), ("y",))
        >>> b.dims, [(s.kind, s.group_size, s.array_bytes) for s in steps]
        ((('y',),), [('collective-permute', 4, 16), ('all-gather', 2, 32)])
    """
    i = _dim_index(lay, axis)
    sizes = _sizes(lay)
    p = math.prod(sizes[m] for m in gone)
    q = math.prod(sizes[m] for m in new)
    d = lay.dims[i]
    keep = d[: len(d) - len(gone)]
    kw = {"itemsize": itemsize, "profile": profile, "tensor": tensor}
    after = _derived(lay, lay.dims[:i] + (keep + tuple(new),) + lay.dims[i + 1 :])
    if lay.shape[i] % _shards(after, i):
        raise EinshardError(f"axis {lay.axes[i]!r} does not split over {new}")
    why = f"re-split {_name(lay, i)} from {','.join(gone)} to {','.join(new)}"
    if p % q == 0:
        f = p // q
        s = _local_bytes(lay, itemsize)
        mid = _derived(lay, lay.dims[:i] + (keep + tuple(new),) + lay.dims[i + 1 :])
        steps = [_record("collective-permute", gone + new, p, s, s, lay, mid, profile, tensor, why)]
        if f > 1:
            v = _local_bytes(after, itemsize)
            steps.append(_record("all-gather", gone, f, (f - 1) / f * v, v, mid, after, profile, tensor, why, i))
        return after, tuple(steps)
    if q % p == 0:
        s = _local_bytes(after, itemsize)
        return after, (_record("collective-permute", gone + new, q, s, s, lay, after, profile, tensor, why),)
    cur, c = all_gather(lay, gone, why=why, **kw)  # type: ignore[arg-type]
    cur, _ = dynamic_slice(cur, new, i)
    return cur, (c,)


def _name(lay: Layout, i: int) -> str:
    return repr(lay.axes[i])


# ``transition`` composes the primitives above; it lives in its own module and is re-exported here.
from .transition import transition  # noqa: E402
