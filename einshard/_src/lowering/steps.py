"""Executable steps: run one :class:`~einshard.core.collectives.Step` on a block inside a shard_map body.

A :class:`Step` names one collective (or a local slice) applied to one local
block inside the body of a ``jax.shard_map``; :func:`apply_step` runs it
(:func:`einshard.core.moves.apply_to_layout` says what layout it leaves).  The shard_map of a whole einsum
is :func:`einshard.lowering.shard_einsum.einsum_shard_map`; where a lowering runs,
:mod:`einshard.lowering.placing`.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ..core.collectives import KINDS, STEP_KINDS, Step, reorder_pairs
from ..errors import EinshardError

# Where a lowering runs lives in .placing; re-exported here, where the other lowerings found it first.
from .placing import check_lowering_context, lowering_mesh, mesh_axes_of, place, restrict_spec

__all__ = [
    "KINDS",
    "STEP_KINDS",
    "Step",
    "apply_step",
    "varying_axes",
    "vary",
    "ring_size",
    "mesh_axes_of",
    "place",
    "restrict_spec",
    "check_lowering_context",
    "lowering_mesh",
]


def _axes(step: Step) -> str | tuple[str, ...]:
    return step.mesh_axes[0] if len(step.mesh_axes) == 1 else step.mesh_axes


def varying_axes(v: Any) -> frozenset[str]:
    """The mesh axes over which a value inside a shard_map body varies (its check_vma type), across JAX releases."""
    t = jax.typeof(v) if not isinstance(v, jax.ShapeDtypeStruct) else v
    found = getattr(t, "vma", None)
    if found is None:
        found = getattr(getattr(t, "manual_axis_type", None), "varying", None)
    return frozenset(found or ())


def vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``x`` typed as varying over ``axes`` too (``pcast``), so values of both kinds meet under check_vma."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def ring_size(mesh_axes: Sequence[str]) -> int:
    """The number of devices on the ring over ``mesh_axes`` (inside a shard_map body)."""
    return math.prod(jax.lax.axis_size(a) for a in mesh_axes)


def apply_step(block: jax.Array, step: Step, *, invariant: bool | Collection[str] = False) -> jax.Array:
    """Run one step on this device's block (call inside a ``jax.shard_map`` body).

    ``invariant=True`` makes an all-gather's result typed as the same on every
    device of the ring (``to="invarying"``), which a replicated out_spec needs
    under ``check_vma``; its gradient is then a local slice.  The default
    (varying) all-gather's gradient is a reduce-scatter, the right one when the
    gathered block meets data that differs per device (FSDP).  A collection of
    mesh axes makes the gather invariant over those axes only (the gather is
    then split into runs of axes, minor run first, which gives the same blocks).

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((4,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))
        >>> gather = Step('all-gather', 0, ('x',), dim=0)
        >>> body = lambda b: apply_step(b, gather, invariant=True)
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=P('x'), out_specs=P())
        >>> f(np.arange(8.0)).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    axes = _axes(step)
    if step.kind == "all-gather":
        fixed = set(step.mesh_axes) if invariant is True else set(invariant or ())
        runs: list[tuple[list[str], bool]] = []
        for m in step.mesh_axes:
            if runs and runs[-1][1] == (m in fixed):
                runs[-1][0].append(m)
            else:
                runs.append(([m], m in fixed))
        for run, inv in reversed(runs):  # minor run first: blocks stay in major-to-minor order
            name = run[0] if len(run) == 1 else tuple(run)
            block = jax.lax.all_gather(block, name, axis=step.dim, tiled=True, to="invarying" if inv else "varying")
        return block
    if step.kind == "all-reduce":
        return jax.lax.psum(block, axes)
    if step.kind == "reduce-scatter":
        return jax.lax.psum_scatter(block, axes, scatter_dimension=step.dim, tiled=True)
    if step.kind == "all-to-all":
        # The block is split along `dim` and whole along `to_dim`: cut `to_dim` in n
        # pieces, send piece j to device j, and stack what arrives along `dim`.
        return jax.lax.all_to_all(block, axes, split_axis=step.to_dim, concat_axis=step.dim, tiled=True)
    n = ring_size(step.mesh_axes)
    if step.kind == "dynamic-slice":
        assert step.dim is not None
        size = block.shape[step.dim]
        if size % n:
            raise EinshardError(f"dynamic-slice: dimension {step.dim} of size {size} does not split into {n} blocks")
        piece = size // n
        return jax.lax.dynamic_slice_in_dim(block, jax.lax.axis_index(axes) * piece, piece, step.dim)
    if step.reorder is not None:  # the same data on other devices: whole blocks, or pieces of them (a regroup)
        sizes = {m: jax.lax.axis_size(m) for m in step.mesh_axes}
        # ppermute numbers the devices of several axes in the mesh's axis order whatever order they are named in
        # (axis_index follows the named order), so the ring is named in mesh order for both.
        order = jax.sharding.get_abstract_mesh().axis_names
        ring = tuple(sorted(step.mesh_axes, key=lambda m: order.index(m) if m in order else len(order)))
        pairs, pieces = reorder_pairs(ring, sizes, *step.reorder)
        me = jax.lax.axis_index(ring)
        for d, piece_of in pieces.items():
            before, after = step.reorder[0][d], step.reorder[1][d]
            n = math.prod(sizes.get(m, 1) for m in after) // math.prod(sizes.get(m, 1) for m in before)
            if n > 1:
                size = block.shape[d] // n
                start = jnp.asarray(piece_of, dtype=jnp.int32)[me] * size
                block = jax.lax.dynamic_slice_in_dim(block, start, size, d)
        return jax.lax.ppermute(block, ring, pairs)
    # collective-permute: a cyclic shift around the ring
    perm = [(j, (j + step.shift) % n) for j in range(n)]
    return jax.lax.ppermute(block, axes, perm)
