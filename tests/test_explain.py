"""einshard.explain: whole programs, checked against themselves (scan vs unrolled) and against XLA's HLO."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard.errors import EinshardError
from einshard.testing import hlo

MESH = {"data": 4, "model": 2}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))


def _sds(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _xla_signature(fn, mesh, args, in_specs, out_specs):
    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    compiled = (
        jax.jit(fn, in_shardings=jax.tree.map(shard, in_specs), out_shardings=jax.tree.map(shard, out_specs))
        .lower(*args)
        .compile()
        .as_text()
    )
    return Counter((c.kind, c.array_bytes) for c in hlo.normalized(compiled))


def _explain_signature(report):
    sig: Counter = Counter()
    for op in report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                sig[(c.kind, c.array_bytes)] += op.repeat
    return sig


def _megatron(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]


def test_megatron_mlp_forward_matches_xla(mesh):
    """docs/theory.md V10: column- then row-parallel; one all-reduce of [B, D], nothing between the matmuls."""
    p = {"w1": _sds(128, 256), "w2": _sds(256, 128)}
    x = _sds(64, 128)
    specs = ({"w1": P(None, "model"), "w2": P("model", None)}, P())
    report = einshard.explain(_megatron, p, x, mesh=MESH, in_specs=specs)
    assert [c.kind for op in report.ops for c in op.collectives] == ["all-reduce"]
    assert _explain_signature(report) == _xla_signature(_megatron, mesh, (p, x), specs, P())


def test_data_parallel_gradient_matches_xla(mesh):
    """docs/theory.md V12: DP gradient = one all-reduce of dW (the primal loss XLA drops is not counted)."""

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    w, x = _sds(64, 32), _sds(128, 64)
    specs = (P(), P("data", None))
    report = einshard.explain(jax.grad(loss), w, x, mesh=MESH, in_specs=specs)
    assert _explain_signature(report) == _xla_signature(jax.grad(loss), mesh, (w, x), specs, P())
    assert report.phases["backward"]["count"] == 1


def test_scan_over_layers_counts_like_the_unrolled_program():
    """A scan body's cost, times its length, equals the same layers written out."""
    layers = 3

    def body(h, w):
        return jnp.tanh(h @ w["a"]) @ w["b"], None

    def scanned(ws, x):
        return jnp.sum(jax.lax.scan(body, x, ws)[0])

    def unrolled(ws, x):
        h = x
        for i in range(layers):
            h, _ = body(h, jax.tree.map(lambda a, i=i: a[i], ws))
        return jnp.sum(h)

    ws = {"a": _sds(layers, 64, 128), "b": _sds(layers, 128, 64)}
    x = _sds(32, 64)
    specs = ({"a": "l d f -> l d f@model", "b": "l f d -> l f@model d"}, "b d -> b@data d")
    a = einshard.explain(scanned, ws, x, mesh=MESH, in_specs=specs)
    b = einshard.explain(unrolled, ws, x, mesh=MESH, in_specs=specs)
    assert a.flops == pytest.approx(b.flops)
    assert a.comm_bytes == pytest.approx(b.comm_bytes)
    assert a.comm_count == b.comm_count == layers + 1  # one all-reduce per row-parallel matmul, one for the sum
    assert any(op.repeat == layers for op in a.ops)
    # Gradients: the scan's backward loop is found and labelled backward, per iteration.
    g = einshard.explain(jax.grad(scanned), ws, x, mesh=MESH, in_specs=specs)
    assert any(op.phase == "backward" and op.repeat == layers for op in g.ops)
    assert g.phases["backward"]["count"] >= 2 * layers


