"""einshard.explain's peak memory per device (einshard/analysis/program/memory.py) against XLA's buffer assignment.

Each test isolates one thing the liveness walk models about XLA's buffers and checks the
estimate against ``compiled.memory_analysis()`` (arguments + outputs + temporaries - aliased)
within the corpus's 25% (tests/test_explain_corpus.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace

TOLERANCE = 0.25


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _peaks(fn, mesh, args, in_specs, out_specs):
    """(explain's peak, XLA's peak) per device."""
    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    jitted = jax.jit(
        fn,
        in_shardings=jax.tree.map(shard, in_specs, is_leaf=is_spec),
        out_shardings=jax.tree.map(shard, out_specs, is_leaf=is_spec),
    )
    m = jitted.lower(*args).compile().memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    leaves = jax.tree.leaves(out_specs, is_leaf=is_spec)
    report = trace(fn, *args, mesh=mesh).report(in_specs, leaves)
    return report.peak_bytes, xla


def test_an_elementwise_chain_is_one_fusion_with_no_buffers_of_its_own(mesh):
    """tanh, scale, shift and sum: XLA fuses them into one loop; only the argument and the result are buffers."""
    x = _sds(512, 256)

    def f(x):
        return jnp.sum(jnp.tanh(x) * 2.0 + 1.0)

    got, xla = _peaks(f, mesh, (x,), (P("data"),), P())
    shard = 512 // 4 * 256 * 4
    assert got < shard + 1024  # the three [128, 256] temporaries are not counted
    assert got == pytest.approx(xla, rel=TOLERANCE)


def test_a_gathered_weight_is_held_from_the_start_of_the_step(mesh):
    """FSDP forward: XLA all-gathers the weight at the start and holds the copy to its last use."""
    w, x = _sds(256, 512), _sds(64, 256)

    def f(w, x):
        return jnp.mean(jnp.tanh(x @ w))

    got, xla = _peaks(f, mesh, (w, x), (P("data"), P("data")), P())
    assert got > 256 * 512 * 4  # the whole weight, besides its shard
    assert got == pytest.approx(xla, rel=TOLERANCE)


def test_gradients_partial_sums_wait_for_the_combined_all_reduce(mesh):
    """Data-parallel gradients: XLA combines their all-reduces at the end, holding every partial sum until then."""
    params = {"w1": _sds(128, 256), "w2": _sds(256, 128)}
    x = _sds(64, 128)

    def loss(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)

    specs = {"w1": P(), "w2": P()}
    got, xla = _peaks(jax.grad(loss), mesh, (params, x), (specs, P("data")), specs)
    grads = (128 * 256 + 256 * 128) * 4
    assert got > 2 * grads + grads  # arguments, the gradients and their partial sums
    assert got == pytest.approx(xla, rel=TOLERANCE)


# Softmax cross-entropies, whose nested jits (``jax.nn.log_softmax``, ``take_along_axis``) XLA inlines and fuses.
# Before the memory walk inlined them (and wrote results in place), explain over-estimated the log-softmax
# gradient 1.33x, optax's integer-label gradient 2.98x and the one-hot and hand-written forwards 1.50x.
B, S, V = 16, 8, 512


def _log_softmax_take(logits, labels):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _log_softmax_one_hot(logits, labels):
    return -jnp.mean(jnp.sum(jax.nn.one_hot(labels, V) * jax.nn.log_softmax(logits), axis=-1))


def _by_hand(logits, labels):
    z = logits - jnp.max(logits, axis=-1, keepdims=True)
    logp = z - jnp.log(jnp.sum(jnp.exp(z), axis=-1, keepdims=True))
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _optax_integer_labels(logits, labels):
    optax = pytest.importorskip("optax")
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


LOSSES = {
    "log_softmax_take": _log_softmax_take,
    "log_softmax_one_hot": _log_softmax_one_hot,
    "by_hand": _by_hand,
    "optax_integer_labels": _optax_integer_labels,
}
KINDS = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


# The hand-written cross-entropy's gradient reads the max's one-hot mask twice: converted to f32 for a YNNPACK sum
# (a buffer) and in the last loop fusion (recomputed there: memory._duplicated, as XLA does).  XLA schedules the
# mask's conversion and sum late, next to their one reader, while the exponentials and the label scatter are live;
# the walk runs them where the jaxpr does, first, and frees the mask before those are made (0.71x; 0.94x before
# the duplication rule, whose mask buffer was held to the end in their place).  Scheduling is not modelled.
_SCHEDULED_LATE = pytest.mark.xfail(
    strict=True,
    reason="XLA's scheduler runs the one-hot mask's YNNPACK sum late, next to its reader, beside the exponentials "
    "and the label scatter; the walk runs it in jaxpr order and frees the mask first (197248 B vs XLA's 279040 B)",
)


@pytest.mark.parametrize("mode", ["fwd", "grad"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_cross_entropy_is_fused_as_xla_fuses_it(loss, kind, mode, request):
    """Batch-split logits ``[b, s, v]``: XLA holds the logits, at most one ``[b, s, v]`` temporary, and the gradient."""
    if loss == "by_hand" and mode == "grad" and tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 12):
        # jax 0.12's XLA:CPU schedules the mask's sum as the walk assumes: within the band there (CI's 3.12 stage)
        request.applymarker(_SCHEDULED_LATE)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(KINDS[kind],) * 2)
    fn = jax.grad(LOSSES[loss]) if mode == "grad" else LOSSES[loss]
    args = (_sds(B, S, V), jax.ShapeDtypeStruct((B, S), jnp.int32))
    got, xla = _peaks(fn, mesh, args, (P("data"), P("data")), P("data") if mode == "grad" else P())
    logits = B // 4 * S * V * 4
    assert got >= logits * (2 if mode == "grad" else 1)  # the logits' shard, and the gradient's
    assert got == pytest.approx(xla, rel=TOLERANCE), (got, xla)


@pytest.mark.parametrize("mode", ["fwd", "grad"])
@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("layout", ["dp", "tp"])
def test_an_mlp_with_optax_cross_entropy(layout, kind, mode):
    """A two-layer jnp MLP classifier with optax's integer-label cross-entropy, data- or tensor-parallel."""
    optax = pytest.importorskip("optax")
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(KINDS[kind],) * 2)
    params = {"w1": _sds(64, 256), "b1": _sds(256), "w2": _sds(256, 128)}
    x, y = _sds(32, 64), jax.ShapeDtypeStruct((32,), jnp.int32)

    def loss(p, x, y):
        h = jax.nn.relu(x @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], y).mean()

    specs = (
        {"w1": P(), "b1": P(), "w2": P()}
        if layout == "dp"
        else {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None)}
    )
    fn = jax.grad(loss) if mode == "grad" else loss
    got, xla = _peaks(fn, mesh, (params, x, y), (specs, P("data"), P("data")), specs if mode == "grad" else P())
    assert got == pytest.approx(xla, rel=TOLERANCE), (got, xla)


