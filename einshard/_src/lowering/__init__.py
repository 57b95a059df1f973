"""Lowering: explicit ``jax.shard_map`` programs for sharded einsums, collective matmuls, pipelines and DP/FSDP.

This layer moves data.  It follows the analyzer (einsum.py runs its plans); the analyzer never imports it.
"""

import jax
from jax.sharding import PartitionSpec

from .. import _checks
from .._checks import RULES as _RULES
from .._checks import checked as _checked
from ..core.moves import apply_to_layout as step_layout  # the public name of core.moves.apply_to_layout
from .collective_matmul import SCHEDULES, allgather_einsum, einsum_reduce_scatter, ring_shift
from .padding import Padding, pad_operands, plan_padding, unpad_result
from .pipeline import PipelineEnd, PipelineInfo, circular_layer_order, pipeline, pipeline_info
from .pipeline_stages import vocab_parallel_cross_entropy, vocab_parallel_embed
from .shard_einsum import einsum_auto, einsum_layouts, einsum_shard_map
from .steps import KINDS, STEP_KINDS, Step, apply_step
from .training import data_parallel, fsdp, fsdp_layouts, gather_params


def _padding_rule(value: object, where: str, name: str, arguments: dict[str, object]) -> object:
    if not isinstance(value, Padding):
        return _checks.fail(where, name, "a Padding (from plan_padding)", value)
    return value


_RULES["padding"] = _padding_rule

# The public names of the kernels that run inside jax.shard_map, and of the helpers, check their arguments by
# name (einshard._checks.RULES); einshard's own programs call the unchecked functions of their modules.
allgather_einsum = _checked(allgather_einsum, "einshard.lowering.allgather_einsum")
einsum_reduce_scatter = _checked(einsum_reduce_scatter, "einshard.lowering.einsum_reduce_scatter")
ring_shift = _checked(ring_shift, "einshard.lowering.ring_shift")
vocab_parallel_cross_entropy = _checked(
    vocab_parallel_cross_entropy, "einshard.lowering.vocab_parallel_cross_entropy", axis=_RULES["axis_name"]
)
vocab_parallel_embed = _checked(
    vocab_parallel_embed, "einshard.lowering.vocab_parallel_embed", axis=_RULES["axis_name"]
)
gather_params = _checked(
    gather_params,
    "einshard.lowering.gather_params",
    axis=_RULES["axis_name"],
    name=lambda v, where, name, args: _checks.check_optional_str(v, where, name),
    specs=lambda v, where, name, args: (
        v
        if all(
            isinstance(s, PartitionSpec)
            for s in jax.tree_util.tree_leaves(v, is_leaf=lambda s: isinstance(s, PartitionSpec))
        )
        and bool(
            jax.tree_util.tree_structure(v, is_leaf=lambda s: isinstance(s, PartitionSpec))
            == jax.tree_util.tree_structure(args["blocks"])  # type: ignore[operator]
        )
        else _checks.fail(where, name, "a PartitionSpec per block (a pytree like blocks=)", v)
    ),
)
circular_layer_order = _checked(circular_layer_order, "einshard.lowering.circular_layer_order")
step_layout = _checked(step_layout, "einshard.lowering.step_layout")
apply_step = _checked(apply_step, "einshard.lowering.apply_step")
pad_operands = _checked(
    pad_operands,
    "einshard.lowering.pad_operands",
    operands=lambda v, where, name, args: (
        v
        if isinstance(v, (tuple, list))
        and len(v) == len(args["padding"].shapes)
        and all(tuple(getattr(x, "shape", ())) == tuple(s) for x, s in zip(v, args["padding"].shapes))
        else _checks.fail(where, name, f"the operands of shapes {args['padding'].shapes}", v)
    ),
)
unpad_result = _checked(
    unpad_result,
    "einshard.lowering.unpad_result",
    y=lambda v, where, name, args: (
        v
        # (a leading axis of per-device partial sums may come first: pending sums {U:...})
        if tuple(getattr(v, "shape", ()))[-len(args["padding"].padded_output_shape) or len(getattr(v, "shape", ())) :]
        == tuple(args["padding"].padded_output_shape)
        and _checks.check_dtype(getattr(v, "dtype", None), where, name, optional=False) is not None
        else _checks.fail(where, name, f"the padded result, of shape {args['padding'].padded_output_shape}", v)
    ),
)
plan_padding = _checked(plan_padding, "einshard.lowering.plan_padding")
einsum_layouts = _checked(einsum_layouts, "einshard.lowering.einsum_layouts")

__all__ = [
    "Padding",
    "PipelineEnd",
    "PipelineInfo",
    "pad_operands",
    "plan_padding",
    "unpad_result",
    "circular_layer_order",
    "data_parallel",
    "fsdp",
    "fsdp_layouts",
    "gather_params",
    "pipeline",
    "pipeline_info",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embed",
    "KINDS",
    "STEP_KINDS",
    "SCHEDULES",
    "Step",
    "allgather_einsum",
    "apply_step",
    "einsum_layouts",
    "einsum_auto",
    "einsum_reduce_scatter",
    "einsum_shard_map",
    "ring_shift",
    "step_layout",
]