def test_forward_and_backward_phases_and_totals():
    def loss(p, x):
        return jnp.mean(_megatron(p, x) ** 2)

    p = {"w1": _sds(128, 256), "w2": _sds(256, 128)}
    specs = ({"w1": "d f -> d f@model", "w2": "f d -> f@model d"}, "b d -> b@data d")
    report = einshard.explain(jax.grad(loss), p, _sds(64, 128), mesh=MESH, in_specs=specs, profile="h100")
    assert set(report.phases) == {"forward", "backward"}
    dots = [op for op in report.ops if op.primitive == "dot_general"]
    assert len(dots) == 5  # 2 forward + dW2, dH, dW1 (x is not differentiated)
    # FLOPs per device: the forward matmuls are split 8 ways (data x model); the backward ones at
    # least that (the analyzer may gather a small operand and duplicate some compute instead).
    one = 2 * 64 * 128 * 256
    assert report.phases["forward"]["flops"] == pytest.approx(2 * one / 8)
    assert report.flops >= 5 * one / 8
    assert report.time_s > 0 and report.peak_bytes > 0
    text = str(report)
    assert "backward" in text and "all-reduce" in text
    assert report.to_dict()["comm_count"] == report.comm_count


def test_mesh_and_layouts_come_from_placed_arrays(mesh):
    w = einshard.einshard(np.ones((128, 256), np.float32), "d f -> d f@model", mesh=mesh)
    x = einshard.einshard(np.ones((64, 128), np.float32), "b d -> b@data d", mesh=mesh)
    report = einshard.explain(lambda w, x: x @ w, w, x)
    assert report.comm_count == 0
    assert report.ops[0].out_layout.dims == (("data",), ("model",))


def test_operations_it_cannot_follow_are_named():
    report = einshard.explain(lambda x: jax.lax.betainc(x, x, x), _sds(8, 8), mesh=MESH, in_specs=("a b -> a@data b",))
    assert "regularized_incomplete_beta" in report.unfollowed


def test_errors_name_the_problem():
    with pytest.raises(EinshardError, match="needs a mesh"):
        einshard.explain(lambda x: x, _sds(4))
    with pytest.raises(EinshardError, match="nope"):
        einshard.explain(lambda x: x, _sds(4, 4), mesh=MESH, in_specs=(P("nope", None),))


@pytest.mark.parametrize(
    "expr, mode, two_way",
    [
        ("b@x k, k@x n -> b@x n", "async", False),
        ("b@x k, k@x n -> b@x n", "async", True),
        ("b k@x, k@x n -> b@x n", "async", False),
        ("b k@x, k@x n -> b n", "sync", False),
        ("b@x k, k n@x -> b@x n", "sync", False),
    ],
)
def test_explicit_shard_map_programs_are_priced_collective_by_collective(expr, mode, two_way):
    """explain walks into shard_map bodies: its psums and ppermute rings equal what XLA compiles."""
    mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
    x, w = np.ones((16, 32), np.float32), np.ones((32, 24), np.float32)
    program = einshard.lower(expr, x, w, mesh=mesh, mode=mode, two_way=two_way)
    report = einshard.explain(program.fn, x, w, mesh=mesh)
    compiled = jax.jit(program.fn).lower(x, w).compile().as_text()
    assert _explain_signature(report) == Counter((c.kind, c.array_bytes) for c in hlo.normalized(compiled))
    assert not report.unfollowed


@pytest.mark.parametrize("b, d, f", [(8, 32, 64), (64, 128, 256)])
def test_megatron_dp_tp_gradient_matches_xla(mesh, b, d, f):
    """DP×TP Megatron MLP gradient: XLA all-reduces the row-parallel output over model and each weight's
    gradient over data (3 all-reduces, no gathers), gradients returned laid out like the weights."""

    def loss(p, x):
        return jnp.mean(_megatron(p, x) ** 2)

    p = {"w1": _sds(d, f), "w2": _sds(f, d)}
    specs = ({"w1": P(None, "model"), "w2": P("model", None)}, P("data"))
    out = {"w1": P(None, "model"), "w2": P("model", None)}
    report = einshard._src.analysis.program.trace(jax.grad(loss), p, _sds(b, d), mesh=MESH).report(
        specs, [out["w1"], out["w2"]]
    )
    want = _xla_signature(jax.grad(loss), mesh, (p, _sds(b, d)), specs, out)
    assert _explain_signature(report) == want
    assert sorted(k for k, _ in want.elements()) == ["all-reduce"] * 3
