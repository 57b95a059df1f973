"""Functions wrapped in ``jax.sharding.auto_axes`` (how JAX runs code that does not type-check on Explicit axes):
explain honours the wrapper's ``out_sharding``, and a gradient leaving the region for an FSDP weight's split is
reduce-scattered, as XLA compiles it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, auto_axes
from jax.sharding import PartitionSpec as P

import einshard
from einshard.testing import hlo

D, F, B = 256, 1024, 512


def loss(p, x):
    h = auto_axes(lambda x, w: jnp.tanh(x @ w), out_sharding=P("data", None))(x, p["w1"])
    y = auto_axes(lambda h, w: h @ w, out_sharding=P("data", None))(h, p["w2"])
    return jnp.mean(y**2)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes, jax.make_mesh's default


def _compare(mesh, fn, specs, x_spec, out_shardings=None):
    p = {
        "w1": jax.ShapeDtypeStruct((D, F), jnp.float32, sharding=NamedSharding(mesh, specs["w1"])),
        "w2": jax.ShapeDtypeStruct((F, D), jnp.float32, sharding=NamedSharding(mesh, specs["w2"])),
    }
    x = jax.ShapeDtypeStruct((B, D), jnp.float32, sharding=NamedSharding(mesh, x_spec))
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, out_shardings=out_shardings).lower(p, x).compile()
        outs = None if out_shardings is None else [s.spec for s in jax.tree.leaves(out_shardings)]
        report = einshard._src.analysis.program.trace(fn, p, x).report(None, out_specs=outs)
    xla = hlo.normalized(compiled.as_text())
    got = [(c.kind, c.array_bytes, c.group_size) for op in report.ops for c in op.collectives]
    return report, xla, got


def test_the_regions_out_sharding_is_honoured(mesh):
    """The body leaves its result split over 'model' (column-parallel w); out_sharding asks for it whole there:
    the all-gather at the region's exit is XLA's, and the consumer sees the batch split only."""

    def forward(p, x):
        y = auto_axes(lambda x, w: jnp.tanh(x @ w), out_sharding=P("data", None))(x, p["w1"])
        return y

    report, xla, got = _compare(mesh, forward, {"w1": P(None, "model"), "w2": P()}, P("data"))
    assert hlo.signature(got) == hlo.signature(xla)
    assert report.complete


def test_fsdp_gradients_leaving_the_regions_are_reduce_scattered(mesh):
    fsdp = {"w1": P("data", None), "w2": P("data", None)}
    outs = {k: NamedSharding(mesh, v) for k, v in fsdp.items()}
    report, xla, got = _compare(mesh, jax.grad(loss), fsdp, P("data"), outs)
    want_rs = sorted(k for k in hlo.signature(xla).elements() if k[0] == "reduce-scatter")
    assert sorted(k for k in got if k[0] == "reduce-scatter") == want_rs == [("reduce-scatter", F * D * 4, 4)] * 2
    # Not summed whole over 'data' and then sliced (what the region's exit was read as before: bytes x1.75).
    assert not [k for k in got if k == ("all-reduce", F * D * 4, 4)]
    sent = sum(c.sent_bytes for c in xla)
    assert report.comm_bytes <= 1.3 * sent


def test_data_parallel_regions_match_xla(mesh):
    dp = {"w1": P(), "w2": P()}
    outs = {k: NamedSharding(mesh, v) for k, v in dp.items()}
    report, xla, got = _compare(mesh, jax.grad(loss), dp, P("data"), outs)
    assert hlo.signature(got) == hlo.signature(xla)
