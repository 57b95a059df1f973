"""Collective matmul (asynchronous tensor parallelism) on the weights as given.

Inside a ``jax.shard_map`` body, an all-gather that feeds an einsum, or a
reduce-scatter of an einsum's result, can be run as a ring of ``ppermute``
steps in which each step's local einsum works on the block that has just
arrived while the next block travels (Wang et al., ASPLOS'23; the JAX
shard_map notebook's Examples 1 and 2).  Unlike DistJax's re-parametrised
layers, these functions lower the *given* operands: the result equals
``einsum(all_gather(x), y)`` or ``psum_scatter(einsum(x, y))`` exactly up to
summation order, so a standard checkpoint loads unchanged.

* :func:`allgather_einsum` — the gathered axis is a free/batch axis of the
  result (each arriving block fills its rows: no cross-step sum) or a
  contracted axis (each arriving block adds its partial product).
* :func:`einsum_reduce_scatter` — the *accumulator* travels the ring, each
  device adding its partial product for the block it is carrying.

``schedule`` is ``'sync'`` (the plain collective, the baseline), ``'one-way'``
(n−1 permutes of a whole block) or ``'two-way'`` (each block cut in halves that
travel in opposite directions: 2(n−1) permutes of half a block, both link
directions busy).  Rings are unrolled Python loops (n is static), so XLA's
scheduler is free to overlap each permute with the previous step's einsum.
A tuple of mesh axes is one ring over their product, major to minor, as
``PartitionSpec(('a', 'b'))`` orders blocks.  Low-precision inputs (bf16, f16)
are accumulated in float32 (``preferred_element_type``) and cast back at the end.

Example:
    >>> import jax, numpy as np
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((4,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> ag = lambda a, b: allgather_einsum('bd,df->bf', a, b, axis_name='x', gathered=0, dim=0)
    >>> f = jax.shard_map(ag, mesh=mesh, in_specs=(P('x'), P(None, 'x')), out_specs=P(None, 'x'))
    >>> a, b = np.ones((8, 3), np.float32), np.ones((3, 4), np.float32)
    >>> bool((f(a, b) == a @ b).all())
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..errors import EinshardError

__all__ = ["SCHEDULES", "allgather_einsum", "einsum_reduce_scatter", "ring_shift"]

SCHEDULES = ("sync", "one-way", "two-way")

AxisName = str | Sequence[str]


def _axes(axis_name: AxisName) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _name(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    return axes[0] if len(axes) == 1 else axes


def ring_shift(v: jax.Array, axis_name: AxisName, shift: int) -> jax.Array:
    """Device j sends ``v`` to device ``j + shift`` around the ring (one collective-permute)."""
    axes = _axes(axis_name)
    sizes = {a: jax.lax.axis_size(a) for a in axes}
    n = math.prod(sizes.values())
    # ppermute numbers the devices of several axes in the mesh's axis order whatever order they are named in, while
    # axis_index (the ring's block numbers) follows the named order: name the ring in mesh order and number each
    # device's position on the named ring in it (a gather over ('y', 'x') on an (x, y) mesh sent blocks to the
    # wrong neighbours: wrong values).
    order = jax.sharding.get_abstract_mesh().axis_names
    ring = tuple(sorted(axes, key=lambda m: order.index(m) if m in order else len(order)))

    def on_ring(j: int) -> int:
        coords: dict[str, int] = {}
        for a in reversed(axes):
            j, coords[a] = divmod(j, sizes[a])
        k = 0
        for a in ring:
            k = k * sizes[a] + coords[a]
        return k

    return jax.lax.ppermute(v, _name(ring), [(on_ring(j), on_ring((j + shift) % n)) for j in range(n)])


def _parse(subscripts: str) -> tuple[str, str, str]:
    if "..." in subscripts or "->" not in subscripts:
        raise EinshardError(f"collective matmul takes explicit two-operand subscripts 'ab,bc->ac', got {subscripts!r}")
    left, out = subscripts.replace(" ", "").split("->")
    ins = left.split(",")
    if len(ins) != 2:
        raise EinshardError(f"collective matmul takes two operands, got {len(ins)} in {subscripts!r}")
    return ins[0], ins[1], out


def _dtypes(x: jax.Array, y: jax.Array, preferred: Any) -> tuple[Any, Any]:
    """(accumulation dtype, result dtype): low-precision floats accumulate in float32."""
    out = jnp.dtype(preferred) if preferred is not None else jnp.result_type(x, y)
    acc = out
    if jnp.issubdtype(out, jnp.floating) and jnp.dtype(out).itemsize < 4:
        acc = jnp.dtype(jnp.float32)
    return acc, out


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise EinshardError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")


def allgather_einsum(
    subscripts: str,
    x: jax.Array,
    y: jax.Array,
    *,
    axis_name: AxisName,
    gathered: int = 0,
    dim: int,
    schedule: str = "one-way",
    two_way: bool | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``einsum(subscripts, all_gather(x or y))`` without materialising the gathered operand.

    Args:
        subscripts: two-operand einsum subscripts on the *local* blocks, e.g. ``'bd,df->bf'``.
        x, y: this device's blocks.
        axis_name: the mesh axis (or tuple of axes, one ring) of the gather.
        gathered: which operand (0 or 1) is gathered; its block is split along ``dim``.
        dim: the dimension of the gathered operand that the gather makes whole.
        schedule: ``'sync'``, ``'one-way'`` or ``'two-way'``; ``two_way=True`` is a shorthand for ``'two-way'``.

    The other operand must already be whole along the gathered axis (if it has
    it).  With the gathered axis in the result each step writes its own rows
    (exact); with a contracted axis each step adds a partial product.
    """
    if two_way is not None:
        schedule = "two-way" if two_way else ("one-way" if schedule == "two-way" else schedule)
    _check_schedule(schedule)
    axes = _axes(axis_name)
    sx, sy, so = _parse(subscripts)
    if gathered not in (0, 1):
        raise EinshardError(f"gathered must be 0 or 1, got {gathered}")
    ops = [x, y]
    subs = [sx, sy]
    g, o = ops[gathered], ops[1 - gathered]
    sg, s_other = subs[gathered], subs[1 - gathered]
    if not 0 <= dim < len(sg):
        raise EinshardError(f"dim {dim} is not a dimension of operand {gathered} ({sg!r})")
    letter = sg[dim]
    acc_dtype, out_dtype = _dtypes(x, y, preferred_element_type)
    kw = {"precision": precision, "preferred_element_type": acc_dtype}
    n = math.prod(jax.lax.axis_size(a) for a in axes)

    def einsum(a: jax.Array, b: jax.Array) -> jax.Array:
        pair = (a, b) if gathered == 0 else (b, a)
        return jnp.einsum(subscripts, *pair, **kw)

    if schedule == "sync" or n == 1:
        whole = g if n == 1 else jax.lax.all_gather(g, _name(axes), axis=dim, tiled=True)
        return einsum(whole, o).astype(out_dtype)

    b = g.shape[dim]
    o_dim = s_other.find(letter)
    if o_dim >= 0 and o.shape[o_dim] != n * b:
        raise EinshardError(
            f"operand {1 - gathered} has size {o.shape[o_dim]} along {letter!r}; after the gather it must be "
            f"whole ({n} x {b} = {n * b})"
        )
    i = jax.lax.axis_index(_name(axes))

    def part(chunk: jax.Array, src: jax.Array, offset: int) -> jax.Array:
        """The einsum of a chunk that started at row ``offset`` of device ``src``'s block."""
        other = o
        if o_dim >= 0:
            other = jax.lax.dynamic_slice_in_dim(o, src * b + offset, chunk.shape[dim], o_dim)
        return einsum(chunk, other)

    # (chunk, direction, row offset in the block): one-way sends whole blocks up;
    # two-way sends the first half up and the second half down.
    h = b // 2
    if schedule == "one-way":
        lanes = [(g, +1, 0)]
    else:
        lanes = [(jax.lax.slice_in_dim(g, 0, h, axis=dim), +1, 0), (jax.lax.slice_in_dim(g, h, b, axis=dim), -1, h)]
        lanes = [lane for lane in lanes if lane[0].shape[dim] > 0]  # b == 1: the empty half does not travel
    chunks = [lane[0] for lane in lanes]
    pieces: list[list[jax.Array]] = [[] for _ in lanes]
    for k in range(n):
        sent = [ring_shift(c, axes, d) for c, (_, d, _) in zip(chunks, lanes, strict=True)] if k < n - 1 else chunks
        for lane_no, (c, (_, d, off)) in enumerate(zip(chunks, lanes, strict=True)):
            src = (i - d * k) % n  # after k shifts by d, this device holds device i - d·k's chunk
            pieces[lane_no].append(part(c, src, off))
        chunks = sent

    out_dim = so.find(letter)
    if out_dim < 0:  # contracted (or summed-out) axis: add the partial products
        flat = [p for lane in pieces for p in lane]
        total = flat[0]
        for p in flat[1:]:
            total = total + p
        return total.astype(out_dtype)
    # A result axis: block j of the result is the piece computed from device j's chunk.
    j = jnp.arange(n)
    blocks = []
    for lane, (_, d, _) in zip(pieces, lanes, strict=True):
        stacked = jnp.stack(lane)  # [n, ...]: piece k came from device (i - d·k) mod n
        blocks.append(jnp.take(stacked, (d * (i - j)) % n, axis=0))
    rows = blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, axis=1 + out_dim)
    rows = jnp.moveaxis(rows, 0, out_dim)  # [..., n, b, ...] -> merge the block axis into the result axis
    shape = list(rows.shape)
    shape[out_dim : out_dim + 2] = [shape[out_dim] * shape[out_dim + 1]]
    return rows.reshape(shape).astype(out_dtype)


