"""A transpose loop's dot result moved to the carry's batch split: all-to-all'd, or gathered whole (issue 20).

An RNN's gradient under FSDP, ``h = tanh(x @ u + h @ u)`` with ``u``'s rows and the batch split over ``a``: the
backward loop's body makes the state's cotangent ``dz @ u.T`` on the hidden split, ``[batch, hidden@a]``, and the
loop carries it on the batch split.  jax 0.10.2's XLA all-to-alls it each trip; jax 0.12's SPMD partitioner
rematerializes the dot in full ("involuntary full rematerialization": its partially replicated tiling to the
carry's sharding) wherever a mesh axis is idle, and gathers it whole, then slices.  With nothing idle (one mesh
axis) both all-to-all.  explain reads which from :mod:`einshard._src.analysis.program.xla_behaviour`'s probe
(``carried_back_splits_gathered``) and routes the move so (``rules_control.dot_result_route``).  Each drawn
program is compiled and held to XLA's HLO: collectives by kind and count and bytes sent exactly, the peak within
the recurrent gradients' band (tests/test_scan_carry_rules.py's).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from explain_counts import sent_collectives
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST

from einshard._src.analysis.program import trace
from einshard._src.analysis.program import xla_behaviour as xb
from einshard.testing import hlo

# The meshes the move is drawn on: (4, 2) with 'b' idle, and one axis with nothing idle.
MESHES: list[tuple[tuple[int, ...], tuple[str, ...]]] = [((4, 2), ("a", "b")), ((8,), ("a",)), ((4,), ("a",))]
# The recurrent gradients' peak band (tests/test_scan_carry_rules.py, tests/test_scan_unscattered_sums.py).
PEAK_BAND = (0.6, 1.25)


def _rnn_loss(u: Any, xs: Any) -> Any:
    """The state read back through the same kernel as the input, the batch-major input swapped to time-major."""

    def step(h: Any, x: Any) -> tuple[Any, Any]:
        h = jnp.tanh(x @ u + h @ u)
        return h, h

    _, hs = jax.lax.scan(step, jnp.zeros((xs.shape[0], u.shape[0]), xs.dtype), jnp.swapaxes(xs, 0, 1))
    return jnp.sum(hs**2)


def _compare(mesh_at: int, hidden: int, batch: int, steps: int) -> Counter[str]:
    """Compile the kernel's gradient (returned on its rows' split) and hold explain to it; XLA's collectives."""
    shape, names = MESHES[mesh_at]
    count = 1
    for size in shape:
        count *= size
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=jax.devices()[:count])
    args = (
        jax.ShapeDtypeStruct((hidden, hidden), jnp.float32),
        jax.ShapeDtypeStruct((batch, steps, hidden), jnp.float32),
    )
    split = NamedSharding(mesh, P("a"))
    fn = jax.grad(_rnn_loss)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=(split, split), out_shardings=split).lower(*args).compile()
    report = trace(fn, *args, mesh=dict(zip(names, shape))).report((P("a"), P("a")), [P("a")])
    text = compiled.as_text()
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    want = Counter(hlo.collective_counts(text))
    sent = float(sum(c.sent_bytes * c.runs for c in hlo.normalized(text) if c.group_size > 1))
    got, got_sent = sent_collectives(report)
    drawn = (shape, hidden, batch, steps)
    assert not report.unfollowed
    assert got == want and got_sent == sent, (drawn, got, got_sent, want, sent)
    assert PEAK_BAND[0] <= report.peak_bytes / peak <= PEAK_BAND[1], (drawn, report.peak_bytes, peak)
    return want


@st.composite
def rnn_case(draw: st.DrawFn) -> tuple[int, int, int, int]:
    return (
        draw(st.integers(0, len(MESHES) - 1)),
        draw(st.sampled_from([16, 32])),  # the hidden size: over 8 a piece of 2 at least
        draw(st.sampled_from([8, 16])),
        draw(st.integers(2, 3)),
    )


def _check(drawn: tuple[int, int, int, int]) -> None:
    _compare(*drawn)


def test_backward_loop_dot_moves_match_xla() -> None:
    FAST(given(rnn_case())(_check))()


@pytest.mark.slow
def test_backward_loop_dot_moves_match_xla_deep() -> None:
    DEEP(given(rnn_case())(_check))()


@pytest.mark.parametrize("mesh_at", range(len(MESHES)))
def test_the_move_is_the_probes_choice_where_an_axis_is_idle(mesh_at: int) -> None:
    """XLA moves the cotangent one way or the other, as the probe says: a gather per trip on the mesh with an idle
    axis where the probe found the gathering XLA, else an all-to-all per trip."""
    steps = 3
    want = _compare(mesh_at, 32, 16, steps)
    idle = len(MESHES[mesh_at][0]) > 1
    gathered = idle and xb.xla_behaviour().carried_back_splits_gathered
    assert want["all-to-all"] == (0 if gathered else steps), want


def test_the_probe_agrees_with_the_releases_it_was_measured_on() -> None:
    """The probe's answer is the record's, and jax 0.10.2's XLA all-to-alls where jax 0.12.0.1's gathers."""
    found = xb.xla_behaviour()
    assert found.found_by == "probe"  # the suite has 8 devices
    probed = xb._probe_carried_back_splits_gathered()
    assert probed is not None and probed == found.carried_back_splits_gathered
    minor = xb._jax_version()
    if minor in ((0, 10), (0, 12)):
        assert probed == (minor >= (0, 12))


def test_the_probe_needs_four_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """With fewer devices than a mesh with an idle axis needs, the probe does not guess; the version answers."""
    monkeypatch.setattr(xb.jax, "devices", lambda: jax.local_devices()[:2])
    monkeypatch.setattr(xb, "_measured", [])
    assert xb._probe_carried_back_splits_gathered() is None
    found = xb.xla_behaviour()
    assert found.carried_back_splits_gathered == (xb._jax_version() >= (0, 12))
