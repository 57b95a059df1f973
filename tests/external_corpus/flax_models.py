"""Flax linen's own layers: a scanned stack of remat blocks, and a convolutional net, tiny.

* ``flax_scan``: ``nn.scan(nn.remat(Block))`` over 3 layers (parameters stacked on a leading axis), each block
  ``nn.LayerNorm``, ``nn.SelfAttention`` and a ``nn.Dense`` MLP — the linen idiom for deep stacks;
* ``flax_cnn``: ``nn.Conv`` (stride 1 and 2), ``nn.avg_pool``, ``nn.max_pool`` (SAME), ``nn.GroupNorm`` and a
  ``nn.Dense`` head over pooled features, with an integer-label cross-entropy.
"""

from __future__ import annotations

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

from . import Family

B, S, D, F, H, L = 8, 8, 32, 64, 4, 3
HW, CLASSES = 16, 10

_X = "b s d -> b@data s d"
# Megatron on linen's stacked kernels.  Names follow construction order: in ``nn.Dense(D)(gelu(nn.Dense(F)(y)))``
# the outer (down) Dense is made first, Dense_0; the inner (up) one is Dense_1.
_MEGATRON = (
    (r"(query|key|value)'\]\['kernel", "l d h k -> l d h@model k"),
    (r"(query|key|value)'\]\['bias", "l h k -> l h@model k"),
    (r"out'\]\['kernel", "l h k d -> l h@model k d"),
    (r"Dense_1'\]\['kernel", "l d f -> l d f@model"),
    (r"Dense_1'\]\['bias", "l f -> l f@model"),
    (r"Dense_0'\]\['kernel", "l f d -> l f@model d"),
)
_FSDP = ((r"kernel", "l a b -> l a@data b"), (r"kernel", "l a b c -> l a@data b c"))


@cache
def scan_stack() -> Family:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y = nn.LayerNorm()(x)
            x = x + nn.SelfAttention(num_heads=H, qkv_features=D)(y)
            y = nn.LayerNorm()(x)
            return x + nn.Dense(D)(nn.gelu(nn.Dense(F)(y))), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            stack = nn.scan(nn.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True}, length=L)
            return stack()(x, None)[0]

    net = Net()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    target = jnp.asarray(rng.normal(size=(B, S, D)), jnp.float32)
    params = net.init(jax.random.key(0), x)

    def loss(p, batch):
        inputs, wanted = batch
        return jnp.mean((net.apply(p, inputs) - wanted) ** 2)

    rules = {"dp": (), "tp": _MEGATRON, "dp_tp": _MEGATRON, "fsdp": _FSDP}
    batch_rules = {"dp": (_X, _X), "tp": ("b s d -> b s d",) * 2, "dp_tp": (_X, _X), "fsdp": (_X, _X)}
    return Family("flax_scan", "flax", "scan-remat", loss, params, (x, target), rules, batch_rules)


@cache
def cnn() -> Family:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
            x = nn.max_pool(x, (2, 2), (2, 2), padding="SAME")
            x = nn.GroupNorm(num_groups=4)(x)
            return nn.Dense(CLASSES)(x.mean((1, 2)))

    net = CNN()
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(B, HW, HW, 3)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, CLASSES, size=(B,)), jnp.int32)
    params = net.init(jax.random.key(0), x)

    def loss(p, batch):
        images, wanted = batch
        logits = net.apply(p, images)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), wanted[:, None], 1))

    channels = ((r"Conv_\d'\]\['kernel", "h w i o -> h w i o@model"), (r"Conv_\d'\]\['bias", "o -> o@model"))
    fsdp = ((r"Conv_\d'\]\['kernel", "h w i o -> h w i o@data"), (r"Dense.*kernel", "a b -> a@data b"))
    image, label = "b h w c -> b@data h w c", "b -> b@data"
    rules = {"dp": (), "tp": channels, "dp_tp": channels, "fsdp": fsdp, "spatial": ()}
    batch_rules = {
        "dp": (image, label),
        "tp": ("b h w c -> b h w c", "b -> b"),
        "dp_tp": (image, label),
        "fsdp": (image, label),
        "spatial": ("b h w c -> b@data h@model w c", label),
    }
    return Family("flax_cnn", "flax", "conv", loss, params, (x, labels), rules, batch_rules)
