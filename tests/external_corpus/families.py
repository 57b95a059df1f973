"""The registry of families: name -> builder (each builds lazily, once: keras-hub models take seconds)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from . import (
    Family,
    equinox_encoders,
    equinox_models,
    flax_models,
    flax_nnx,
    haiku_stack,
    keras_hub_decoders,
    keras_hub_gpt,
    keras_hub_resnet,
    keras_hub_t5,
    keras_vit,
    unseen_models,
)

FAMILIES: dict[str, Callable[[], Family]] = {
    "kh_resnet": keras_hub_resnet.resnet,
    "kh_mixtral": keras_hub_decoders.mixtral,
    "kh_llama": keras_hub_decoders.llama,
    "kh_t5": keras_hub_t5.t5,
    "hk_stack": haiku_stack.stack,
    "keras_vit": keras_vit.vit,
    "eqx_rotary": equinox_models.rotary,
    "eqx_gru": equinox_models.gru,
    "flax_scan": flax_models.scan_stack,
    "flax_cnn": flax_models.cnn,
    "nnx_gpt": flax_nnx.gpt,
    "nnx_scan": flax_nnx.scan,
    "eqx_bert": equinox_encoders.bert,
    "eqx_mixer": equinox_encoders.mixer,
    "kh_gpt2": keras_hub_gpt.gpt2,
    "kh_gemma": keras_hub_gpt.gemma,
    # Session 16's probe of models the corpus did not hold (benchmarks/unseen_probe.py).
    **unseen_models.FAMILIES,
}

# The families with a "large" size for planning (each builder's SIZES): a step that replicated, computed whole on
# each of the 8 simulated devices, is slow and large enough that data, tensor and fully sharded splits must win.
LARGE: dict[str, Callable[[], Family]] = {
    "kh_llama": partial(keras_hub_decoders.llama, "large"),
    "hk_stack": partial(haiku_stack.stack, "large"),
}
