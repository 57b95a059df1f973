"""Hypothesis strategies for meshes, placement expressions, pytree layouts and annotated einsums.

Every strategy is drawn so that hypothesis's shrinking (smaller integers,
earlier ``sampled_from`` choices, identity permutations) walks toward the
simplest layout: each mesh axis is drawn as "which array axis does it split",
with *no axis* first, so a failing example shrinks to the fewest mesh axes in
use, and then to the first mesh axis on the first array axis.

Example:
    >>> import jax
    >>> from hypothesis import find
    >>> from einshard.testing import expressions
    >>> mesh = jax.make_mesh((4, 2), ('data', 'model'))
    >>> find(expressions((8, 6), mesh), lambda e: '@' in e)   # the simplest sharded layout
    'a b -> a@data b'
"""

from __future__ import annotations

import functools
import math
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from .. import _checks
from ..core.mesh import MeshLike
from ..errors import EinshardError
from ..tree_rules import UNMATCHED, leaf_expressions

try:
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "einshard.testing's strategies need hypothesis: pip install 'einshard[testing]' (or pip install hypothesis)"
    ) from None

__all__ = ["meshes", "expressions", "layouts", "einsums", "EinsumCase", "array_names"]

AxisKind = Literal["explicit", "auto"]
_KINDS: dict[str, AxisType] = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}
_NAMES = tuple(string.ascii_lowercase)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def array_names(rank: int) -> tuple[str, ...]:
    """The axis names expressions give an array of ``rank`` dimensions: ``a b c ...``."""
    if rank > len(_NAMES):
        raise EinshardError(f"expressions() names at most {len(_NAMES)} array axes, got rank {rank}")
    return _NAMES[:rank]


# ---------------------------------------------------------------------------
# Meshes


@functools.lru_cache(maxsize=256)
def _make_mesh(shape: tuple[int, ...], names: tuple[str, ...], kinds: tuple[AxisType, ...], devices: tuple) -> Any:
    # One Mesh object per (shape, names, types, devices): jit caches then hit across examples.
    return jax.make_mesh(shape, names, axis_types=kinds, devices=list(devices))


def meshes(
    devices: Sequence[Any] | None = None,
    *,
    max_axes: int = 3,
    axis_names: Sequence[str] = ("data", "model", "fsdp"),
    axis_types: Sequence[AxisKind] = ("explicit", "auto"),
) -> st.SearchStrategy[Any]:
    """Meshes over ``devices`` (default all): factorisations of their count into 1 to ``max_axes`` named axes.

    Each axis's type is drawn from ``axis_types`` (``'explicit'``, as ``jax.make_mesh`` makes by
    default, first: it is what examples shrink to); sizes of 1 are included, since users' meshes
    have them.  Shrinks toward one axis over every device.
    """
    devs = tuple(jax.devices() if devices is None else devices)
    if not devs:
        raise EinshardError("meshes(devices=...) needs at least one device")
    names = tuple(axis_names)
    if not 1 <= max_axes <= len(names):
        raise EinshardError(f"meshes(max_axes={max_axes}) needs 1 <= max_axes <= len(axis_names) = {len(names)}")
    kinds = [_KINDS[k] for k in _check_kinds(axis_types)]

    @st.composite
    def draw_mesh(draw: Any) -> Any:
        k = draw(st.integers(1, max_axes))
        left, shape = len(devs), []
        for _ in range(k - 1):
            # The last axis takes what is left, so shrinking the others toward 1 gives (1, ..., n):
            # a mesh whose only real axis is the last. Drawing "what the last axis leaves" keeps (n,) simplest.
            size = draw(st.sampled_from(_divisors(left)))
            shape.append(size)
            left //= size
        shape.append(left)
        shape = shape[::-1]
        types = tuple(draw(st.sampled_from(kinds)) for _ in range(k))
        return _make_mesh(tuple(shape), names[:k], types, devs)

    return draw_mesh()


def _check_kinds(axis_types: Sequence[str]) -> tuple[str, ...]:
    bad = [k for k in axis_types if k not in _KINDS]
    if bad or not axis_types:
        raise EinshardError(f"axis_types takes a non-empty selection of {sorted(_KINDS)}, got {list(axis_types)}")
    return tuple(axis_types)


# ---------------------------------------------------------------------------
# Expressions


