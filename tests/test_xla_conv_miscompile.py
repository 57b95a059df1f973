"""XLA computes a conv's gradient wrong when a 3-row kernel is split unevenly and the image rows are split too.

The external corpus's ``auto-kh_resnet-spatial-grad`` (keras-hub ResNet, image rows over 'model', batch over
'data', Auto mesh) gives gradients that differ from the unsharded step's (up to 3× the largest reference value,
from ``stack1_block0_1`` up to the stem).  The same step on an Explicit mesh is right, and explain plays no part
in the values: this file holds the minimal program, plain JAX, no einshard.

What triggers it (measured on jax 0.10.2, XLA:CPU, 8 simulated devices, with Shardy and with GSPMD alike):

* the gradient of a 3×3 SAME conv taken with respect to both the kernel and the image,
* the image's rows split over a mesh axis with **one row per device** (H=2 over 2; H=4 over 2 is right),
  and the batch over another axis,
* the kernel's 3 rows split over the same 2 devices, which XLA pads to 4 (in the ResNet, Auto-mode propagation
  chooses that split itself: the compiled step all-gathers a padded ``f32[4,3,64,64]`` kernel and
  collective-permutes the reversed kernel, ``transpose(jvp(stack1_block0_2_conv))/rev``, at the 2×2 stage).

Measured (allclose with rtol=1e-3, atol=1e-5, the corpus's tolerance):

* (2, 2) mesh, B=2, H=2, C=2: ``dw`` max |sharded − unsharded| = 77.2 against max |unsharded| = 154.4 (Shardy);
  GSPMD: ``dw`` 38.6 of 38.6, ``dx`` 91.0 against 30.3;
* (4, 2) mesh, B=8, H=2, C=8: ``dw`` 2630 against 3507 (Shardy); (4, 2), B=4, H=2, C=1: ``dw`` 208 of 222 and
  ``dx`` 92.6 of 98.8;
* (2, 2), B=2, H=4, C=2 and (4, 2), B=8, H=4, C=8: right (1.5e-5 and 2.4e-4 of 122 and 652).

The test below asserts the values XLA should give; it is a strict xfail, so a JAX/XLA upgrade that fixes the
partitioner shows up as XPASS (then drop the xfail here and the case from tests/external_corpus/known_misses.json).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def _conv(x: Any, w: Any) -> Any:
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def _gradients(mesh_shape: tuple[int, int], batch: int, rows: int, channels: int) -> tuple[Any, Any]:
    """(sharded, unsharded) gradients of sum(conv(x, w)²) with respect to (w, x)."""
    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, rows, rows, channels)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 3, channels, channels)), jnp.float32)

    def loss(w: Any, x: Any) -> Any:
        # The kernel's 3 rows over the 2 'model' devices (padded to 4), as Auto propagation splits it in the ResNet.
        w = lax.with_sharding_constraint(w, NamedSharding(mesh, P("model")))
        return jnp.sum(_conv(x, w) ** 2)

    grad = jax.grad(loss, argnums=(0, 1))
    unsharded = jax.jit(grad)(w, x)
    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, P("data", "model")))
    with jax.set_mesh(mesh):
        sharded = jax.jit(grad, in_shardings=shardings)(*jax.device_put((w, x), shardings))
    return sharded, unsharded


def _close(a: Any, b: Any) -> bool:
    return all(np.allclose(np.asarray(p), np.asarray(q), rtol=1e-3, atol=1e-5) for p, q in zip(a, b, strict=True))


def test_the_same_program_with_two_rows_per_device_is_right() -> None:
    """The control: H=4 over 2 devices (two rows each) compiles to the right gradients."""
    assert _close(*_gradients((2, 2), batch=2, rows=4, channels=2))


@pytest.mark.xfail(
    strict=True,
    reason="XLA (jax 0.10.2) miscompiles a conv gradient with one image row per device and a padded kernel-row split",
)
def test_xla_one_row_per_device_and_an_uneven_kernel_row_split() -> None:
    assert _close(*_gradients((2, 2), batch=2, rows=2, channels=2))
