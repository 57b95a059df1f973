"""Lowering: explicit ``jax.shard_map`` programs for sharded einsums, collective matmuls, pipelines and DP/FSDP.

This layer moves data.  It follows the analyzer (einsum.py runs its plans); the analyzer never imports it.
"""

from .collective_matmul import SCHEDULES, allgather_einsum, einsum_reduce_scatter, ring_shift
from .padding import Padding, pad_operands, plan_padding, unpad_result
from .pipeline import PipelineEnd, PipelineInfo, circular_layer_order, pipeline, pipeline_info
from .pipeline_stages import vocab_parallel_cross_entropy, vocab_parallel_embed
from .shard_einsum import einsum_auto, einsum_layouts, einsum_shard_map
from .steps import KINDS, STEP_KINDS, Step, apply_step, step_layout
from .training import data_parallel, fsdp, fsdp_layouts, gather_params

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