def _mesh_sizes(mesh: MeshLike | None) -> dict[str, int] | None:
    if mesh is None:
        return None
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    if hasattr(mesh, "shape") and hasattr(mesh, "axis_names"):
        return {str(k): int(v) for k, v in mesh.shape.items()}
    raise EinshardError(f"a mesh is a jax Mesh, axis sizes like {{'data': 4}}, or None; got {type(mesh).__name__}")


def _item(name: str, axes: Sequence[str]) -> str:
    if not axes:
        return name
    return f"{name}@{axes[0]}" if len(axes) == 1 else f"{name}@({','.join(axes)})"


def _draw_dims(draw: Any, sizes: Sequence[int], mesh: Mapping[str, int], usable: Sequence[str]) -> list[list[str]]:
    """Which mesh axes split each array axis: each mesh axis picks one array axis it divides, or none.

    ``None`` comes first in every choice, so shrinking removes mesh axes.  The
    choices are drawn last mesh axis first: hypothesis shrinks the earliest
    draws first, so a failure that needs one split shrinks to the mesh's
    *first* axis.  The permutation (the order within a ``@(x,y)`` group)
    shrinks to the mesh's own order.
    """
    order = draw(st.permutations(list(usable)))
    rank = {m: i for i, m in enumerate(order)}
    dims: list[list[str]] = [[] for _ in sizes]
    for m in reversed(order):
        n = mesh[m]
        fits = [d for d, s in enumerate(sizes) if s % (math.prod(mesh[a] for a in dims[d]) * n) == 0]
        d = draw(st.sampled_from([None, *fits]))
        if d is not None:
            dims[d].append(m)
    return [sorted(d, key=rank.__getitem__) for d in dims]


def _draw_counts(draw: Any, sizes: Sequence[int], n_devices: int) -> list[str]:
    """Right-side items of an einshard-0.2 count expression over ``n_devices`` (``a4``, ``b*``)."""
    # Whether to star is drawn first, always: every example then makes the same number of choices, and
    # hypothesis (which prefers shorter choice sequences) shrinks counts to the smallest, not to the one
    # that happens to leave no devices for a star.
    star = draw(st.booleans())
    left, items = n_devices, []
    names = array_names(len(sizes))
    for name, size in zip(names, sizes):
        c = draw(st.sampled_from(_divisors(math.gcd(size, left))))
        left //= c
        items.append(name if c == 1 else f"{name}{c}")
    # One star takes every device the counts leave (einshard 0.2's 'b*'), where it divides the axis.
    starable = [i for i, (item, s) in enumerate(zip(items, sizes)) if item == names[i] and s % left == 0]
    if star and left > 1 and starable:
        i = draw(st.sampled_from(starable))
        items[i] = names[i] + "*"
    return items


@st.composite
def _expressions(draw: Any, shape: tuple[int, ...], mesh: MeshLike | None, usable: tuple[str, ...] | None) -> str:
    names = array_names(len(shape))
    sizes = _mesh_sizes(mesh)
    if sizes is None:
        right = _draw_counts(draw, shape, jax.device_count())
    else:
        dims = _draw_dims(draw, shape, sizes, tuple(sizes) if usable is None else usable)
        right = [_item(n, axes) for n, axes in zip(names, dims)]
    return " ".join(names) + " -> " + " ".join(right)


def expressions(
    shape: Sequence[int], mesh: MeshLike | None = None, *, axes: Sequence[str] | None = None
) -> st.SearchStrategy[str]:
    """Valid placement expressions for an array of ``shape`` on ``mesh``.

    Args:
        shape: the array's shape; array axes are named ``a b c ...``.
        mesh: a Mesh (named axes: ``'a b -> a@data b@(model,fsdp)'``), axis sizes
            ``{'data': 4}``, a strategy of meshes (e.g. :func:`meshes`), or None for
            einshard 0.2 count expressions over all devices (``'a b -> a4 b*'``).
        axes: the mesh axes that may be used (default all).

    Every mesh axis splits at most one array axis, and only one whose size it
    divides (with the other mesh axes already on it).  Shrinks toward the
    replicated layout, then one mesh axis.
    """
    shp = tuple(int(s) for s in shape)
    if any(s < 0 for s in shp):
        raise EinshardError(f"expressions() takes a shape of non-negative integers, got {tuple(shape)}")
    if isinstance(mesh, st.SearchStrategy):
        return mesh.flatmap(lambda m: expressions(shp, m, axes=axes))
    sizes = _mesh_sizes(mesh)
    usable = None if axes is None else tuple(axes)
    if usable is not None:
        if sizes is None:
            raise EinshardError("expressions(axes=...) names mesh axes, but there is no mesh")
        unknown = [a for a in usable if a not in sizes]
        if unknown:
            raise EinshardError(f"expressions(axes=...) names {unknown}, not axes of the mesh {sizes}")
    return _expressions(shp, mesh, usable)


