"""keras-hub's ResNet backbone (basic blocks, batch norm in training mode, strided convs, max pooling), tiny."""

from __future__ import annotations

from functools import cache

import jax.numpy as jnp
import numpy as np

from . import Family
from ._keras import pure_loss

B, HW, C = 8, 16, 64

_IMG = "b h w c -> b@data h w c"
_FEAT = "b c -> b@data c"
# Channel split: every conv's output channels over 'model' (XLA gathers or reduces between convs).
_CHANNELS = ((r"kernel", "h w i o -> h w i o@model"),)
_FSDP = ((r"kernel", "h w i o -> h w i o@data"),)


def _head(out, p, target):
    return jnp.mean((jnp.mean(out, axis=(1, 2)) - target) ** 2)


@cache
def resnet() -> Family:
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    model = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64],
        input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64, 64],
        stackwise_num_blocks=[1, 1],
        stackwise_num_strides=[1, 2],
        block_type="basic_block",
        use_pre_activation=False,
        image_shape=(HW, HW, 3),
        dtype="float32",
    )
    loss, params = pure_loss(model, _head)
    rng = np.random.default_rng(0)
    batch = (
        jnp.asarray(rng.normal(size=(B, HW, HW, 3)), jnp.float32),
        jnp.asarray(rng.normal(size=(B, C)), jnp.float32),
    )
    rules = {"dp": (), "tp": _CHANNELS, "dp_tp": _CHANNELS, "fsdp": _FSDP, "spatial": ()}
    batch_rules = {
        "dp": (_IMG, _FEAT),
        "tp": ("b h w c -> b h w c", "b c -> b c"),
        "dp_tp": (_IMG, _FEAT),
        "fsdp": (_IMG, _FEAT),
        # Spatial: image rows over 'model' (convs need halo rows from the neighbour), batch over 'data'.
        "spatial": ("b h w c -> b@data h@model w c", _FEAT),
    }
    return Family("kh_resnet", "keras-hub", "conv", loss, params, batch, rules, batch_rules)
