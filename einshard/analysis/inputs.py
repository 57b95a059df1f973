"""What ``analyze`` reads from its arguments: dtypes, jnp.einsum strings, meshes, specs, ``...``, layouts.

Each function checks one kind of input and raises an :class:`~einshard.errors.EinshardError` that quotes
the expression and points at the column where one exists.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..core.layout import Layout, MeshAxis
from ..errors import EinshardError
from ..parsing import AxisItem, EllipsisItem, Expression, Side

__all__ = ["dtype_info", "spec_partitions"]

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


def _einsum_text(expr: str) -> str:
    """``'bx,xy->by'`` (jnp.einsum, one letter per axis) → ``'b x, x y -> b y'``; DSL text unchanged."""
    if not isinstance(expr, str):
        raise EinshardError(f"an einsum expression is a string, got {type(expr).__name__}: {expr!r}")
    if _PLAIN.match(expr) and not re.search(r"[A-Za-z]\s+[A-Za-z]", expr) and re.search(r"[A-Za-z]{2}", expr):
        lhs, rhs = expr.split("->")
        sides = [" ".join(s.strip()) for s in lhs.split(",")]
        return ", ".join(sides) + " -> " + " ".join(rhs.strip())
    return expr


def _mesh_axes(mesh: Any, operands: tuple[Any, ...]) -> tuple[MeshAxis, ...] | None:
    """``mesh=``, else the current mesh (``jax.set_mesh``), else the operands' (einshard.core.mesh), else None
    (an einsum with nothing sharded needs no mesh)."""
    if isinstance(mesh, dict):  # the common analysis call: sizes only, answered without asking JAX
        _check_sizes(mesh)
        return tuple([_mesh_axis(str(name), size) for name, size in mesh.items()])
    from ..core.mesh import mesh_axes, resolve_mesh

    found = resolve_mesh(mesh, operands, what="einshard.analyze", check_operands=False, required=False)
    return None if found is None else mesh_axes(found)


def _mesh_axis(name: str, size: int) -> MeshAxis:
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


def spec_partitions(spec: Any) -> tuple[Any, ...]:
    """A PartitionSpec's entries (``tuple(spec)`` refuses specs with ``unreduced`` axes)."""
    parts = getattr(spec, "partitions", None)
    return tuple(parts) if parts is not None else tuple(spec)


def _spec_dims(spec: Any, n: int, what: str) -> tuple[tuple[tuple[str, ...], ...], frozenset[str]]:
    entries = spec_partitions(spec) if spec is not None else ()
    if len(entries) > n:
        raise EinshardError(f"{what}: the PartitionSpec {spec} has {len(entries)} entries for {n} axes")
    entries = entries + (None,) * (n - len(entries))
    dims = tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)
    unreduced = frozenset(getattr(spec, "unreduced", None) or ())
    return dims, unreduced


def _expand_ellipsis(parsed: Expression, ops: tuple[Any, ...]) -> Expression:
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


def _check_rank(expr: Expression, side: Side, k: int, shape: tuple[int, ...]) -> None:
    if side.has_ellipsis:
        col = next(i.column for i in side.items if isinstance(i, EllipsisItem))
        raise expr.fail("analyze does not expand '...' yet; name every axis", col)
    if len(side.axes) != len(shape):
        raise expr.fail(
            f"operand {k + 1} has rank {len(shape)} (shape {tuple(shape)}) but its side names {len(side.axes)} axes",
            side.column,
        )


def _valid_layout(
    names: tuple[str, ...],
    dims: tuple[tuple[str, ...], ...],
    unreduced: frozenset[str],
    sizes: dict[str, int],
    mesh: tuple[MeshAxis, ...],
    mesh_sizes: dict[str, int],
) -> Layout | None:
    """The layout if every check of :func:`_layout_of` and of ``Layout`` passes, else None (then
    :func:`_layout_of` says what is wrong).  The checks, done once, without building messages."""
    shape = tuple([sizes[name] for name in names])
    used = 0  # mesh axes named in dims
    for s, d in zip(shape, dims, strict=True):
        if d:
            n = 1
            for m in d:
                k = mesh_sizes.get(m)
                if k is None:
                    return None
                n *= k
            if s % n:
                return None
            used += len(d)
    if min(shape, default=0) < 0:
        return None
    if used > 1 or unreduced:  # a mesh axis used twice (two splits, or a split and a pending sum)
        seen: set[str] = set()
        for d in dims:
            seen.update(d)
        if len(seen) < used:
            return None
        for m in unreduced:
            if m not in mesh_sizes or m in seen:
                return None
    return Layout._derive(names, shape, mesh, dims, unreduced)


def _layout_of(
    expr: Expression,
    side: Side,
    dims: tuple[tuple[str, ...], ...],
    unreduced: frozenset[str],
    sizes: dict[str, int],
    mesh: tuple[MeshAxis, ...],
    what: str,
) -> Layout:
    mesh_sizes = {m.name: m.size for m in mesh}
    known = ", ".join(f"{m.name!r}: {m.size}" for m in mesh) or "none"
    for item, d in zip(side.axes, dims, strict=False):
        for m in d:
            if m not in mesh_sizes:
                import difflib

                close = difflib.get_close_matches(m, list(mesh_sizes), n=1)
                raise expr.fail(
                    f"mesh axis {m!r} ({what}, axis {item.name!r}) is not an axis of the mesh ({known})",
                    item.column,
                    (f"Did you mean {close[0]!r}? " if close else "") + "Pass mesh={'name': size, ...} or a jax Mesh.",
                )
        n = math.prod(mesh_sizes[m] for m in d)
        if sizes[item.name] % n:
            raise expr.fail(
                f"axis {item.name!r} has size {sizes[item.name]}, which does not split into {n} shards over "
                + "·".join(f"{m}({mesh_sizes[m]})" for m in d),
                item.column,
            )
    for m in unreduced:
        if m not in mesh_sizes:
            raise expr.fail(
                f"mesh axis {m!r} in '{{U:...}}' is not an axis of the mesh ({known})", side.unreduced_column
            )
    seen: set[str] = set()
    for item, d in zip(side.axes, dims, strict=False):
        for m in d:
            if m in seen:
                raise expr.fail(f"mesh axis {m!r} splits two axes of {what}", item.column)
            seen.add(m)
    names = tuple(side.names)
    return Layout(names, tuple(sizes[n] for n in names), mesh, dims, unreduced)