# ---------------------------------------------------------------------------
# Layouts of pytrees


def _is_array_like(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


Sharing = Literal["any", "disjoint"]


def layouts(
    tree: Any,
    mesh: MeshLike | None = None,
    rules: Mapping[str, str | None] | None = None,
    *,
    sharing: Sharing | None = None,
) -> st.SearchStrategy[Any]:
    """Pytrees of expressions for ``tree``: one drawn expression per array leaf.

    Args:
        tree: a pytree whose array leaves (anything with ``shape`` and ``dtype``:
            arrays, ``jax.ShapeDtypeStruct``) get layouts; other leaves get None.
        mesh: as for :func:`expressions` (a strategy of meshes draws one mesh for the whole tree).
        rules: leaves to fix: path patterns (regular expressions searched in
            ``jax.tree_util.keystr(path)``, first match wins, as ``einshard.einshard``
            takes them) to an expression, or to None (the leaf stays as it is).
        sharing: ``'any'``: every leaf draws from every mesh axis.  ``'disjoint'``: each mesh axis splits
            at most one leaf of the tree (the rules' leaves included), so two leaves never meet split over one
            mesh axis.  Default: ``'disjoint'`` on a mesh with Explicit axes, whose sharding types JAX checks
            (``x @ w`` with both operands split over one mesh axis is a ShardingTypeError: most 'any' draws of
            a model are layouts JAX refuses to trace), ``'any'`` otherwise (on Auto axes XLA runs every layout).
            What JAX still refuses is a rejected example in ``assert_layout_invariant``, not a failure.

    Returns:
        A strategy of pytrees with the structure of ``tree`` and an expression
        (or None) at each leaf: what ``assert_layout_invariant(layouts=...)``,
        ``einshard.explain(in_specs=...)`` take.  Shrinks leaf by leaf toward replicated.
    """
    if isinstance(mesh, st.SearchStrategy):
        return mesh.flatmap(lambda m: layouts(tree, m, rules, sharing=sharing))
    sizes = _mesh_sizes(mesh)  # validate early
    if sharing is not None and sharing not in ("any", "disjoint"):
        raise EinshardError(f"layouts(sharing=...) takes 'any' or 'disjoint', got {sharing!r}")
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    # einshard's one rule matcher (tree_rules): a rule means here what it means to einshard.einshard.
    fixed = leaf_expressions(tree, rules, unmatched=UNMATCHED) if rules else (UNMATCHED,) * len(leaves)
    shapes = [tuple(leaf.shape) if _is_array_like(leaf) else None for leaf in leaves]
    chosen = sharing or ("disjoint" if _has_explicit_axes(mesh) else "any")
    if chosen == "disjoint" and sizes is not None:
        draw_all = _disjoint_layouts(tuple(shapes), tuple(fixed), mesh, tuple(sizes))
        return draw_all.map(lambda xs: jax.tree_util.tree_unflatten(treedef, list(xs)))
    per_leaf: list[st.SearchStrategy[str | None]] = []
    for shape, rule in zip(shapes, fixed):
        if rule is not UNMATCHED or shape is None:
            per_leaf.append(st.just(None if rule is UNMATCHED else rule))
        else:
            per_leaf.append(expressions(shape, mesh))
    # Drawn last leaf first, as mesh axes are: a failure that needs one split leaf shrinks to the first.
    return st.tuples(*per_leaf[::-1]).map(lambda xs: jax.tree_util.tree_unflatten(treedef, list(xs)[::-1]))


def _has_explicit_axes(mesh: MeshLike | None) -> bool:
    types = getattr(mesh, "axis_types", None) or ()
    return any(t == AxisType.Explicit for t in types)


_MESH_AXES_OF = re.compile(r"@\(?([^\s()]+?)\)?(?=\s|$)")


def _mesh_axes_in(expr: Any) -> set[str]:
    """The mesh axes an expression's right side names (``'a b -> a@(data,model) b'``: data, model)."""
    if not isinstance(expr, str) or "->" not in expr:
        return set()
    right = expr.split("->", 1)[1]
    return {m for group in _MESH_AXES_OF.findall(right) for m in group.split(",")}


@st.composite
def _disjoint_layouts(
    draw: Any,
    shapes: tuple[tuple[int, ...] | None, ...],
    fixed: tuple[Any, ...],
    mesh: MeshLike | None,
    mesh_axes: tuple[str, ...],
) -> list[str | None]:
    """One expression per leaf, each mesh axis splitting at most one leaf (the rules' leaves keep theirs)."""
    free = [m for m in mesh_axes if not any(m in _mesh_axes_in(r) for r in fixed if r is not UNMATCHED)]
    out: list[str | None] = [None] * len(shapes)
    # Drawn last leaf first, as mesh axes are: a failure that needs one split leaf shrinks to the first.
    for i in reversed(range(len(shapes))):
        shape, rule = shapes[i], fixed[i]
        if rule is not UNMATCHED or shape is None:
            out[i] = None if rule is UNMATCHED else rule
            continue
        expr = draw(_expressions(shape, mesh, tuple(free)))
        used = _mesh_axes_in(expr)
        free = [m for m in free if m not in used]
        out[i] = expr
    return out


# ---------------------------------------------------------------------------
# Einsums


@dataclass(frozen=True)
class EinsumCase:
    """An annotated einsum with operand shapes that fit its layouts.

    Attributes:
        expression: the annotated expression, e.g. ``'a b@data, b c -> a c@model'``.
        operands: each operand's axis names.
        output: the result's axis names.
        sizes: every axis's size.
        mesh: the mesh the annotations name (None: no annotations).
        in_dims: per operand, per axis, the mesh axes splitting it.
        out_dims: the same for the result; None when the result is not annotated.
    """

    expression: str
    operands: tuple[tuple[str, ...], ...]
    output: tuple[str, ...]
    sizes: Mapping[str, int]
    mesh: MeshLike | None = field(compare=False)
    in_dims: tuple[tuple[tuple[str, ...], ...], ...]
    out_dims: tuple[tuple[str, ...], ...] | None

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.sizes[a] for a in op) for op in self.operands)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return tuple(self.sizes[a] for a in self.output)

    @property
    def subscripts(self) -> str:
        """The plain ``jnp.einsum`` subscripts (axis names are single letters)."""
        return ",".join("".join(op) for op in self.operands) + "->" + "".join(self.output)

    @property
    def plain(self) -> str:
        """The expression without annotations: ``'a b, b c -> a c'``."""
        return ", ".join(" ".join(op) for op in self.operands) + " -> " + " ".join(self.output)

    @property
    def in_specs(self) -> tuple[PartitionSpec, ...]:
        return tuple(_spec(dims) for dims in self.in_dims)

    @property
    def out_spec(self) -> PartitionSpec:
        """The result's PartitionSpec (replicated when the result is not annotated)."""
        return _spec(self.out_dims or tuple(() for _ in self.output))

    def arrays(self, seed: int = 0, dtype: Any = np.float32) -> list[np.ndarray]:
        """Random operands of the right shapes."""
        rng = np.random.default_rng(seed)
        return [rng.standard_normal(s).astype(dtype) for s in self.shapes]