def einsum_reduce_scatter(
    subscripts: str,
    x: jax.Array,
    y: jax.Array,
    *,
    axis_name: AxisName,
    dim: int,
    schedule: str = "one-way",
    two_way: bool | None = None,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> jax.Array:
    """``psum_scatter(einsum(subscripts, x, y), axis_name, scatter_dimension=dim, tiled=True)`` as a ring.

    The accumulator for result block ``j`` visits every device once, each one
    adding its partial product for block ``j`` (operands sliced along the
    result axis ``dim``); it ends on device ``j``.  Only accumulators travel,
    never operands.  ``dim`` is the result dimension that becomes split.
    """
    if two_way is not None:
        schedule = "two-way" if two_way else ("one-way" if schedule == "two-way" else schedule)
    _check_schedule(schedule)
    axes = _axes(axis_name)
    sx, sy, so = _parse(subscripts)
    if not 0 <= dim < len(so):
        raise EinshardError(f"dim {dim} is not a dimension of the result ({so!r})")
    letter = so[dim]
    acc_dtype, out_dtype = _dtypes(x, y, preferred_element_type)
    kw = {"precision": precision, "preferred_element_type": acc_dtype}
    n = math.prod(jax.lax.axis_size(a) for a in axes)
    if schedule == "sync" or n == 1:
        full = jnp.einsum(subscripts, x, y, **kw)
        if n > 1:
            full = jax.lax.psum_scatter(full, _name(axes), scatter_dimension=dim, tiled=True)
        return full.astype(out_dtype)
    size = x.shape[sx.index(letter)] if letter in sx else y.shape[sy.index(letter)]
    if size % n:
        raise EinshardError(f"result axis {letter!r} of size {size} does not split into {n} blocks")
    b = size // n
    i = jax.lax.axis_index(_name(axes))

    def part(block: jax.Array, offset: int, rows: int) -> jax.Array:
        start = block * b + offset
        xs = jax.lax.dynamic_slice_in_dim(x, start, rows, sx.index(letter)) if letter in sx else x
        ys = jax.lax.dynamic_slice_in_dim(y, start, rows, sy.index(letter)) if letter in sy else y
        return jnp.einsum(subscripts, xs, ys, **kw)

    h = b // 2
    lanes: list[tuple[int, int, int]] = [(+1, 0, b)] if schedule == "one-way" else [(+1, 0, h), (-1, h, b - h)]
    lanes = [lane for lane in lanes if lane[2] > 0]
    results = []
    for d, off, rows in lanes:
        # At step k this device adds to the accumulator of block i - d·(k+1); after
        # n-1 shifts by d the accumulator of block i is back home.
        acc = part((i - d) % n, off, rows)
        for k in range(1, n):
            acc = ring_shift(acc, axes, d) + part((i - d * (k + 1)) % n, off, rows)
        results.append(acc)
    out = results[0] if len(results) == 1 else jnp.concatenate(results, axis=dim)
    return out.astype(out_dtype)
