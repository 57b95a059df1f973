"""Layout rules for typed PRNG keys' primitives: ``random_split``, ``random_bits``, ``random_wrap``,
``random_unwrap``, ``random_fold_in`` (``random_seed`` and ``random_clone`` keep their shape: elementwise).

A key array ``key<fry>[B...]`` is a batch of keys: every key is computed from its own key alone (JAX lowers these
ops as the impl's hash applied to each key, batched), so the batch dimensions keep the operand's split and nothing
moves.  The dimensions an op adds after the batch (``random_split``'s new keys, ``random_bits``' sample shape,
``random_unwrap``'s key data words) are made whole on each device: XLA computes each key's samples where the key
lives (measured: ``vmap(split)`` / ``vmap(bits)`` / ``key_data`` of ``keys[16@a]`` compile to no collective, their
results split over ``a`` on the batch only).  The key data's trailing words (``random_wrap``'s operand) are never
split: a split there is gathered first, as XLA must to hash a whole key.
"""

from __future__ import annotations

import math
from typing import Any

from ..._compat import dtype_itemsize
from ...core.layout import Layout
from .costing import is_free
from .movement import charge
from .registry import WalkerLike, register

# Imported first so that its elementwise rule (values.ELEMENTWISE lists random_bits, random_wrap and random_unwrap,
# which memory fuses as elementwise) is registered before this module's replace it, whatever order the package
# imports the rules modules in.
from . import rules_structural  # isort: skip

__all__ = ["KEY_BATCH_OPS", "COUNTER_BITS", "FIRST_KEY_ONLY", "batch_then_whole", "first_key_slices", "key_impl"]

# The ops whose result is the key batch's dimensions followed by new whole ones (random_wrap reads them the other
# way round: its operand has the trailing words, its result the batch alone).
KEY_BATCH_OPS = ("random_split", "random_bits", "random_unwrap")


def batch_then_whole(batch: tuple[tuple[str, ...], ...], rank: int) -> tuple[tuple[str, ...], ...]:
    """The dims of a value of ``rank`` whose leading dimensions are the batch's (their split kept) and whose
    trailing ones are whole."""
    return tuple(batch) + ((),) * (rank - len(batch))


# The ops whose result a device can make any piece of from whole keys (their hash is elementwise in its counters).
COUNTER_BITS = frozenset({"random_bits"})

# The impls whose batched op JAX does not lower key by key: rbg and unsafe_rbg draw a batch's bits (unsafe_rbg
# splits it too) with XLA's RngBitGenerator from the batch's first key.  XLA slices that key out of the split batch
# (an all-reduce of its words over the batch's mesh axes, the masked pieces summed) and computes the whole result
# on every device (measured: vmap of bits (16,) over rbg keys[256@a]: one all-reduce of 16 B, the result P()).
FIRST_KEY_ONLY: dict[str, frozenset[str]] = {
    "random_bits": frozenset({"rbg", "unsafe_rbg"}),
    "random_split": frozenset({"unsafe_rbg"}),
}


def key_impl(dtype: Any) -> str | None:
    """The name of a key dtype's impl (``'threefry2x32'``, ``'rbg'``, ``'unsafe_rbg'``), else None."""
    return getattr(getattr(dtype, "_impl", None), "name", None)


def first_key_slices(batch: Layout) -> list[tuple[int, tuple[str, ...]]]:
    """The all-reduces XLA slices a split batch's first key with: one per split dimension, the last first (measured:
    keys[8, 8@a] sends 8 keys, the first of each row, then slices the row locally; keys[8@a, 8] slices the row
    first, then sends 1 key; keys[8@b, 8@a] sends 4 keys over a, then 1 over b)."""
    return [(i, batch.dims[i]) for i in reversed(range(len(batch.dims))) if batch.dims[i]]


