"""Layouts: how a tensor's axes are laid out over the axes of a device mesh.

A :class:`Layout` is the one internal picture of a laid-out tensor that
placement, analysis and lowering share: the tensor's axis names and sizes, the
mesh axes (names and sizes) it lives on, which mesh axes split each tensor
axis (major to minor), and over which mesh axes partial sums are still pending.

This module resolves a parsed placement expression against a mesh *shape*
(names and sizes only), so a 2048-device plan can be resolved on a laptop.
It knows nothing of devices; :mod:`einshard.placement` turns a Layout into a
``jax.sharding.NamedSharding``.

Example:
    >>> from einshard._src.core.layout import MeshAxis, resolve_named
    >>> from einshard.placement import parse_placement
    >>> mesh = (MeshAxis("data", 4), MeshAxis("model", 2))
    >>> lay = resolve_named(parse_placement("b d -> b@data d"), (8, 16), mesh)
    >>> lay.spec_entries()
    ('data', None)
    >>> lay.shard_shape
    (2, 16)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from jax.sharding import PartitionSpec

from .. import _checks
from .._caches import cached
from .._checks import describe_value
from ..errors import EinshardError
from ..parsing import AxisItem, EllipsisItem, Expression, ReplicaItem, format_name
from .logical import current_axis_rules, resolve_expression

__all__ = [
    "MeshAxis",
    "Layout",
    "resolve_named",
    "resolve_counts",
    "expand_names",
    "split_devices",
    "spec_partitions",
    "spec_dims",
    "spec_entry_axes",
]


_new = object.__new__


@dataclass(frozen=True)
class MeshAxis:
    """A named axis of a device mesh and its size."""

    name: str
    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise EinshardError(f"a mesh axis name is a non-empty string, got {self.name!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise EinshardError(f"mesh axis {self.name!r} has size {self.size!r}; sizes are positive integers")

    def __str__(self) -> str:
        return f"{self.name}={self.size}"

    @classmethod
    def _derive(cls, name: str, size: int) -> MeshAxis:
        """The trusted constructor: ``MeshAxis(name, size)`` for a name and size the caller has checked,
        validated only under ``EINSHARD_CHECKS=1`` (:data:`einshard._checks.INVARIANTS`)."""
        if _checks.INVARIANTS:
            return cls(name, size)
        new = _new(cls)
        new.__dict__.update(name=name, size=size)  # a frozen dataclass without slots: as object.__setattr__ would
        return new


@dataclass(frozen=True)
class Layout:
    """A tensor laid out on a mesh.

    Attributes:
        axes: the tensor's axis names, ``...`` expanded to ``'...0'``, ``'...1'``, ...
        shape: the tensor's global shape (one size per axis).
        mesh: the mesh axes, in mesh order.
        dims: for each tensor axis, the mesh axes that split it, major to minor.
        unreduced: mesh axes over which the values are pending partial sums.
    """

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    mesh: tuple[MeshAxis, ...]
    dims: tuple[tuple[str, ...], ...]
    unreduced: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # Validated at construction (JAX's rule for its own sharding types): an
        # inconsistent Layout can never reach placement, analysis or lowering.
        _validate(self)

    @classmethod
    def _derive(
        cls,
        axes: tuple[str, ...],
        shape: tuple[int, ...],
        mesh: tuple[MeshAxis, ...],
        dims: tuple[tuple[str, ...], ...],
        unreduced: frozenset[str] = frozenset(),
        mesh_sizes: dict[str, int] | None = None,
    ) -> Layout:
        """The ONE trusted constructor: a Layout from parts the caller derived from validated ones.

        The analyzer and ``explain`` derive thousands of short-lived layouts per call; each derivation checks
        what its step could break (a new split's divisibility, a mesh axis used twice), so re-running every
        field's validation (a third of a fresh analysis) is skipped, unless ``EINSHARD_CHECKS=1``
        (:data:`einshard._checks.INVARIANTS`, as ``jax_enable_checks``), which validates every one.
        ``mesh_sizes``: the mesh's sizes by name when the caller has them (the cached view, not recomputed).
        """
        if _checks.INVARIANTS:
            return cls(axes, shape, mesh, dims, unreduced)
        new = _new(cls)
        d = new.__dict__  # a frozen dataclass without slots: fields filled as object.__setattr__ would
        d["axes"] = axes
        d["shape"] = shape
        d["mesh"] = mesh
        d["dims"] = dims
        d["unreduced"] = unreduced
        if mesh_sizes is not None:
            d["mesh_sizes"] = mesh_sizes
        return new

    @classmethod
    def from_spec(
        cls,
        spec: Any,
        shape: tuple[int, ...],
        mesh: tuple[MeshAxis, ...],
        axes: tuple[str, ...] | None = None,
        *,
        source: str = "the spec",
        noun: str = "array",
    ) -> Layout:
        """The Layout a ``PartitionSpec`` (``unreduced=`` included) gives an array of ``shape`` on ``mesh``.

        ``axes`` names the array's axes (default ``d0``, ``d1``, ...).  A spec
        shorter than the rank leaves the trailing axes whole, as JAX does.  A spec
        that does not fit is an error in the spec's own terms, not the Layout's
        (``dims=``, ``d0``): ``source`` says where the spec came from
        (``explain(): out_specs=``) and ``noun`` what it lays out (``output``).
        """
        dims = spec_dims(spec)
        if len(dims) > len(shape):
            raise EinshardError(
                f"{source} gives {spec} ({len(dims)} entries) to an {noun} of shape {shape} (rank {len(shape)})"
            )
        dims += ((),) * (len(shape) - len(dims))
        _check_spec_dims(dims, spec, shape, {m.name: m.size for m in mesh}, source, noun)
        names = axes if axes is not None else tuple(f"d{i}" for i in range(len(shape)))
        unreduced = frozenset(getattr(spec, "unreduced", None) or ())
        return cls(tuple(names), tuple(shape), tuple(mesh), dims, unreduced)

    def to_spec(self) -> PartitionSpec:
        """The ``PartitionSpec``: pending partial sums as ``unreduced={...}`` where this JAX has it."""
        if self.unreduced and _SPEC_HAS_UNREDUCED:
            return PartitionSpec(*self.spec_entries(), unreduced=set(self.unreduced))
        return PartitionSpec(*self.spec_entries())

    # -- derived views -----------------------------------------------------
    @functools.cached_property
    def mesh_sizes(self) -> dict[str, int]:
        return {m.name: m.size for m in self.mesh}

    def shards(self, axis: int) -> int:
        """How many pieces tensor axis ``axis`` is split into."""
        return math.prod(self.mesh_sizes[m] for m in self.dims[axis])

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of the block each device holds."""
        return tuple(size // self.shards(i) for i, size in enumerate(self.shape))

    @property
    def sharded_mesh_axes(self) -> frozenset[str]:
        return frozenset(m for d in self.dims for m in d)

    @property
    def replicated_mesh_axes(self) -> tuple[str, ...]:
        """Mesh axes that split nothing and hold no pending sums: the tensor is copied over them."""
        used = self.sharded_mesh_axes | self.unreduced
        return tuple(m.name for m in self.mesh if m.name not in used)

    def spec_entries(self) -> tuple[str | tuple[str, ...] | None, ...]:
        """The PartitionSpec entries: None, one mesh axis name, or a tuple of them."""
        return tuple(None if not d else d[0] if len(d) == 1 else d for d in self.dims)

    def bytes_per_device(self, itemsize: int) -> int:
        return math.prod(self.shard_shape) * itemsize

    def axis_index(self, name: str) -> int:
        return self.axes.index(name)

    def with_dims(self, dims: tuple[tuple[str, ...], ...], unreduced: frozenset[str] | None = None) -> Layout:
        return Layout(self.axes, self.shape, self.mesh, dims, self.unreduced if unreduced is None else unreduced)

    def __str__(self) -> str:
        """JAX's type notation in the tensor's axis names: ``b:8@data d:16 {U:model}``."""
        parts = []
        for name, size, d in zip(self.axes, self.shape, self.dims):
            text = f"{_display(name)}:{size}"
            if d:
                text += "@" + (d[0] if len(d) == 1 else "(" + ",".join(d) + ")")
            parts.append(text)
        text = " ".join(parts)
        if self.unreduced:
            text += " {U:" + ",".join(m.name for m in self.mesh if m.name in self.unreduced) + "}"
        return "[" + text + "]"


def spec_entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry, major to minor: None -> (), 'x' -> ('x',), ('x', 'y') as is."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _check_spec_dims(
    dims: tuple[tuple[str, ...], ...],
    spec: Any,
    shape: tuple[int, ...],
    sizes: dict[str, int],
    source: str,
    noun: str,
) -> None:
    """A PartitionSpec's mesh axes exist, split no array twice over one mesh axis, and divide their dimensions."""
    used: list[str] = []
    for axes, n in zip(dims, shape):
        missing = [m for m in axes if m not in sizes]
        if missing:
            raise EinshardError(f"{source} names mesh axis {missing[0]!r}, not in the mesh {sizes}")
        twice = [m for m in axes if m in used or axes.count(m) > 1]
        if twice:
            raise EinshardError(f"{source} splits one {noun} over mesh axis {twice[0]!r} twice ({spec})")
        used.extend(axes)
        ways = math.prod(sizes[m] for m in axes)
        if n % ways:
            raise EinshardError(
                f"{source} splits an {noun} dimension of size {n} (shape {shape}) over {axes} ({ways} ways): it "
                "does not divide"
            )


def spec_dims(spec: Any, rank: int | None = None) -> tuple[tuple[str, ...], ...]:
    """Each array axis's mesh axes in a PartitionSpec (the one spec -> dims reading; JAX's rules, no checks).

    With ``rank``, a shorter spec is padded with whole axes (as JAX reads it) and a longer one cut to ``rank``;
    unlike :meth:`Layout.from_spec` nothing is validated, so it reads any sharding JAX built (uneven ones too).
    """
    dims = tuple(spec_entry_axes(e) for e in spec_partitions(spec))
    if rank is None:
        return dims
    return dims[:rank] + ((),) * (rank - len(dims))


def spec_partitions(spec: Any) -> tuple[Any, ...]:
    """A PartitionSpec's entries (``tuple(spec)`` refuses specs with ``unreduced`` axes on some JAX releases)."""
    parts = getattr(spec, "partitions", None)
    return tuple(parts) if parts is not None else tuple(spec)


def _spec_has_unreduced() -> bool:
    try:
        PartitionSpec(None, unreduced={"x"})
    except TypeError:
        return False
    return True


_SPEC_HAS_UNREDUCED = _spec_has_unreduced()


def _check_fields(lay: Layout) -> None:
    """Each field's type: a str where a tuple of names belongs would be read as one name per character."""
    fields = (
        ("axes", lay.axes, lambda a: isinstance(a, str) and bool(a), "a tuple of axis names"),
        ("shape", lay.shape, lambda s: isinstance(s, int) and not isinstance(s, bool), "a tuple of integer sizes"),
        ("mesh", lay.mesh, lambda m: isinstance(m, MeshAxis), "a tuple of MeshAxis"),
        (
            "dims",
            lay.dims,
            lambda d: isinstance(d, tuple) and all(isinstance(m, str) for m in d),
            "a tuple of tuples of mesh axis names (one per axis)",
        ),
    )
    for name, value, ok, wants in fields:
        if not isinstance(value, tuple) or not all(map(ok, value)):
            raise EinshardError(f"Layout: {name}= takes {wants}, got {describe_value(value)}")
    if not isinstance(lay.unreduced, frozenset) or not all(isinstance(m, str) for m in lay.unreduced):
        raise EinshardError(
            f"Layout: unreduced= takes a frozenset of mesh axis names, got {describe_value(lay.unreduced)}"
        )
    if len(set(lay.axes)) != len(lay.axes):
        raise EinshardError(f"Layout: axes= names an axis twice: {lay.axes}")


def _validate(lay: Layout) -> None:
    _check_fields(lay)
    where = f"layout {lay.axes} of shape {lay.shape}"
    if not (len(lay.axes) == len(lay.shape) == len(lay.dims)):
        raise EinshardError(
            f"{where}: {len(lay.axes)} axis names, {len(lay.shape)} sizes and {len(lay.dims)} splits; one of each per axis"
        )
    sizes: dict[str, int] = {}
    for axis in lay.mesh:
        if axis.name in sizes:
            raise EinshardError(f"{where}: the mesh names axis {axis.name!r} twice")
        sizes[axis.name] = axis.size
    seen: set[str] = set()
    for name, size, d in zip(lay.axes, lay.shape, lay.dims, strict=True):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise EinshardError(f"{where}: axis {name!r} has size {size!r}; sizes are non-negative integers")
        shards = 1
        for m in d:
            if m not in sizes:
                known = ", ".join(f"{k!r}: {v}" for k, v in sizes.items()) or "none"
                raise EinshardError(
                    f"{where}: dims= splits axis {name!r} over {m!r}, which is not a mesh axis ({known})"
                )
            if m in seen:
                raise EinshardError(f"{where}: dims= splits two axes (or one twice) over mesh axis {m!r}")
            seen.add(m)
            shards *= sizes[m]
        if size % shards:
            raise EinshardError(
                f"{where}: axis {name!r} has size {size}, which does not split over "
                + "·".join(f"{m}({sizes[m]})" for m in d)
                + f" into {shards} equal shards"
            )
    for m in lay.unreduced:
        if m not in sizes:
            raise EinshardError(f"{where}: unreduced= has pending sums over {m!r}, which is not a mesh axis")
        if m in seen:
            raise EinshardError(
                f"{where}: mesh axis {m!r} both splits an axis (dims=) and holds pending sums (unreduced=)"
            )


def _display(name: str) -> str:
    return name if not name.startswith("...") else "…" + name[3:]


# ---------------------------------------------------------------------------
# Expanding '...'


def expand_names(expr: Expression, ndim: int) -> tuple[str, ...]:
    """The array's axis names, with the left side's ``...`` expanded for an array of rank ``ndim``."""
    left = expr.inputs[0]
    named = len(left.axes)
    if left.has_ellipsis:
        if ndim < named:
            raise expr.fail(
                f"the left side names {named} axes besides '...', but the array has rank {ndim}",
                left.column,
            )
    elif ndim != named:
        raise expr.fail(
            f"the left side names {named} axes but the array has rank {ndim}",
            left.column,
            "Name every axis, or use '...' for the ones you do not shard: 'b ... -> b@data ...'.",
        )
    names: list[str] = []
    for item in left.items:
        if isinstance(item, EllipsisItem):
            names.extend(f"...{i}" for i in range(ndim - named))
        else:
            assert isinstance(item, AxisItem)
            names.append(item.name)
    return tuple(names)


def _right_items(expr: Expression, names: tuple[str, ...]) -> list[AxisItem | ReplicaItem]:
    """Right-side items with '...' expanded into bare axes."""
    elided = [n for n in names if n.startswith("...")]
    out: list[AxisItem | ReplicaItem] = []
    for item in expr.output.items:
        if isinstance(item, EllipsisItem):
            out.extend(AxisItem(n, column=item.column) for n in elided)
        else:
            out.append(item)
    return out


def _describe_axis(name: str) -> str:
    return f"axis {format_name(name)!r}" if not name.startswith("...") else f"axis {int(name[3:]) + 1} of '...'"


def _indivisible(expr: Expression, item: AxisItem, size: int, shards: int, how: str) -> EinshardError:
    padded = -(-size // shards) * shards
    return expr.fail(
        f"{_describe_axis(item.name)} has size {size}, which {how} into {shards} equal shards",
        item.column,
        f"Pad the axis to {padded} (a multiple of {shards}), or shard it fewer ways.",
    )


# ---------------------------------------------------------------------------
# Named mesh axes: 'b d -> b@data d'


def resolve_named(expr: Expression, shape: tuple[int, ...], mesh: tuple[MeshAxis, ...]) -> Layout:
    """Resolve a placement that names mesh axes (or shards nothing) against a mesh shape.

    Logical axis names after ``@`` are resolved first, through the current axis rules
    (:mod:`einshard.core.logical`, the one place that reads them).
    """
    rules = current_axis_rules()
    if rules is not None:  # (the hot path without rules reads one context variable)
        expr = resolve_expression(expr, [m.name for m in mesh], rules)
    names = expand_names(expr, len(shape))
    sizes = {m.name: m.size for m in mesh}
    described = "(" + ", ".join(f"{m.name!r}: {m.size}" for m in mesh) + ")"
    dims: dict[str, tuple[str, ...]] = {}
    for item in _right_items(expr, names):
        assert isinstance(item, AxisItem), "parse_placement rejects counts mixed with '@'"
        axes = item.mesh_axes or ()
        for m in axes:
            if m not in sizes:
                raise expr.fail(
                    f"mesh axis {m!r} is not an axis of the mesh {described}",
                    item.column,
                    _did_you_mean(m, list(sizes)),
                )
        dims[item.name] = axes
    for i, name in enumerate(names):
        n = math.prod(sizes[m] for m in dims[name])
        if shape[i] % n:
            item = next(it for it in _right_items(expr, names) if isinstance(it, AxisItem) and it.name == name)
            over = "@" + "·".join(f"{m}({sizes[m]})" for m in dims[name])
            raise _indivisible(expr, item, shape[i], n, f"does not split over {over}")
    return Layout(names, tuple(shape), tuple(mesh), tuple(dims[n] for n in names))


def _did_you_mean(word: str, options: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, options, n=1)
    known = "The mesh axes are: " + ", ".join(repr(o) for o in options) + "."
    return (f"Did you mean {close[0]!r}? " if close else "") + known


# ---------------------------------------------------------------------------
# einshard 0.2 counts: 'a b -> 2 a2* b*'


def resolve_counts(expr: Expression, shape: tuple[int, ...], n_devices: int) -> Layout:
    """Resolve an einshard-0.2 count expression over ``n_devices`` devices.

    Each right-side element is one mesh axis, in order, as in einshard 0.2.
    Mesh axes of size 1 are dropped and the rest are named ``a0``, ``a1``, ...
    in order, so equal layouts land on equal (cached) meshes.  Devices left
    over by the counts replicate the array (a trailing replication axis);
    starred elements share the devices left over in proportion to their
    weights, split by :func:`split_devices`.
    """
    names = expand_names(expr, len(shape))
    items = _right_items(expr, names)
    size_of = dict(zip(names, shape))
    fixed = math.prod(i.count or 1 for i in items if not i.star)
    starred = [i for i in items if i.star]
    if fixed > n_devices or n_devices % fixed:
        first = next((i for i in items if not i.star and (i.count or 1) > 1), None)
        verb = "more devices than the" if fixed > n_devices else "a number of devices that does not divide the"
        raise expr.fail(
            f"the counts ask for {fixed} devices, {verb} {n_devices} there are",
            first.column if first else None,
            f"Use counts whose product divides {n_devices}, or '*' to take what is left.",
        )
    left = n_devices // fixed
    counts = [i.count or 1 for i in items]
    if starred:
        weights = [i.count or 1 for i in starred]
        dims = [size_of[i.name] if isinstance(i, AxisItem) else None for i in starred]
        try:
            shares = split_devices(left, weights, dims)
        except ValueError as err:
            raise expr.fail(
                str(err), starred[0].column, "See 'Splitting devices between stars' in docs/syntax.md."
            ) from None
        it = iter(shares)
        counts = [next(it) if i.star else c for i, c in zip(items, counts)]
    elif left > 1:
        counts.append(left)  # leftover devices replicate, as if a standalone count closed the expression
    mesh_axes: list[MeshAxis] = []
    dims_of: dict[str, tuple[str, ...]] = {n: () for n in names}
    for item, count in zip([*items, None], counts):
        if count == 1:
            continue
        axis = MeshAxis(f"a{len(mesh_axes)}", count)
        mesh_axes.append(axis)
        if isinstance(item, AxisItem):
            if size_of[item.name] % count:
                raise _indivisible(expr, item, size_of[item.name], count, "does not split")
            dims_of[item.name] = (axis.name,)
    if not mesh_axes:
        mesh_axes.append(MeshAxis("a0", 1))
    return Layout(names, tuple(shape), tuple(mesh_axes), tuple(dims_of[n] for n in names))


def split_devices(total: int, weights: list[int], sizes: list[int | None]) -> list[int]:
    """Split ``total`` devices between starred elements in proportion to ``weights``.

    Element i gets ``weights[i] * f[i]`` devices with ``prod(f) == total / prod(weights)``.
    Among all such integer splits whose counts divide the element's axis size
    (``None``: a standalone star, any count fits), the most even one is chosen:
    the smallest ratio between the largest and smallest ``f``; ties go to the
    split that gives more to the elements further left.  When an exact root
    exists (einshard 0.2's only case) it is the most even split, so 0.2's
    answers are kept.

    The search is polynomial in the number of stars (see :func:`_most_even`), so
    hundreds of starred elements resolve in milliseconds.

    Example:
        >>> split_devices(8, [1, 1], [4, 8])     # sqrt(8) is no integer: 4 x 2
        [4, 2]
        >>> split_devices(8, [2, 1], [8, 8])     # a2* b*: 2 x (2:1) share
        [4, 2]
    """
    base = math.prod(weights)
    if total % base:
        raise ValueError(
            f"the starred elements ask for shares in the ratio {':'.join(map(str, weights))}, "
            f"which {total} leftover devices cannot give (not a multiple of {base})"
        )
    rest = total // base
    # The factors element i may take: divisors of `rest` whose count w*f divides its axis.
    allowed = tuple(tuple(d for d in _divisors(rest) if s is None or s % (w * d) == 0) for w, s in zip(weights, sizes))
    best = _most_even(rest, allowed)
    if best is None:
        axes = ", ".join(f"size {s}" for s in sizes if s is not None)
        raise ValueError(
            f"no split of {total} devices in the ratio {':'.join(map(str, weights))} divides the starred axes ({axes})"
        )
    return [w * x for w, x in zip(weights, best)]


def _most_even(rest: int, allowed: tuple[tuple[int, ...], ...]) -> tuple[int, ...] | None:
    """The factors ``f`` (``f[i]`` from ``allowed[i]``, ``prod(f) == rest``) with the smallest max/min, then the
    lexicographically largest; None if there are none.

    The old search listed every ordered factorization, exponential in the number of stars.  Here, for each
    candidate smallest factor ``lo`` (a divisor of ``rest``), a binary search finds the smallest largest factor
    ``hi`` for which a split inside ``[lo, hi]`` exists, each test a memoized walk over (element, product still
    needed): at most ``len(allowed) * d(rest)`` states.  The best ratio ``hi/lo`` is then filled in greedily from
    the left, largest factor first, which gives the lexicographically largest split of that ratio.
    """
    divisors = _divisors(rest)
    best: tuple[Fraction, tuple[int, ...]] | None = None
    for lo in divisors:
        if lo ** len(allowed) > rest:
            break  # every factor >= lo: the product would exceed rest
        his = [d for d in divisors if d >= lo]
        if not _fits(rest, allowed, lo, his[-1]):
            continue
        low, high = 0, len(his) - 1  # the smallest feasible hi: feasibility grows with hi
        while low < high:
            mid = (low + high) // 2
            if _fits(rest, allowed, lo, his[mid]):
                high = mid
            else:
                low = mid + 1
        ratio = Fraction(his[low], lo)
        if best is not None and ratio > best[0]:
            continue
        split = _greedy(rest, allowed, lo, his[low])
        if best is None or ratio < best[0] or split > best[1]:
            best = (ratio, split)
    return best[1] if best is not None else None


def _fits(rest: int, allowed: tuple[tuple[int, ...], ...], lo: int, hi: int) -> bool:
    return _completions(allowed, lo, hi)(0, rest)


def _greedy(rest: int, allowed: tuple[tuple[int, ...], ...], lo: int, hi: int) -> tuple[int, ...]:
    can = _completions(allowed, lo, hi)
    out: list[int] = []
    need = rest
    for i, options in enumerate(allowed):
        f = next(d for d in reversed(options) if lo <= d <= hi and need % d == 0 and can(i + 1, need // d))
        out.append(f)
        need //= f
    return tuple(out)


def _completions(allowed: tuple[tuple[int, ...], ...], lo: int, hi: int) -> Callable[[int, int], bool]:
    """``can(i, need)``: elements ``i..`` can take factors in ``[lo, hi]`` multiplying to ``need``."""
    n = len(allowed)

    @functools.cache
    def can(i: int, need: int) -> bool:
        if i == n:
            return need == 1
        left = n - i
        if need < lo**left or need > hi**left:
            return False
        return any(lo <= d <= hi and need % d == 0 and can(i + 1, need // d) for d in allowed[i])

    return can


@cached(maxsize=None)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))