@pytest.mark.parametrize("specs", [(P(), P("data")), (P("data"), P("data")), (P(None, "model"), P("data"))])
def test_auto_axes_reshards_are_the_same_buffers(specs):
    """``jax.sharding.auto_axes`` on an Explicit mesh reshards every input into its Auto region: no copies.

    The region's reshards leave each value's layout as it was; XLA makes no buffer for them, so the
    peak is the Auto mesh's (it was counted twice: every parameter and its reshard).  Under FSDP the
    weight's gathered copy, bound to the reshard's result, is still held (its argument's).
    """
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Explicit))
    w, x = _sds(256, 512), _sds(64, 256)

    def f(w, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ w) * 2.0) ** 2)

    wrapped = jax.sharding.auto_axes(f, out_sharding=P())
    with jax.set_mesh(mesh):
        got, xla = _peaks(wrapped, mesh, (w, x), specs, P())
        auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
        plain, _ = _peaks(f, auto, (w, x), specs, P())
    assert got == plain  # the same program: the reshards are not buffers
    assert got == pytest.approx(xla, rel=TOLERANCE)


def test_the_report_says_where_its_peak_cannot_be_tight(mesh):
    """A convolution's or a sort's scratch is XLA:CPU's: the report names them and the measured bound."""
    x, k = _sds(8, 16, 16, 4), _sds(3, 3, 4, 8)

    def conv(x, k):
        y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jnp.mean(jnp.sort(y, axis=-1))

    report = trace(jax.grad(conv), x, k, mesh=mesh).report((P("data"), P()), [P()])
    assert report.peak_note.startswith("peak approximate")
    assert "conv_general_dilated" in report.peak_note and "sort" in report.peak_note
    assert "0.1-1.75x" in report.peak_note  # the widest bound of the two families
    assert report.peak_note in str(report) and report.to_dict()["peak_note"] == report.peak_note

    plain = trace(lambda x: jnp.sum(jnp.tanh(x)), _sds(64, 8), mesh=mesh).report((P("data"),), [P()])
    assert plain.peak_note == ""  # the walk's 25%: nothing to say


@pytest.mark.parametrize("specs", [(P(), P("data")), (P("data"), P("data"))])
def test_a_while_loop_counts_one_iteration_on_top_of_its_buffers(mesh, specs):
    """A while body's temporaries (the matmul's result, an FSDP weight's gathered copy) live while it runs."""
    w, x = _sds(256, 256), _sds(64, 256)

    def f(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w) * 0.5 + h

        return jnp.mean(jax.lax.while_loop(lambda c: c[0] < jnp.sum(x > 0), body, (0, x))[1])

    got, xla = _peaks(f, mesh, (w, x), specs, P())
    assert got == pytest.approx(xla, rel=TOLERANCE)
