"""Draw an array's layout as text, for arrays of any rank, in your axis names.

``jax.debug.visualize_array_sharding`` refuses arrays of more than two
dimensions.  ``einshard.show(x)`` draws a grid over two dimensions (the two
most split, or the ones you choose), one grid per block of any other split
dimension, with the devices holding each block, which devices hold copies of
the same block, and the expression that reproduces the layout
(``einshard.describe``).

Example:
    >>> import jax, numpy as np, einshard
    >>> mesh = jax.make_mesh((4, 2), ('data', 'model'), devices=jax.devices()[:8])
    >>> x = einshard.einshard(np.zeros((8, 16, 32)), 'b s d -> b@data s d@model', mesh=mesh)
    >>> einshard.show(x, names='b s d')
    f32[b:8@data s:16 d:32@model]   'b s d -> b@data s d@model'
    mesh: data=4, model=2 (8 devices)
    each device holds b:2 s:16 d:16 (512 elements, 2.0 KiB)
    rows: b (4 blocks)   columns: d (2 blocks)   whole on every device: s
    <BLANKLINE>
           │ d 0:16 │ d 16:32
    ───────┼────────┼─────────
     b 0:2 │ 0      │ 1
     b 2:4 │ 2      │ 3
     b 4:6 │ 4      │ 5
     b 6:8 │ 6      │ 7
    <BLANKLINE>
    no copies: each block lives on one device
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import jax
import numpy as np

from ._checks import describe_value
from ._compat import dtype_itemsize
from .core.layout import spec_dims
from .errors import EinshardError

__all__ = ["show", "render"]

_MAX_ROWS = 32
_MAX_COLS = 16
_MAX_GRIDS = 8
_MAX_IDS = 8  # runs of device ids listed in one cell


def show(
    x: Any, dims: Sequence[str | int] | str | None = None, *, names: str | None = None, file: TextIO | None = None
) -> None:
    """Print ``x``'s layout: see :func:`render`."""
    if file is not None and not callable(getattr(file, "write", None)):
        raise EinshardError(f"show(): file= takes a text stream (anything with .write), got {describe_value(file)}")
    print(render(x, dims, names=names), file=file or sys.stdout)


def render(x: Any, dims: Sequence[str | int] | str | None = None, *, names: str | None = None) -> str:
    """The text :func:`show` prints.

    Args:
        x: a ``jax.Array``, or anything with ``.shape``, ``.dtype`` and ``.sharding``
            (a ``jax.ShapeDtypeStruct`` with a sharding draws a layout without data).
        dims: the dimensions drawn as rows and columns (names or indices, one or two;
            ``'b,d'`` works too); default: the two split into the most blocks.
        names: the axis names, ``'b s d'``, or an expression whose left side names them
            (``'b s d -> b@data s d'``); default ``a b c ...``.
    """
    _check_dims_and_names(dims, names)
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "devices_indices_map"):
        raise EinshardError(f"show() needs an array with a sharding (a jax.Array), got {describe_value(x)}")
    shape = tuple(int(s) for s in x.shape)
    axis_names = _axis_names(names, len(shape))
    index_map = sharding.devices_indices_map(shape)
    devices = sorted(index_map, key=lambda d: d.id)
    blocks: dict[Any, tuple[tuple[int, int], ...]] = {
        d: tuple(_interval(s, n) for s, n in zip(index_map[d], shape)) for d in devices
    }
    intervals = [sorted({blocks[d][i] for d in devices}) for i in range(len(shape))]
    counts = [len(iv) for iv in intervals]
    rows_dim, cols_dim = _grid_dims(dims, axis_names, counts)

    lines = [_header(x, shape, axis_names, sharding)]
    lines.append(_mesh_line(sharding, len(devices)))
    block_shape = [hi - lo for lo, hi in blocks[devices[0]]] if devices else list(shape)
    itemsize = dtype_itemsize(x.dtype)
    elements = math.prod(block_shape)
    held = " ".join(f"{n}:{s}" for n, s in zip(axis_names, block_shape)) or "the scalar"
    lines.append(f"each device holds {held} ({elements:,} elements, {_bytes(elements * itemsize)})")
    placed = []
    if rows_dim is not None:
        placed.append(f"rows: {axis_names[rows_dim]} ({_blocks(counts[rows_dim])})")
    if cols_dim is not None:
        placed.append(f"columns: {axis_names[cols_dim]} ({_blocks(counts[cols_dim])})")
    grid_dims = {rows_dim, cols_dim} - {None}
    hidden = [i for i in range(len(shape)) if i not in grid_dims and counts[i] > 1]
    whole = [axis_names[i] for i in range(len(shape)) if i not in grid_dims and counts[i] == 1]
    if hidden:
        placed.append("one grid per block of: " + ", ".join(axis_names[i] for i in hidden))
    if whole:
        placed.append("whole on every device: " + ", ".join(whole))
    if placed:
        lines.append("   ".join(placed))

    n_combos = math.prod(len(intervals[i]) for i in hidden)
    combos = itertools.product(*[intervals[i] for i in hidden])
    for n_grid, combo in enumerate(combos):
        if n_grid == _MAX_GRIDS:
            lines.append(
                f"\n… {n_combos - _MAX_GRIDS} more grids, one per block of {', '.join(axis_names[i] for i in hidden)}"
            )
            break
        lines.append("")
        if hidden:
            lines.append("  ".join(f"{axis_names[i]} {lo}:{hi}" for i, (lo, hi) in zip(hidden, combo)) + ":")
        chosen = [d for d in devices if all(blocks[d][i] == iv for i, iv in zip(hidden, combo))]
        lines.extend(_grid(chosen, blocks, intervals, rows_dim, cols_dim, axis_names))
    lines.append("")
    lines.append(_copies(devices, blocks, sharding))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Pieces


