"""The registry of external cases: every family × its strategies × (fwd, grad) × (Auto, Explicit) mesh."""

from __future__ import annotations

import json
from pathlib import Path

from .compare import case_id

# Strategies per family (the families' rules define them; ep and spatial only where they apply).
STRATEGIES: dict[str, tuple[str, ...]] = {
    "kh_resnet": ("dp", "tp", "dp_tp", "fsdp", "spatial"),
    "kh_mixtral": ("dp", "tp", "dp_tp", "fsdp", "ep"),
    "kh_llama": ("dp", "tp", "dp_tp", "fsdp"),
    "kh_t5": ("dp", "tp", "dp_tp", "fsdp"),
    "hk_stack": ("dp", "tp", "dp_tp", "fsdp"),
    "keras_vit": ("dp", "tp", "dp_tp", "fsdp"),
    "eqx_rotary": ("dp", "tp", "dp_tp", "fsdp"),
    "eqx_gru": ("dp", "tp", "dp_tp", "fsdp"),
    "flax_scan": ("dp", "tp", "dp_tp", "fsdp"),
    "flax_cnn": ("dp", "tp", "dp_tp", "fsdp", "spatial"),
    "nnx_gpt": ("dp", "tp", "dp_tp", "fsdp"),
    "nnx_scan": ("dp", "tp", "dp_tp", "fsdp"),
    "eqx_bert": ("dp", "tp", "dp_tp", "fsdp"),
    "eqx_mixer": ("dp", "tp", "dp_tp", "fsdp"),
    "kh_gpt2": ("dp", "tp", "dp_tp", "fsdp"),
    "kh_gemma": ("dp", "tp", "dp_tp", "fsdp"),
    # Session 16's probe (unseen_models.py): depthwise conv, BatchNorm, LSTM, encoder-decoder, BERT, Mistral.
    "eqx_dwconv": ("dp", "tp", "dp_tp", "fsdp"),
    "flax_bn": ("dp", "tp", "dp_tp", "fsdp"),
    "flax_lstm": ("dp", "tp", "dp_tp", "fsdp"),
    "flax_encdec": ("dp", "tp", "dp_tp", "fsdp"),
    "kh_bert": ("dp", "tp", "dp_tp", "fsdp"),
    "kh_mistral": ("dp", "tp", "dp_tp", "fsdp"),
}
MODES = ("fwd", "grad")
# The families whose training step (loss, grad and the optimizer update: Family.step) is a case of its own too.
STEP_MODES: dict[str, tuple[str, ...]] = {
    "nnx_gpt": ("step",),
    "nnx_scan": ("step",),
    "flax_bn": ("step",),  # optax.chain(clip_by_global_norm, adamw with a weight-decay mask)
    "flax_encdec": ("step",),  # optax.adafactor (factored second moments)
}
KINDS = ("auto", "explicit")

CASES: tuple[tuple[str, str, str, str], ...] = tuple(
    (family, strategy, mode, kind)
    for family, strategies in STRATEGIES.items()
    for strategy in strategies
    for mode in MODES + STEP_MODES.get(family, ())
    for kind in KINDS
)
IDS = {case_id(*c): c for c in CASES}

# The default run's cases (fast: a few, both mesh kinds, three libraries); the rest are slow.
# Measured (benchmarks/results/external_table.json): T5 matches XLA, the Llama on Explicit runs in auto_axes and
# says it is incomplete (split, stack), the Haiku scan over remat blocks matches per iteration; the Flax NNX AdamW
# step (Megatron, Explicit), Gemma's vocabulary-parallel soft-capped head and the Equinox Mixer's token/channel
# transposes under tp match.
FAST: frozenset[str] = frozenset(
    {
        "auto-kh_t5-tp-grad",
        "explicit-kh_llama-tp-grad",
        "auto-hk_stack-dp-grad",
        "explicit-nnx_gpt-tp-step",
        "explicit-kh_gemma-tp-fwd",
        "auto-eqx_mixer-tp-grad",
    }
)

# Cases where explain is, today, complete and wrong, or raises: strict xfails with the cause, for the rules work.
# Regenerate the evidence with benchmarks/external_table.py (docs/analysis.md lists every miss).
KNOWN_MISSES: dict[str, str] = json.loads((Path(__file__).parent / "known_misses.json").read_text())
