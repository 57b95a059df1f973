"""Layout rules for tiling, matrix factorisations and Fourier transforms.

Each rule states what XLA's SPMD partitioner compiles for the op (one-op programs on the 8-CPU-device mesh,
read from ``.compile().as_text()``; tests/test_linalg_rules.py holds them against XLA by hypothesis draws):

* ``tile`` (``jnp.tile``; Equinox's rotary embedding): an axis repeated more than once loses its split —
  XLA broadcasts the operand to (repeats, size) per axis and all-gathers that, one collective per mesh axis,
  each as large as the tiled result's block; an axis repeated once keeps its split;
* matrix factorisations and solves (``qr``, ``svd``, ``lu``, ``cholesky``, ``eigh``, ``triangular_solve``…,
  Keras' ``ops.qr``/``lstsq``/``lu_factor``): the two trailing (matrix) axes of every operand are gathered,
  the leading (batch) axes keep their splits, and every result keeps the first operand's batch splits;
* ``fft``: jax 0.10's XLA gathers the operand whole (every split, batch axes too), transforms, and slices the
  result back to the operand's splits on every axis whose length the transform keeps; jax 0.12's gathers only the
  transformed axes (:mod:`.xla_behaviour`'s ``fft_keeps_other_splits``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ...core.layout import Layout
from .costing import is_free
from .movement import itemsize, mark_approximate
from .registry import register
from .report import OpBound
from .xla_behaviour import xla_behaviour

if TYPE_CHECKING:
    from .registry import WalkerLike as Walker

__all__ = ["tile", "matrix_op", "fft", "MATRIX_OPS"]


@register("tile")
def tile(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(src):
        return [w.free(out_aval)]
    reps = tuple(int(r) for r in eqn.params["reps"])
    kept = [d if r == 1 else () for d, r in zip(src.dims, reps)]
    if kept == list(src.dims):
        return [w.relayout(out_aval, kept)]
    # XLA gathers the broadcast (repeats, size) form, not the operand: bytes as the tiled result's block.
    # Each repeated axis's split divides the result (a multiple of the operand's axis) as it divided the operand.
    before = w.relayout(out_aval, src.dims)
    after = _gather_minor_first(w, eqn, phase, before, kept, out_aval.dtype, repeat, "tile repeats a split axis")
    # XLA holds that gathered broadcast (a collective's result is a buffer, whatever fuses after it): peak
    # memory counts it as a gathered copy of the operand the size of the result's block.
    w.bind_copy(eqn.invars[0], after)
    return [after]


# Matrix ops: the trailing two axes of each operand are one matrix (a triangular solve's right-hand side too).
MATRIX_OPS = (
    "qr",
    "svd",
    "lu",
    "cholesky",
    "eigh",
    "eig",
    "schur",
    "triangular_solve",
    "householder_product",
    "tridiagonal",
)


@register(*MATRIX_OPS)
def matrix_op(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    batch: list[tuple[str, ...]] = []
    for i, lay in enumerate(ins):
        if is_free(lay) or not lay.dims:
            continue
        n = max(len(lay.dims) - 2, 0)
        want = [*lay.dims[:n], *(() for _ in lay.dims[n:])]
        why = f"{eqn.primitive.name} needs whole matrices"
        _gather_minor_first(w, eqn, phase, lay, want, eqn.invars[i].aval.dtype, repeat, why)
        if not batch:
            batch = list(lay.dims[:n])
    outs = []
    for v in eqn.outvars:
        shape = tuple(getattr(v.aval, "shape", ()))
        dims = [batch[i] if i < len(batch) and i < len(shape) else () for i in range(len(shape))]
        # Pivots and singular values have one axis fewer than the matrices: batch axes lead all the same.
        outs.append(w.relayout(v.aval, dims) if batch else w.replicated(v.aval))
    return outs


@register("fft")
def fft(w: Walker, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    src, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(src):
        return [w.free(out_aval)]
    rank, touched = len(src.dims), len(eqn.params["fft_lengths"])
    out_shape = tuple(int(s) for s in out_aval.shape)
    if xla_behaviour().fft_keeps_other_splits:
        # Newer XLA (jax 0.12): with the transformed axes whole, each device transforms its block where it is.
        if not any(src.dims[rank - touched :]):
            return [w.relayout(out_aval, list(src.dims))]
        # A transformed axis split: XLA gathers it (measured: (4, 4, 4) rows@b, last axis@a: one all-gather over
        # a), though on small operands it was seen gathering the other splits too; the mark's bound is that.
        start = len(w.ops)
        want: list[tuple[str, ...]] = [d if i < rank - touched else () for i, d in enumerate(src.dims)]
        _gather_minor_first(w, eqn, phase, src, want, eqn.invars[0].aval.dtype, repeat, "fft gathers its axes")
        operand_bytes = math.prod(src.shape) * itemsize(eqn.invars[0].aval.dtype)
        bound = OpBound(sum(1 for d in src.dims if d), float(operand_bytes), float(operand_bytes))
        mark_approximate(w, start, "fft of a split transformed axis: XLA may gather the other splits too", bound)
        kept = [d if i < rank - touched or out_shape[i] == src.shape[i] else () for i, d in enumerate(src.dims)]
        return [w.relayout(out_aval, kept)]
    whole: list[tuple[str, ...]] = [() for _ in src.dims]
    _gather_minor_first(w, eqn, phase, src, whole, eqn.invars[0].aval.dtype, repeat, "fft gathers its operand")
    # The result is sliced back to the operand's splits wherever its axis kept its length (a real transform's
    # last axis, n -> n/2 + 1, does not: that axis stays whole).
    kept = [d if out_shape[i] == src.shape[i] else () for i, d in enumerate(src.dims)]
    return [w.relayout(out_aval, kept)]


def _gather_minor_first(
    w: Walker, eqn: Any, phase: str, src: Layout, want: list[tuple[str, ...]], dtype: Any, repeat: int, why: str
) -> Layout:
    """Gather ``src`` to ``want`` (a layout with some splits dropped) one axis at a time, the minor axis first.

    That is XLA's order for these ops (measured: an operand split over (a, b) on two axes is gathered over b
    on the a-split block first, then over a on the whole): the bytes sent grow axis by axis.
    """
    dims, before = list(src.dims), src
    for i in reversed(range(len(dims))):
        if dims[i] != want[i]:
            dims[i] = want[i]
            step = src.with_dims(tuple(dims))
            w.change(eqn, phase, before, step, dtype, repeat, why)
            before = step
    return before
