"""Depthwise convolutions (``feature_group_count`` = channels, MobileNet's and Equinox's ``groups=C``) and the
convs around them, against the compiled program: collectives by kind and count, bytes sent per device within 10%
and peak memory within 25% of ``memory_analysis()`` (the external corpus's bars).

* FSDP (the batch and the kernel's outputs over one mesh axis): XLA moves the input's split from the batch onto
  the channels (an all-to-all), convolves each device's own channels, and moves the result back (another);
* the kernel gradient (a ``batch_group_count`` conv) with its groups split like the cotangent's channels (tensor
  parallelism) is local; on a 2-D mesh with the batch over one axis XLA sums it over the whole mesh (its
  miscompile, tests/test_xla_depthwise_grad_miscompile.py) and slices the FSDP kernel's piece from the sum;
* a 1x1 kernel's flip for its input gradient is no op: the forward's gathered kernel serves both convs;
* a 1x1 conv whose result only a reduction reads (through elementwise ops) runs inside XLA:CPU's YNNPACK fusion
  of that reduction: no result buffer, but NCHW operands copied to row-major order.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_conv_rules import _assert_sends_as_xla
from test_primitive_rules import DEEP, FAST, MESHES, Case, check

from einshard._src.analysis.program import trace

C = 16
NCHW = ("NCHW", "OIHW", "NCHW")
NHWC = ("NHWC", "HWIO", "NHWC")


def _depthwise(x: Any, w: Any, dn: tuple[str, str, str] = NCHW) -> Any:
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=C)


def _pointwise(x: Any, w: Any, dn: tuple[str, str, str] = NCHW) -> Any:
    return lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=dn)


def _compiled_and_report(
    fn: Any, args: tuple[Any, ...], specs: Any, out_specs: Any, shape: tuple[int, ...], names: tuple[str, ...]
) -> tuple[Any, Any]:
    mesh = jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    with jax.set_mesh(mesh):
        place = lambda s: NamedSharding(mesh, s)  # noqa: E731
        shardings = jax.tree.map(place, specs, is_leaf=is_spec)
        outs = jax.tree.map(place, out_specs, is_leaf=is_spec)
        compiled = jax.jit(fn, in_shardings=shardings, out_shardings=outs).lower(*args).compile()
        report = trace(fn, *args, mesh=dict(zip(names, shape))).report(
            specs, jax.tree.leaves(out_specs, is_leaf=is_spec)
        )
    return compiled, report


def _assert_peak_as_xla(report: Any, compiled: Any) -> None:
    m = compiled.memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    assert 0.75 * xla <= report.peak_bytes <= 1.25 * xla, (report.peak_bytes, xla)


def _x(dn: tuple[str, str, str]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((8, C, 8, 8) if dn == NCHW else (8, 8, 8, C), jnp.float32)


def _w(dn: tuple[str, str, str]) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct((C, 1, 3, 3) if dn == NCHW else (3, 3, 1, C), jnp.float32)


def _outputs(dn: tuple[str, str, str]) -> P:
    return P("data") if dn == NCHW else P(None, None, None, "data")


FSDP_MESHES = [((4, 2), ("data", "model")), ((8,), ("data",))]


@pytest.mark.parametrize("dn", [NCHW, NHWC], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("relu", [False, True], ids=["argument", "relu"])
@pytest.mark.parametrize("shape, names", FSDP_MESHES)
def test_depthwise_conv_under_fsdp_moves_the_batch_onto_its_channels_as_xla(dn, relu, shape, names) -> None:
    """Two all-to-alls of the input-sized block (explain gathered the kernel and said so), the result batch-split;
    the peak the arguments and two blocks (the pieces sent and received, then the received and the result)."""

    def loss(x: Any, w: Any) -> Any:
        return jnp.sum(_depthwise(jax.nn.relu(x) if relu else x, w, dn) ** 2)

    compiled, report = _compiled_and_report(loss, (_x(dn), _w(dn)), (P("data"), _outputs(dn)), P(), shape, names)
    _assert_sends_as_xla(report, compiled)
    assert not report.approximate_at
    assert sum(c.kind == "all-to-all" for op in report.ops for c in op.collectives) == 2
    _assert_peak_as_xla(report, compiled)


@pytest.mark.parametrize(
    "xs, ws, shape, names",
    [
        (P(None, "model"), P("model"), (4, 2), ("data", "model")),  # tp: the groups split alike, nothing moves
        (P("data", "model"), P("model"), (4, 2), ("data", "model")),  # dp x tp: one all-reduce over 'data'
        (P("data"), P("data"), (4, 2), ("data", "model")),  # FSDP: all-reduce over the whole mesh, then a slice
        (P("data"), P("data"), (8,), ("data",)),  # FSDP on one axis: one reduce-scatter
    ],
)
def test_depthwise_kernel_gradient_matches_xla(xs, ws, shape, names) -> None:
    grad = jax.grad(lambda w, x: jnp.sum(_depthwise(x, w) ** 2))
    compiled, report = _compiled_and_report(grad, (_w(NCHW), _x(NCHW)), (ws, xs), ws, shape, names)
    _assert_sends_as_xla(report, compiled)
    assert not report.approximate_at


@pytest.mark.parametrize("dn", [NCHW, NHWC], ids=["nchw", "nhwc"])
def test_pointwise_conv_step_gathers_its_kernel_once_as_xla(dn) -> None:
    """An FSDP 1x1 conv and its gradient: the input gradient's conv reads the kernel the forward gathered (its flip
    along the 1x1 window is no op): one all-gather, where explain gathered the flipped kernel again and said so."""
    wshape = (2 * C, C, 1, 1) if dn == NCHW else (1, 1, C, 2 * C)
    ws = P("data") if dn == NCHW else P(None, None, None, "data")

    def loss(w: Any, x: Any) -> Any:
        return jnp.sum(jax.nn.relu(_pointwise(jnp.tanh(x), w, dn)) ** 2)

    args = (jax.ShapeDtypeStruct(wshape, jnp.float32), _x(dn))
    compiled, report = _compiled_and_report(
        jax.grad(loss, argnums=(0, 1)), args, (ws, P("data")), (ws, P("data")), (4, 2), ("data", "model")
    )
    _assert_sends_as_xla(report, compiled)
    assert not report.approximate_at


@pytest.mark.parametrize(
    "dn, relu, xs, ws",
    [
        (NHWC, False, P(), P()),  # the result fused away: the arguments alone
        (NCHW, False, P(), P()),  # ... and the copies of x and w in row-major order
        (NCHW, True, P(), P()),  # relu(x) written in that order by its own fusion
        (NCHW, True, P("data"), P("data")),  # FSDP: the kernel gathered, then copied
        (NCHW, True, P(None, "model"), P("model")),  # tp: the input's channels gathered, then copied
    ],
)
def test_pointwise_conv_read_by_a_reduction_holds_what_xla_does(dn, relu, xs, ws) -> None:
    """A 1x1 conv whose result only a mean reads (through a relu): XLA:CPU runs it inside the reduction's YNNPACK
    fusion.  explain had held its whole result (1.4x-2.9x XLA's peak)."""
    wshape = (2 * C, C, 1, 1) if dn == NCHW else (1, 1, C, 2 * C)
    if dn == NHWC:
        xs = P(*([None] * 3), *xs) if xs else xs
        ws = P(*([None] * 3), *ws) if ws else ws
    spatial = (2, 3) if dn == NCHW else (1, 2)

    def loss(x: Any, w: Any) -> Any:
        return jnp.sum(jax.nn.relu(_pointwise(jax.nn.relu(x) if relu else x, w, dn)).mean(spatial))

    args = (_x(dn), jax.ShapeDtypeStruct(wshape, jnp.float32))
    compiled, report = _compiled_and_report(loss, args, (xs, ws), P(), (4, 2), ("data", "model"))
    _assert_sends_as_xla(report, compiled)
    _assert_peak_as_xla(report, compiled)


@pytest.mark.parametrize("batch", ["data", None], ids=["dp_tp", "tp"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("dn", [NCHW, NHWC], ids=["nchw", "nhwc"])
def test_channel_split_conv_gradient_gathers_its_input_as_xla(dn, k, batch) -> None:
    """x batch@data, channels@model against a kernel's outputs@model (dp x tp): the forward conv gathers x's
    channels; a 1x1 conv's kernel gradient (a dot to XLA) gathers them again, a 3x3 conv's reuses that gather.
    With the batch whole (tp) both move x onto the idle 'data' first, and the gradient reuses the forward's."""
    wshape = (2 * C, C, k, k) if dn == NCHW else (k, k, C, 2 * C)
    xs = P(batch, "model") if dn == NCHW else P(batch, None, None, "model")
    ws = P("model") if dn == NCHW else P(None, None, None, "model")

    def loss(w: Any, x: Any) -> Any:
        return jnp.sum(jax.nn.relu(lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn)) ** 2)

    args = (jax.ShapeDtypeStruct(wshape, jnp.float32), _x(dn))
    compiled, report = _compiled_and_report(jax.grad(loss), args, (ws, xs), ws, (4, 2), ("data", "model"))
    _assert_sends_as_xla(report, compiled)
    gathers = sum(c.kind == "all-gather" for op in report.ops for c in op.collectives)
    assert gathers == (2 if k == 1 and batch else 1)


# -- the property: drawn depthwise convs and their gradients against the compiled program ---------------------------


def _depthwise_conv(dn: tuple[str, str, str], groups: int) -> Any:
    # A closure, not a partial: check() names the drawn parameters from the function's closure.
    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=dn, feature_group_count=groups)

    return conv


@st.composite
def depthwise_case(draw: Any) -> Case:
    """A depthwise conv (feature_group_count = channels): batch, channels, spatial size, a 1x1 or 3x3 kernel, NCHW or
    NHWC, over the (8,), (4, 2) and (2, 2, 2) meshes: the batch over one axis with the kernel's outputs over it too
    (FSDP: the regroup onto the channels) or whole (dp); or the channels and the kernel's outputs split alike over
    one axis (tp: the kernel gradient's batch groups split alike), the batch over another (dp x tp) or whole; Auto or
    Explicit axes (where JAX refuses the program on Explicit axes, check() rejects the draw)."""
    batch = draw(st.sampled_from([8, 16]))
    channels = draw(st.sampled_from([8, 16, 32]))
    size = draw(st.sampled_from([4, 8]))
    k = draw(st.sampled_from([1, 3]))
    dn = draw(st.sampled_from([NCHW, NHWC]))
    rank = draw(st.sampled_from([1, 2, 3]))
    names = MESHES[rank][1]
    axis = draw(st.sampled_from(names))
    # Not a 1x1 kernel with the channels split and the batch whole beside an idle mesh axis: jax 0.10.2's XLA:CPU
    # aborts compiling it (free(): invalid pointer: x (16, 8, 8, 8) channels@a against outputs@a on (4, 2), NCHW or
    # NHWC; a 3x3 kernel, the batch over the other axis, or the 1-axis mesh compile), so there is nothing to compare.
    crashes = k == 1 and rank > 1
    tp = ["dp_tp"] if crashes else ["tp", "dp_tp"] if rank > 1 else ["tp"]
    layout = draw(st.sampled_from(["fsdp", "dp", *tp]))
    other = draw(st.sampled_from([n for n in names if n != axis])) if layout == "dp_tp" else None
    nchw = dn == NCHW
    x = jax.ShapeDtypeStruct((batch, channels, size, size) if nchw else (batch, size, size, channels), jnp.float32)
    w = jax.ShapeDtypeStruct((channels, 1, k, k) if nchw else (k, k, 1, channels), jnp.float32)
    outputs = P(axis) if nchw else P(None, None, None, axis)  # the kernel's output features
    if layout in ("fsdp", "dp"):
        specs = (P(axis), outputs if layout == "fsdp" else P())
    else:
        batch_axis = other if layout == "dp_tp" else None
        specs = (P(batch_axis, axis) if nchw else P(batch_axis, None, None, axis), outputs)
    fn = _depthwise_conv(dn, channels)
    return Case("conv_general_dilated", fn, (x, w), specs, rank, draw(st.booleans()), draw(st.booleans()), "windows")


def test_depthwise_convs_match_xla() -> None:
    """Collectives (kinds, counts), bytes and peak against the compiled program, by the per-primitive tests' rule
    (tests/test_primitive_rules.check): within the report's stated bound, zero where nothing is approximate."""
    settings(FAST, max_examples=6)(given(depthwise_case())(check))()


@pytest.mark.slow
def test_depthwise_convs_match_xla_deep() -> None:
    DEEP(given(depthwise_case())(check))()