@register(*KEY_BATCH_OPS)
def key_batch(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """``random_split[shape]``, ``random_bits[shape]``, ``random_unwrap``: the keys' batch split carries through
    (but where the impl draws from the first key alone: :data:`FIRST_KEY_ONLY`)."""
    out_aval, keys = eqn.outvars[0].aval, eqn.invars[0].aval
    if is_free(ins[0]):
        return [w.free(out_aval)]
    first_key_only = key_impl(keys.dtype) in FIRST_KEY_ONLY.get(eqn.primitive.name, frozenset())
    if eqn.primitive.name in COUNTER_BITS and not any(ins[0].dims):
        # Bits from keys whole on every device: each device can make any piece of them (threefry is elementwise in
        # its counters; XLA:CPU expands rbg's RngBitGenerator into an elementwise loop too), so their readers
        # choose their layout, as XLA's propagation does on Auto axes (x[64@a, 128] * bernoulli(key, 0.9,
        # x.shape) makes each device's eighth of the bits, threefry or rbg keys; measured, tests/test_memory_rules.py's
        # random-bits tests).  Not new keys (random_split) nor key data (random_unwrap): those are buffers XLA
        # makes whole where the keys are whole (tests/test_prng_rules.py's split draws).
        return [w.free(out_aval)]
    if any(ins[0].dims) and first_key_only:
        why = f"{eqn.primitive.name} of {keys.dtype} keys draws from the batch's first key, whole on every device"
        for i, axes in first_key_slices(ins[0]):
            rows = math.prod(ins[0].shard_shape[:i])  # the dims before i are still whole on the device
            charge(w, eqn, phase, repeat, "all-reduce", axes, [rows * dtype_itemsize(keys.dtype)], why)
        return [w.replicated(out_aval)]
    return [w.relayout(out_aval, batch_then_whole(ins[0].dims, len(out_aval.shape)))]


@register("random_wrap")
def wrap(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """``random_wrap``: key data ``u32[B..., words]`` to keys ``key[B...]``: the batch split carries through; a
    split of the words is gathered first (a key is hashed whole)."""
    data, out_aval = ins[0], eqn.outvars[0].aval
    if is_free(data):
        return [w.free(out_aval)]
    batch = len(out_aval.shape)
    if any(data.dims[batch:]):
        whole = data.with_dims(batch_then_whole(data.dims[:batch], len(data.shape)), data.unreduced)
        w.change(eqn, phase, data, whole, eqn.invars[0].aval.dtype, repeat, "a key's data words are hashed whole")
    return [w.relayout(out_aval, tuple(data.dims[:batch]))]


@register("random_fold_in")
def fold_in(w: WalkerLike, eqn: Any, ins: list[Layout], repeat: int, phase: str) -> list[Layout]:
    """``random_fold_in(keys, msgs)``: elementwise (each key folds its own message), but for unsafe_rbg keys, whose
    fold_in hashes the messages' first element into one key for the whole batch: XLA slices it out of split
    messages (all-reduces of the key's words, as :func:`first_key_slices`) and XORs it into the keys where they lie
    (measured: keys[8] whole, msgs[8@a]: one all-reduce of 16 B, the result whole; msgs whole: nothing moves)."""
    keys, msgs = ins[0], ins[1] if len(ins) > 1 else None
    if key_impl(eqn.invars[0].aval.dtype) != "unsafe_rbg" or msgs is None:
        return rules_structural.elementwise(w, eqn, ins, repeat, phase)
    if not is_free(msgs) and any(msgs.dims):
        why = "unsafe_rbg's fold_in hashes the first message into one key for the batch"
        for i, axes in first_key_slices(msgs):
            rows = math.prod(msgs.shard_shape[:i])
            charge(w, eqn, phase, repeat, "all-reduce", axes, [rows * dtype_itemsize(eqn.invars[0].aval.dtype)], why)
    out_aval = eqn.outvars[0].aval
    return [w.free(out_aval) if is_free(keys) else w.relayout(out_aval, tuple(keys.dims))]