def _check_dims_and_names(dims: Any, names: Any) -> None:
    if names is not None and not isinstance(names, str):
        raise EinshardError(f"show(): names= takes axis names as one string ('b s d'), got {describe_value(names)}")
    if dims is None or isinstance(dims, str):
        return
    if not isinstance(dims, (tuple, list)) or not all(
        isinstance(d, (str, int, np.integer)) and not isinstance(d, bool) for d in dims
    ):
        raise EinshardError(
            f"show(): dims= takes one or two dimensions as names or indices ('b,d', ('b', 'd'), (0, 2)), "
            f"got {describe_value(dims)}"
        )


def _axis_names(names: str | None, rank: int) -> list[str]:
    if names is None:
        letters = "abcdefghijklmnopqrstuvwxyz"
        return [letters[i] if i < 26 else f"a{i}" for i in range(rank)]
    text = names.split("->", 1)[0] if "->" in names else names
    out = text.replace(",", " ").split()
    if "..." in out:
        raise EinshardError(f"show(): name every axis (no '...'): {names!r}")
    if len(out) != rank:
        raise EinshardError(f"show(): {len(out)} axis names ({' '.join(out)}) for an array of rank {rank}")
    return out


def _interval(s: slice, n: int) -> tuple[int, int]:
    start, stop, _ = s.indices(n)
    return start, stop


def _grid_dims(
    dims: Sequence[str | int] | str | None, names: list[str], counts: list[int]
) -> tuple[int | None, int | None]:
    rank = len(names)
    if rank == 0:
        return None, None
    if dims is None:
        # The most split dimensions, in array order; a 1-D array is one row.
        order = sorted(range(rank), key=lambda i: (-counts[i], i))
        picked = sorted(order[:2])
        return (None, picked[0]) if len(picked) == 1 else (picked[0], picked[1])
    wanted = dims.replace(",", " ").split() if isinstance(dims, str) else list(dims)
    if not 1 <= len(wanted) <= 2:
        raise EinshardError(f"show(): dims= names one or two dimensions, got {list(wanted)}")
    picked_dims = []
    for d in wanted:
        if isinstance(d, str) and not d.lstrip("-").isdigit():
            if d not in names:
                raise EinshardError(f"show(): {d!r} is not an axis name; the names are {' '.join(names)}")
            picked_dims.append(names.index(d))
        else:
            i = int(d)
            if not -rank <= i < rank:
                raise EinshardError(f"show(): dimension {i} is out of range for rank {rank}")
            picked_dims.append(i % rank)
    if len(picked_dims) == 2 and picked_dims[0] == picked_dims[1]:
        raise EinshardError("show(): the row and column dimensions must differ")
    return (None, picked_dims[0]) if len(picked_dims) == 1 else (picked_dims[0], picked_dims[1])


def _dtype_name(dtype: Any) -> str:
    if not isinstance(dtype, np.dtype) and jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return str(dtype)  # a typed PRNG key: key<fry>, key<rbg>; NumPy has no name for it
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return "bool"
    if dt.name == "bfloat16":
        return "bf16"
    prefix = {"f": "f", "i": "i", "u": "u", "c": "c"}.get(dt.kind, dt.kind)
    return f"{prefix}{dt.itemsize * 8}"


def _spec_dims(sharding: Any, rank: int) -> list[tuple[str, ...]] | None:
    spec = getattr(sharding, "spec", None)
    if spec is None:
        return None
    return list(spec_dims(spec, rank))


def _header(x: Any, shape: tuple[int, ...], names: list[str], sharding: Any) -> str:
    from .placement import describe

    dims = _spec_dims(sharding, len(shape))
    parts = []
    for i, (n, s) in enumerate(zip(names, shape)):
        text = f"{n}:{s}"
        if dims and dims[i]:
            text += "@" + (dims[i][0] if len(dims[i]) == 1 else "(" + ",".join(dims[i]) + ")")
        parts.append(text)
    typed = f"{_dtype_name(x.dtype)}[{' '.join(parts)}]"
    try:
        expr = describe(_Described(shape, sharding), names=" ".join(names) if names else None)
    except EinshardError:
        return typed
    return f"{typed}   {expr!r}"


class _Described:
    """What describe() reads: a shape and a sharding (so abstract arrays work too)."""

    def __init__(self, shape: tuple[int, ...], sharding: Any) -> None:
        self.shape, self.sharding = shape, sharding


