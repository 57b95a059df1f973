"""What ``analyze`` reads: from an expression's text alone, once per text (its axes, annotations and axis
classes, and each side's layout as written), and from its arguments (dtypes, jnp.einsum strings, meshes,
specs, ``...``, layouts).

Nothing read from the text depends on a mesh or on sizes; ``analyze`` combines those facts with its arguments
(:func:`einshard.analysis.einsum.analyze._analyze_plain`).  Each function that reads an argument checks one
kind of input and raises an :class:`~einshard.errors.EinshardError` that quotes the expression and points at
the column where one exists.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from ..._caches import cached
from ..._compat import dtype_itemsize, is_extended_dtype
from ...core.layout import Layout, MeshAxis, spec_partitions
from ...errors import EinshardError
from ...parsing import AxisItem, EllipsisItem, Expression, Side, parse_einsum
from .model import classify, pick_weight_of_axes

__all__ = [
    "Prepared",
    "WrittenSide",
    "check_rank",
    "dtype_info",
    "einsum_text",
    "expand_ellipsis",
    "prepare",
    "prepare_text",
    "prepared_of",
    "side_layout",
    "spec_partitions",
]

# JAX's short dtype names (as it prints types) and their sizes.
_ITEMSIZE = {
    "f64": 8, "f32": 4, "bf16": 2, "f16": 2, "f8": 1, "c64": 8, "c128": 16,
    "s64": 8, "s32": 4, "s16": 2, "s8": 1, "u64": 8, "u32": 4, "u16": 2, "u8": 1, "pred": 1,
}  # fmt: skip
_ALIASES = {
    "float64": "f64", "double": "f64", "float32": "f32", "float": "f32", "bfloat16": "bf16", "float16": "f16",
    "half": "f16", "fp8": "f8", "float8_e4m3fn": "f8", "float8_e5m2": "f8", "float8_e4m3": "f8",
    "complex64": "c64", "complex128": "c128", "int64": "s64", "int32": "s32", "int16": "s16", "int8": "s8",
    "uint64": "u64", "uint32": "u32", "uint16": "u16", "uint8": "u8", "bool": "pred", "fp32": "f32", "fp16": "f16",
    "i64": "s64", "i32": "s32", "i16": "s16", "i8": "s8",
}  # fmt: skip


def dtype_info(dtype: Any) -> tuple[str, int]:
    """(JAX's short name, itemsize) of a dtype given as a name, a numpy/JAX dtype or a scalar type.

    Example:
        >>> dtype_info("bfloat16"), dtype_info("f32")
        (('bf16', 2), ('f32', 4))
    """
    if dtype is None:
        return "f32", 4
    if isinstance(dtype, (bytes, bool)):  # numpy reads b'f4' as a dtype; einshard's names are str
        raise EinshardError(f"dtype= takes a dtype or its name (a string), got {type(dtype).__name__} {dtype!r}")
    if dtype.__class__ is str:  # the common call: a short name as the table spells it
        size = _ITEMSIZE.get(dtype)
        if size is not None:
            return dtype, size
    if not isinstance(dtype, str) and is_extended_dtype(dtype):
        return str(dtype), dtype_itemsize(dtype)  # a typed PRNG key: its buffer's words (key<fry>: 8 B)
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None) or getattr(dtype, "__name__", str(dtype))
    if not isinstance(dtype, str):
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except TypeError:
            pass
    key = str(name).lower()
    key = _ALIASES.get(key, key)
    if key not in _ITEMSIZE:
        raise EinshardError(
            f"unknown dtype {dtype!r}", hint="Use a JAX/numpy dtype or a name: " + ", ".join(sorted(_ITEMSIZE)) + "."
        )
    return key, _ITEMSIZE[key]


_PLAIN = re.compile(r"^\s*([A-Za-z]*)(\s*,\s*[A-Za-z]*)*\s*->\s*[A-Za-z]*\s*$")


def einsum_text(expr: str) -> str:
    """``'bx,xy->by'`` (jnp.einsum, one letter per axis) → ``'b x, x y -> b y'``; DSL text unchanged."""
    if not isinstance(expr, str):
        raise EinshardError(f"an einsum expression is a string, got {type(expr).__name__}: {expr!r}")
    if _PLAIN.match(expr) and not re.search(r"[A-Za-z]\s+[A-Za-z]", expr) and re.search(r"[A-Za-z]{2}", expr):
        lhs, rhs = expr.split("->")
        sides = [" ".join(s.strip()) for s in lhs.split(",")]
        return ", ".join(sides) + " -> " + " ".join(rhs.strip())
    return expr


def analysis_mesh(mesh: Any, operands: tuple[Any, ...]) -> tuple[MeshAxis, ...] | None:
    """``mesh=``, else the current mesh (``jax.set_mesh``), else the operands' (einshard.core.mesh), else None
    (an einsum with nothing sharded needs no mesh)."""
    if isinstance(mesh, dict):  # the common analysis call: sizes only, answered without asking JAX
        _check_sizes(mesh)
        return tuple([trusted_mesh_axis(str(name), size) for name, size in mesh.items()])
    from ...core.mesh import mesh_axes, resolve_mesh

    found = resolve_mesh(mesh, operands, what="einshard.analyze", check_operands=False, required=False)
    return None if found is None else mesh_axes(found)


def trusted_mesh_axis(name: str, size: int) -> MeshAxis:
    """``MeshAxis(name, size)`` for a name and size :func:`_check_sizes` accepted, its checks not re-run."""
    return MeshAxis._derive(name, size)


def _check_sizes(mesh: dict[Any, Any]) -> None:
    for name, size in mesh.items():
        if size.__class__ is int and size >= 1 and name.__class__ is str and name:
            continue  # the common entry, checked at once
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EinshardError(f"mesh axis {name!r} has size {size!r}; sizes are positive integers (mesh={mesh!r})")
        if not isinstance(name, str) or not name:
            raise EinshardError(f"mesh= as a dict maps axis names (strings) to sizes, got the key {name!r}")


def spec_dims(spec: Any, n: int, what: str) -> tuple[tuple[tuple[str, ...], ...], frozenset[str]]:
    entries = spec_partitions(spec) if spec is not None else ()
    if len(entries) > n:
        raise EinshardError(f"{what}: the PartitionSpec {spec} has {len(entries)} entries for {n} axes")
    entries = entries + (None,) * (n - len(entries))
    dims = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
    unreduced = frozenset(getattr(spec, "unreduced", None) or ())
    return dims, unreduced


def expand_ellipsis(parsed: Expression, ops: tuple[Any, ...]) -> Expression:
    """``'... x, x y -> ... y'`` with the operands' ranks: each ``...`` becomes axes ``'...0'``, ``'...1'``, ...

    As in ``jnp.einsum``, the axes under ``...`` align from the right across operands; the output's
    ``...`` holds all of them (without one in the output they are summed).  Broadcasting a size-1
    axis against a larger one is not modelled: sizes under ``...`` must agree.
    """
    counts: list[int] = []
    for k, side in enumerate(parsed.inputs):
        if not side.has_ellipsis:
            counts.append(0)
            continue
        col = next(i.column for i in side.items if isinstance(i, EllipsisItem))
        if k >= len(ops):
            raise parsed.fail(
                "'...' needs the operand's rank: pass arrays or jax.ShapeDtypeStructs (or name every axis)", col
            )
        extra = len(ops[k].shape) - len(side.axes)
        if extra < 0:
            raise parsed.fail(
                f"operand {k + 1} has rank {len(ops[k].shape)} but its side names {len(side.axes)} axes besides '...'",
                col,
            )
        counts.append(extra)
    total = max(counts)

    def expand(side: Side, n: int) -> Side:
        items: list[Any] = []
        for item in side.items:
            if isinstance(item, EllipsisItem):
                items.extend(AxisItem(f"...{j}", column=item.column) for j in range(total - n, total))
            else:
                items.append(item)
        return Side(tuple(items), side.unreduced, side.column, side.unreduced_column)

    inputs = tuple(expand(side, n) for side, n in zip(parsed.inputs, counts, strict=True))
    return Expression(inputs, expand(parsed.output, total), parsed.text)


def check_rank(expr: Expression, side: Side, k: int, shape: tuple[int, ...]) -> None:
    if side.has_ellipsis:
        col = next(i.column for i in side.items if isinstance(i, EllipsisItem))
        raise expr.fail("analyze does not expand '...' yet; name every axis", col)
    if len(side.axes) != len(shape):
        raise expr.fail(
            f"operand {k + 1} has rank {len(shape)} (shape {tuple(shape)}) but its side names {len(side.axes)} axes",
            side.column,
        )


def side_layout(
    expr: Expression,
    side: Side,
    dims: tuple[tuple[str, ...], ...],
    unreduced: frozenset[str],
    sizes: dict[str, int],
    mesh: tuple[MeshAxis, ...],
    what: str,
) -> Layout:
    """The layout of an einsum side (``what``: ``'operand 2'``, ``'the output'``) laid out as ``dims`` and
    ``unreduced`` say, checked by :class:`Layout` (core's one check of a layout).  When that check fails,
    the error quotes the expression and points at the side's axis that breaks it."""
    names = tuple(side.names)
    try:
        return Layout(names, tuple([sizes[n] for n in names]), mesh, dims, unreduced)
    except EinshardError as err:
        raise _side_error(expr, side, dims, unreduced, sizes, mesh, what) or err from None


def _side_error(
    expr: Expression,
    side: Side,
    dims: tuple[tuple[str, ...], ...],
    unreduced: frozenset[str],
    sizes: dict[str, int],
    mesh: tuple[MeshAxis, ...],
    what: str,
) -> EinshardError | None:
    """Why a side's layout is refused, pointing at its column (None: core's message says it best)."""
    mesh_sizes = {m.name: m.size for m in mesh}
    known = ", ".join(f"{m.name!r}: {m.size}" for m in mesh) or "none"
    for item, d in zip(side.axes, dims, strict=False):
        for m in d:
            if m not in mesh_sizes:
                import difflib

                close = difflib.get_close_matches(m, list(mesh_sizes), n=1)
                return expr.fail(
                    f"mesh axis {m!r} ({what}, axis {item.name!r}) is not an axis of the mesh ({known})",
                    item.column,
                    (f"Did you mean {close[0]!r}? " if close else "") + "Pass mesh={'name': size, ...} or a jax Mesh.",
                )
        n = math.prod(mesh_sizes[m] for m in d)
        if sizes[item.name] % n:
            return expr.fail(
                f"axis {item.name!r} has size {sizes[item.name]}, which does not split into {n} shards over "
                + "·".join(f"{m}({mesh_sizes[m]})" for m in d),
                item.column,
            )
    for m in unreduced:
        if m not in mesh_sizes:
            return expr.fail(
                f"mesh axis {m!r} in '{{U:...}}' is not an axis of the mesh ({known})", side.unreduced_column
            )
    seen: set[str] = set()
    for item, d in zip(side.axes, dims, strict=False):
        for m in d:
            if m in seen:
                return expr.fail(f"mesh axis {m!r} splits two axes of {what}", item.column)
            seen.add(m)
    return None


# What analyze reads from an expression's text alone, once per text (a model's layers repeat it).


class Prepared(NamedTuple):
    """What analyze reads from an expression's text, once per text (a model's layers repeat it)."""

    text: str  # the einshard text (a jnp.einsum string rewritten)
    jnp_style: bool
    parsed: Expression
    names: tuple[tuple[str, ...], ...]  # per operand: its axes
    dims: tuple[tuple[tuple[str, ...], ...], ...]  # per operand: its '@' annotations
    unreduced: tuple[frozenset[str], ...]  # per operand: its '{U:...}'
    unique: tuple[str, ...]  # every operand axis once, in order of first appearance
    out_names: tuple[str, ...]
    out_dims: tuple[tuple[str, ...], ...]
    out_unreduced: frozenset[str]
    classes: dict[str, str]  # classify(names, out_names): read, never written
    weight: int | None  # pick_weight_of_axes(names, classes)
    chosen: bool  # parsed.output_chosen
    has_own: tuple[bool, ...]  # per operand: whether its side annotates a layout ('@' or '{U:...}')
    unique_set: frozenset[str]
    sides: tuple[WrittenSide, ...]  # per operand: its layout's facts as written (``_analyze_plain``)
    out_side: WrittenSide
    plain: bool  # no '...', every output axis an operand's, no mesh axis named twice on a side
    any_own: bool  # some operand's side annotates a layout
    bare: bool  # the output side names no layout and is not chosen ('-> b y')
    mesh_names: frozenset[str]  # every mesh axis a side names (splits and pending sums)
    at: tuple[dict[str, str], ...]  # options.splits_of the layouts as written, without the output's
    at_out: tuple[dict[str, str], ...]  # the same, then the output's
    kept: dict[str, tuple[str | None, ...]]  # options.options of ``at`` per mesh axis named (a size > 1 assumed)
    kept_out: dict[str, tuple[str | None, ...]]  # the same of ``at_out``


class WrittenSide(NamedTuple):
    """A side's layout as written: what :func:`side_layout` checks of it, read once from the text."""

    names: tuple[str, ...]
    dims: tuple[tuple[str, ...], ...]
    unreduced: frozenset[str]
    split: tuple[tuple[int, tuple[str, ...]], ...]  # (position, mesh axes) of each split dimension
    at: dict[str, str]  # options.split_at of the layout: {mesh axis: the einsum axis it splits}; read, never written
    once: bool  # no mesh axis named twice (two splits, or a split and a pending sum)


def written_side(names: tuple[str, ...], dims: tuple[tuple[str, ...], ...], unreduced: frozenset[str]) -> WrittenSide:
    named = [m for d in dims for m in d]
    at = {m: name for name, d in zip(names, dims, strict=True) for m in d}
    once = len(set(named)) == len(named) and not unreduced & set(named)
    return WrittenSide(names, dims, unreduced, tuple([(i, d) for i, d in enumerate(dims) if d]), at, once)


def prepare(expr: str) -> Prepared:
    if not isinstance(expr, str):
        einsum_text(expr)  # raises: an expression is a string (and an unhashable one must not reach the cache)
    return prepare_text(expr)


@cached(maxsize=4096)
def prepare_text(expr: str) -> Prepared:
    text = einsum_text(expr)
    return prepared_of(parse_einsum(text), text, text != expr)


def prepared_of(parsed: Expression, text: str, jnp_style: bool) -> Prepared:
    names = tuple([side.names for side in parsed.inputs])
    out = parsed.output
    classes = classify(names, out.names)
    dims = tuple([tuple([item.mesh_axes or () for item in side.axes]) for side in parsed.inputs])
    unreduced = tuple([frozenset(side.unreduced) for side in parsed.inputs])
    out_dims = tuple([item.mesh_axes or () for item in out.axes])
    has_own = tuple([bool(side.unreduced) or any(item.mesh_axes for item in side.axes) for side in parsed.inputs])
    unique_set = frozenset([n for side in names for n in side])
    sides = tuple([written_side(n, d, u) for n, d, u in zip(names, dims, unreduced, strict=True)])
    out_side = written_side(out.names, out_dims, frozenset(out.unreduced))
    plain = (
        not any(side.has_ellipsis for side in parsed.sides)
        and unique_set.issuperset(out.names)
        and all(side.once for side in (*sides, out_side))
    )
    return Prepared(
        text,
        jnp_style,
        parsed,
        names,
        dims,
        unreduced,
        tuple(dict.fromkeys([n for side in names for n in side])),
        out.names,
        out_dims,
        frozenset(out.unreduced),
        classes,
        pick_weight_of_axes(names, classes),
        parsed.output_chosen,
        has_own,
        unique_set,
        sides,
        out_side,
        plain,
        any(has_own),
        not any(out_dims) and not out.unreduced and not parsed.output_chosen,
        frozenset([m for side in (*sides, out_side) for d in side.dims for m in d])
        | frozenset().union(*[side.unreduced for side in (*sides, out_side)]),
        tuple([side.at for side in sides]),
        tuple([side.at for side in (*sides, out_side)]),
        _kept_by_mesh_axis([side.at for side in sides]),
        _kept_by_mesh_axis([side.at for side in (*sides, out_side)]),
    )


def _kept_by_mesh_axis(at: list[dict[str, str]]) -> dict[str, tuple[str | None, ...]]:
    """``options.options`` of layouts split as ``at`` says, for each mesh axis they name (of size > 1): the einsum
    axes it splits, in order of first appearance, then None."""
    seen: dict[str, list[str]] = {}
    for where in at:
        for m, e in where.items():
            if e not in seen.setdefault(m, []):
                seen[m].append(e)
    return {m: (*es, None) for m, es in seen.items()}
