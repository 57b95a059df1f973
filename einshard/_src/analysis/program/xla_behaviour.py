"""What the running XLA does where its releases differ: one record the rules read, measured once per process.

explain's rules model what XLA's sharding propagation and SPMD partitioner compile.  Where a JAX release changed
that (its bundled XLA, Shardy's propagation), the rule reads a field of :class:`XlaBehaviour` here instead of
checking versions itself: the field says which of the measured behaviours the running XLA has, found by
compiling the smallest program that tells them apart (a probe) where the devices allow it, else by the jaxlib
version the behaviour was measured on.  Each field names the releases it was measured on.

* ``conv_windows_join_features`` — a convolution whose input batch and kernel outputs are split over the same
  mesh axes (FSDP kernels against a data-parallel batch) gives its result the split of the larger side of the
  result seen as a matrix (:func:`.rules_windows._features_win`).  jax 0.10.2's XLA weighs the output features
  alone against the batch times the spatial axes the input shares with the result; jax 0.12.0.1's also multiplies
  the features by the kernel's window along each such axis of stride 1 (the weights' size against the input's, on
  those axes).  Measured on one-op programs on a (4, 2) mesh, batch and kernel outputs over the 4: an
  (8, 8, 8, 16) input against a 3×3×16×64 kernel keeps the batch split on jax 0.10.2 (64 ≤ 8·8·8) and the
  features on jax 0.12.0.1 (64·9 > 8·8·8); stride 2 keeps the 0.10 rule on both (tests/test_conv_rules.py).
* ``fft_keeps_other_splits`` — an ``fft`` whose operand is split on axes the transform does not touch: jax 0.10.2's
  XLA gathers the whole operand and slices the result back; jax 0.12.0.1's transforms each device's block where it
  is (nothing moves) and gathers only the transformed axes (:func:`.rules_linalg.fft`; tests/test_linalg_rules.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax

__all__ = ["XlaBehaviour", "xla_behaviour"]

# The first jax release whose XLA was measured with the newer behaviour (jax 0.11 was not measured: the
# probe decides wherever two devices exist, this only where they do not).
_NEWER_FROM = (0, 12)


@dataclass(frozen=True)
class XlaBehaviour:
    """The running XLA's choices where releases differ (see the module's docstring for each field)."""

    conv_windows_join_features: bool
    found_by: Literal["probe", "version"]
    fft_keeps_other_splits: bool = False


def _jax_version() -> tuple[int, int]:
    """jax's (major, minor): each jax release pins the jaxlib, so the XLA, it ships with."""
    major, minor = jax.__version__.split(".")[:2]
    return int(major), int(minor)


def _probe_conv_windows_join_features() -> bool | None:
    """Compile the smallest conv that tells the two behaviours apart; None without two devices.

    Batch 2 over both devices, rows 8×8, a 3×3 stride-1 SAME kernel with 16 outputs over the same devices:
    the batch side is 2·8·8 = 128; the features 16 (older: the batch wins) or 16·9 = 144 (newer: they win).
    """
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) < 2:
        return None
    mesh = Mesh(devices[:2], ("probe",))

    def conv(x: jax.Array, w: jax.Array) -> jax.Array:
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    args = (jax.ShapeDtypeStruct((2, 8, 8, 4), jnp.float32), jax.ShapeDtypeStruct((3, 3, 4, 16), jnp.float32))
    shardings = (NamedSharding(mesh, P("probe")), NamedSharding(mesh, P(None, None, None, "probe")))
    try:
        # Its own mesh made current: explain is often called under the user's jax.set_mesh, which a jit on
        # other devices would clash with.
        with jax.set_mesh(mesh):
            compiled = jax.jit(conv, in_shardings=shardings).lower(*args).compile()
        spec = tuple(compiled.output_shardings.spec)  # type: ignore[union-attr]
    except Exception:  # a backend or context that cannot compile the probe (inside a trace): use the version
        return None
    return len(spec) == 4 and spec[3] is not None


def _probe_fft_keeps_other_splits() -> bool | None:
    """Compile a real fft of a (2, 8) operand split over its rows on two devices: no all-gather in the newer XLA."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) < 2:
        return None
    mesh = Mesh(devices[:2], ("probe",))
    try:
        with jax.set_mesh(mesh):
            compiled = (
                jax.jit(lambda x: jnp.fft.rfft(x).real, in_shardings=NamedSharding(mesh, P("probe")))
                .lower(jax.ShapeDtypeStruct((2, 8), jnp.float32))
                .compile()
            )
        text = compiled.as_text() or ""
    except Exception:  # as the conv probe: the version decides
        return None
    return "all-gather" not in text


_measured: list[XlaBehaviour] = []  # the probe's answer, once it has one (the XLA in a process never changes)


def xla_behaviour() -> XlaBehaviour:
    """The running XLA's behaviour: probed once per process; by the jax version while no probe can run (one
    device, or called where a compile is refused), probing again on the next call."""
    if _measured:
        return _measured[0]
    probed = _probe_conv_windows_join_features()
    fft = _probe_fft_keeps_other_splits()
    if probed is None or fft is None:
        newer = _jax_version() >= _NEWER_FROM
        return XlaBehaviour(conv_windows_join_features=newer, found_by="version", fft_keeps_other_splits=newer)
    _measured.append(XlaBehaviour(conv_windows_join_features=probed, found_by="probe", fft_keeps_other_splits=fft))
    return _measured[0]
