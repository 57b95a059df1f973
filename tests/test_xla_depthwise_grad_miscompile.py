"""XLA sums a grouped conv's kernel gradient over a mesh axis that does not split the batch.

The external corpus's ``eqx_dwconv`` dp and fsdp gradients (an Equinox depthwise ``Conv2d``, ``groups=C``, batch
over 'data' of a (4, 2) mesh, Auto and Explicit) give a depthwise kernel gradient exactly twice the unsharded one
(the idle 'model' axis's size); every other leaf equals the unsharded one and a float64 reference to 1e-8, so this
is no GroupNorm float noise.  explain plays no part in the values: this file holds the minimal program, plain JAX.

What triggers it (measured on jax 0.10.2, XLA:CPU, 8 simulated devices):

* the kernel gradient of a conv with ``feature_group_count > 1`` (its transpose is a ``batch_group_count`` conv
  summing over the batch), the batch split over one axis of a 2-D mesh and the other axis idle;
* the compiled program all-reduces the per-device partial kernel gradient with ``replica_groups={{0,1,2,3}}`` on
  a (2, 2) mesh, the whole mesh, where only the 'data' groups ``{{0,2},{1,3}}`` hold distinct batch rows: each
  row's contribution is counted once per 'model' device.

Measured (allclose with rtol=1e-3, atol=1e-5, the corpus's tolerance): (2, 2), B=2, C=2, 1x1 kernel, groups=2:
``dw`` = 2.000x the unsharded one; (4, 2), B=8, C=16, 3x3, groups=16 (the corpus's block): 2.000x; groups=4:
2.000x; Explicit axes alike.  Right: ``feature_group_count=1``, 1-D meshes, and the batch over both axes.

The xfail below asserts the values XLA should give; it is strict, so a JAX/XLA upgrade that fixes the partitioner
shows up as XPASS (then drop the xfail here and the eqx_dwconv dp/fsdp gradients from
tests/external_corpus/known_misses.json).
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


def _conv(x: Any, w: Any, groups: int) -> Any:
    return lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"), feature_group_count=groups
    )


def _kernel_gradients(
    mesh_shape: tuple[int, ...], batch_spec: P, groups: int, axis_type: AxisType = AxisType.Auto
) -> tuple[Any, Any]:
    """(sharded, unsharded) gradients of sum(conv(x, w)²) with respect to w, x's batch laid out by batch_spec."""
    names = ("data", "model")[: len(mesh_shape)]
    mesh = jax.make_mesh(mesh_shape, names, axis_types=(axis_type,) * len(names))
    rng = np.random.default_rng(0)
    channels = 4
    x = jnp.asarray(rng.normal(size=(4, channels, 4, 4)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(channels, channels // groups, 3, 3)), jnp.float32)

    def loss(w: Any, x: Any) -> Any:
        return jnp.sum(_conv(x, w, groups) ** 2)

    grad = jax.grad(loss)
    unsharded = jax.jit(grad)(w, x)
    shardings = (NamedSharding(mesh, P()), NamedSharding(mesh, batch_spec))
    with jax.set_mesh(mesh):
        sharded = jax.jit(grad, in_shardings=shardings)(*jax.device_put((w, x), shardings))
    return sharded, unsharded


def _close(a: Any, b: Any) -> bool:
    return bool(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5))


@pytest.mark.parametrize(
    "mesh_shape, batch_spec, groups",
    [
        ((2, 2), P("data"), 1),  # an ordinary conv: its kernel gradient is a plain contraction over the batch
        ((2,), P("data"), 4),  # no idle axis
        ((2, 2), P(("data", "model")), 2),  # the batch over every axis
    ],
)
def test_the_controls_compile_to_the_right_kernel_gradient(
    mesh_shape: tuple[int, ...], batch_spec: P, groups: int
) -> None:
    assert _close(*_kernel_gradients(mesh_shape, batch_spec, groups))


@pytest.mark.xfail(
    strict=True,
    reason="XLA (jax 0.10.2) all-reduces a grouped conv's kernel gradient over an idle mesh axis too (2x)",
)
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
@pytest.mark.parametrize("groups", [2, 4])
def test_xla_grouped_conv_kernel_gradient_with_an_idle_axis(axis_type: AxisType, groups: int) -> None:
    assert _close(*_kernel_gradients((2, 2), P("data"), groups, axis_type))


def test_the_wrong_kernel_gradient_is_the_idle_axis_times_the_right_one() -> None:
    """Pins the cause, not the symptom: exactly the idle axis's size, as an all-reduce over the whole mesh gives
    (fails too once XLA is fixed, beside the XPASS above: then delete it)."""
    sharded, unsharded = _kernel_gradients((2, 2), P("data"), 4)
    np.testing.assert_allclose(np.asarray(sharded), 2 * np.asarray(unsharded), rtol=1e-5, atol=1e-5)