def _spec(dims: Sequence[Sequence[str]]) -> PartitionSpec:
    return PartitionSpec(*[None if not d else d[0] if len(d) == 1 else tuple(d) for d in dims])


@st.composite
def _einsums(
    draw: Any,
    mesh: MeshLike | None,
    operands: tuple[int, int],
    max_axes: int,
    max_rank: int,
    sizes: Sequence[int] | Mapping[str, int],
    annotate_output: bool | None,
    max_per_axis: int | None,
) -> EinsumCase:
    fixed = isinstance(sizes, Mapping)
    universe = list(sizes) if fixed else list(_NAMES[:max_axes])
    n_ops = draw(st.integers(*operands))
    ops = []
    for _ in range(n_ops):
        rank = draw(st.integers(1, min(max_rank, len(universe))))
        # A permutation's prefix: shrinks to the first axes in alphabetical order.
        ops.append(tuple(draw(st.permutations(universe))[:rank]))
    used = list(dict.fromkeys(a for op in ops for a in op))
    out = tuple(draw(st.permutations(used))[: draw(st.integers(0, min(max_rank, len(used))))])
    size_of = {a: sizes[a] for a in used} if fixed else {a: draw(st.sampled_from(list(sizes))) for a in used}
    mesh_sizes = _mesh_sizes(mesh)

    def annotate(axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
        if mesh_sizes is None:
            return tuple(() for _ in axes)
        dims = _draw_dims(draw, [size_of[a] for a in axes], mesh_sizes, tuple(mesh_sizes))
        if max_per_axis is not None:
            dims = [d[:max_per_axis] for d in dims]
        return tuple(tuple(d) for d in dims)

    # Drawn result first, then the operands last to first: a failure that needs one annotation shrinks
    # to one on the first operand.
    out_dims = annotate(out) if (annotate_output if annotate_output is not None else draw(st.booleans())) else None
    in_dims = tuple(annotate(op) for op in ops[::-1])[::-1]
    side = lambda axes, dims: " ".join(_item(a, d) for a, d in zip(axes, dims))  # noqa: E731
    expression = ", ".join(side(op, d) for op, d in zip(ops, in_dims)) + " -> "
    # Not annotated: '?' on every output axis lets the analyzer choose (a bare name would mean whole).
    expression += side(out, out_dims) if out_dims is not None else " ".join(f"{a}?" for a in out)
    return EinsumCase(expression, tuple(ops), out, size_of, mesh, in_dims, out_dims)


def einsums(
    mesh: MeshLike | None = None,
    *,
    operands: tuple[int, int] = (2, 3),
    max_axes: int = 5,
    max_rank: int = 3,
    sizes: Sequence[int] | Mapping[str, int] = (8, 16),
    annotate_output: bool | None = None,
    max_per_axis: int | None = None,
) -> st.SearchStrategy[EinsumCase]:
    """Annotated einsums (:class:`EinsumCase`) whose sizes agree across operands and fit their layouts.

    Args:
        mesh: a Mesh, axis sizes, a strategy of meshes, or None (no annotations).
        operands: (min, max) number of operands.
        max_axes: axes drawn from ``a b c ...`` (ignored when ``sizes`` maps names to sizes).
        max_rank: most axes per operand and in the result.
        sizes: each axis's size is drawn from these; or a mapping fixing every axis's name and size.
        annotate_output: annotate the result (True), never (False), or draw it (None).
        max_per_axis: most mesh axes on one array axis (None: no limit).

    Shrinks toward two operands of one axis, no mesh annotations.
    """
    lo, hi = operands
    if not 1 <= lo <= hi:
        raise EinshardError(f"einsums(operands=...) takes (min, max) with 1 <= min <= max, got {operands}")
    if not sizes:
        raise EinshardError("einsums(sizes=...) needs at least one size")
    if isinstance(mesh, st.SearchStrategy):
        return mesh.flatmap(
            lambda m: einsums(
                m,
                operands=operands,
                max_axes=max_axes,
                max_rank=max_rank,
                sizes=sizes,
                annotate_output=annotate_output,
                max_per_axis=max_per_axis,
            )
        )
    _mesh_sizes(mesh)
    return _einsums(mesh, (lo, hi), max_axes, max_rank, sizes, annotate_output, max_per_axis)


# The public names check their arguments by name (einshard._checks.RULES) when the strategy is built, not at
# the first draw (where hypothesis would report a raw error from inside the test).
def _sizes_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    items = value.values() if isinstance(value, Mapping) else value
    if isinstance(value, str) or not isinstance(items, Iterable) or not list(items):
        return _checks.fail(where, name, "axis sizes: a sequence of integers >= 1 or {name: size}", value)
    for n in items:
        _checks.check_int(n, where, name, minimum=1)
    return value


def _operand_counts_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    if not isinstance(value, tuple) or len(value) != 2:
        return _checks.fail(where, name, "(min, max) operand counts", value)
    low = _checks.check_int(value[0], where, name, minimum=1)
    _checks.check_int(value[1], where, name, minimum=low)
    return value


def _devices_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    if value is None:
        return value
    if (
        not isinstance(value, Sequence)
        or isinstance(value, str)
        or not value
        or not all(hasattr(d, "id") for d in value)
    ):
        return _checks.fail(where, name, "a non-empty sequence of jax devices", value)
    return value


meshes = _checks.checked(meshes, "einshard.testing.meshes", devices=_devices_rule)
expressions = _checks.checked(expressions, "einshard.testing.expressions", axes=_checks.optional(_checks.RULES["axes"]))
layouts = _checks.checked(layouts, "einshard.testing.layouts")
# (an einsum of more than 52 axes has no letters left for jnp.einsum's subscripts)
_AT_MOST_52 = _checks.RULES_FOR_INT(minimum=1, maximum=52)
einsums = _checks.checked(
    einsums,
    "einshard.testing.einsums",
    operands=_operand_counts_rule,
    sizes=_sizes_rule,
    max_axes=_AT_MOST_52,
    max_rank=_AT_MOST_52,
)
