"""The registry of families: name -> builder (each builds lazily, once: keras-hub models take seconds)."""

from __future__ import annotations

from collections.abc import Callable

from . import (
    Family,
    equinox_models,
    flax_models,
    haiku_stack,
    keras_hub_decoders,
    keras_hub_resnet,
    keras_hub_t5,
    keras_vit,
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
}
