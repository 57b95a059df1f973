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
* ``carried_back_splits_gathered`` — a transpose loop whose cotangent carry is held on the batch split (an RNN's
  gradient under FSDP: the body's dot makes the state's cotangent ``[batch, hidden@data]`` and the carry pulls it
  to ``[batch@data, hidden]``, :func:`.rules_control.dot_result_route`), on a mesh with an axis neither side
  splits (``(data, model)``, model idle): jax 0.10.2's SPMD partitioner all-to-alls the dot's result; jax
  0.12.0.1's reports an "involuntary full rematerialization" of the dot (its partially replicated tiling to the
  carry's named sharding) and all-gathers it whole, then slices.  On a mesh with no idle axis both all-to-all.
  Measured on the LSTM under FSDP of tests/test_scan_unscattered_sums.py on a (4, 2) mesh (jax 0.12.0.1: 15
  all-gathers and no all-to-all, 159744 B; jax 0.10.2: 9 and 6 all-to-alls, 156288 B) and on the probe's RNN.
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
    carried_back_splits_gathered: bool = False


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


def _probe_carried_back_splits_gathered() -> bool | None:
    """Compile the gradient of a two-step RNN, ``h = tanh(x @ u + h @ u)``, on a (2, 2) mesh, ``u``'s rows and the
    batch split over the first axis, the second idle: its transpose loop carries ``dh`` on the batch split and the
    body's ``dz @ u.T`` makes it on the hidden split.  jax 0.10.2's XLA all-to-alls it each trip, jax 0.12.0.1's
    gathers it whole (no all-to-all in the program).  None without four devices (the idle axis needs a second
    mesh axis of two) or where the compile is refused."""
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.devices()
    if len(devices) < 4:
        return None
    mesh = Mesh([devices[:2], devices[2:4]], ("probe", "idle"))

    def loss(u: jax.Array, xs: jax.Array) -> jax.Array:
        def step(h: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
            h = jnp.tanh(x @ u + h @ u)
            return h, h

        _, hs = jax.lax.scan(step, jnp.zeros((xs.shape[0], u.shape[0]), xs.dtype), jnp.swapaxes(xs, 0, 1))
        return jnp.sum(hs**2)

    split = NamedSharding(mesh, P("probe"))
    args = (jax.ShapeDtypeStruct((4, 4), jnp.float32), jax.ShapeDtypeStruct((2, 2, 4), jnp.float32))
    try:
        with jax.set_mesh(mesh):
            compiled = jax.jit(jax.grad(loss), in_shardings=(split, split), out_shardings=split).lower(*args).compile()
        text = compiled.as_text() or ""
    except Exception:  # as the conv probe: the version decides
        return None
    return "all-to-all" not in text


_measured: list[XlaBehaviour] = []  # the probe's answer, once it has one (the XLA in a process never changes)


def xla_behaviour() -> XlaBehaviour:
    """The running XLA's behaviour: probed once per process; by the jax version while no probe can run (one
    device, or called where a compile is refused), probing again on the next call.  ``carried_back_splits_gathered``
    needs four devices: with two or three it is the version's answer in a record found by probe."""
    if _measured:
        return _measured[0]
    probed = _probe_conv_windows_join_features()
    fft = _probe_fft_keeps_other_splits()
    newer = _jax_version() >= _NEWER_FROM
    if probed is None or fft is None:
        return XlaBehaviour(
            conv_windows_join_features=newer,
            found_by="version",
            fft_keeps_other_splits=newer,
            carried_back_splits_gathered=newer,
        )
    # Two or three devices run the other probes but not this one (it needs four): the version answers it.
    gathered = _probe_carried_back_splits_gathered()
    _measured.append(
        XlaBehaviour(
            conv_windows_join_features=probed,
            found_by="probe",
            fft_keeps_other_splits=fft,
            carried_back_splits_gathered=newer if gathered is None else gathered,
        )
    )
    return _measured[0]