def _mesh_line(sharding: Any, n_devices: int) -> str:
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(mesh, "shape"):
        return f"{n_devices} device{'s' if n_devices != 1 else ''}"
    from .placement import is_anonymous

    axes = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    kind = " (anonymous: from a count expression)" if is_anonymous(mesh) else ""
    return f"mesh: {axes} ({n_devices} devices){kind}"


def _device_list(ids: list[int], limit: int | None = None) -> str:
    """Device ids, runs of three or more shortened: ``[0, 1, 2, 3, 6, 7]`` -> ``'0-3 6 7'``; past ``limit``
    pieces, a count of the rest."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    pieces = [f"{r[0]}-{r[-1]}" if len(r) > 2 else " ".join(map(str, r)) for r in runs]
    if limit is not None and len(pieces) > limit:
        rest = sum(len(r) for r in runs[limit:])
        pieces = pieces[:limit] + [f"… +{rest}"]
    return " ".join(pieces)


def _grid(
    devices: list[Any],
    blocks: dict[Any, tuple[tuple[int, int], ...]],
    intervals: list[list[tuple[int, int]]],
    rows_dim: int | None,
    cols_dim: int | None,
    names: list[str],
) -> list[str]:
    row_ivs: list[tuple[int, int] | None] = list(intervals[rows_dim]) if rows_dim is not None else [None]
    all_cols: list[tuple[int, int] | None] = list(intervals[cols_dim]) if cols_dim is not None else [None]
    # Wide grids keep their first and last columns: the text stays bounded however many devices there are.
    col_ivs = all_cols if len(all_cols) <= _MAX_COLS else all_cols[: _MAX_COLS - 2] + all_cols[-2:]
    # One pass over the devices (a cell per device's block), not one per cell: 100,000 devices draw in seconds.
    held: dict[tuple[Any, Any], list[int]] = {}
    for d in devices:
        r = blocks[d][rows_dim] if rows_dim is not None else None
        c = blocks[d][cols_dim] if cols_dim is not None else None
        held.setdefault((r, c), []).append(d.id)
    cells = {(r, c): _device_list(held.get((r, c), []), _MAX_IDS) or "-" for r in row_ivs for c in col_ivs}
    row_labels = ["" if r is None else f"{names[rows_dim]} {r[0]}:{r[1]}" for r in row_ivs]  # type: ignore[index]
    col_labels = ["devices" if c is None else f"{names[cols_dim]} {c[0]}:{c[1]}" for c in col_ivs]  # type: ignore[index]
    w_row = max(len(x) for x in row_labels) + 2
    widths = [max(len(col_labels[j]), *(len(cells[(r, c)]) for r in row_ivs)) for j, c in enumerate(col_ivs)]
    out = [" " * w_row + "│" + "│".join(f" {lab:<{w}} " for lab, w in zip(col_labels, widths)).rstrip()]
    out.append("─" * w_row + "┼" + "┼".join("─" * (w + 2) for w in widths))
    shown_rows = list(enumerate(row_ivs))
    if len(shown_rows) > _MAX_ROWS:
        shown_rows = shown_rows[: _MAX_ROWS - 4] + [(-1, None)] + shown_rows[-3:]
    for i, r in shown_rows:
        if i == -1:
            out.append(f"{'⋮':^{w_row}}│ … {len(row_ivs) - _MAX_ROWS + 1} more rows")
            continue
        line = f" {row_labels[i]:<{w_row - 1}}│" + "│".join(f" {cells[(r, c)]:<{w}} " for c, w in zip(col_ivs, widths))
        out.append(line.rstrip())
    if len(col_ivs) < len(all_cols):
        out.append(
            f"(columns {_MAX_COLS - 2} to {len(all_cols) - 3} of {len(all_cols)} not drawn; pass dims= to pick others)"
        )
    return out


def _copies(devices: list[Any], blocks: dict[Any, tuple[tuple[int, int], ...]], sharding: Any) -> str:
    groups: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for d in devices:
        groups.setdefault(blocks[d], []).append(d.id)
    sizes = {len(g) for g in groups.values()}
    if sizes == {1}:
        return "no copies: each block lives on one device"
    copies = max(sizes)
    over = ""
    mesh, dims = getattr(sharding, "mesh", None), _spec_dims(sharding, len(next(iter(blocks.values()))))
    if mesh is not None and dims is not None and hasattr(mesh, "shape"):
        used = {m for d in dims for m in d}
        rep = [f"{k}({v})" for k, v in mesh.shape.items() if k not in used and v > 1]
        if rep:
            over = " over " + " x ".join(rep)
    listed = sorted(groups.values(), key=min)
    shown = " ".join("{" + _device_list(g, _MAX_IDS) + "}" for g in listed[:16])
    more = f" … {len(listed) - 16} more" if len(listed) > 16 else ""
    return f"copies: each block is on {copies} devices{over}; replication groups: {shown}{more}"


def _blocks(n: int) -> str:
    return f"{n} block" if n == 1 else f"{n} blocks"


def _bytes(n: int) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"
