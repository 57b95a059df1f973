"""Never silent: an op einshard has no layout rule for is priced as XLA runs an op it cannot partition, and the
report says on its first line that it is incomplete, naming the op and its source line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.program.registry import RULES
from einshard.testing import hlo

# A primitive of this test's own (no rule will ever be registered for it), lowered to XLA's TopK: XLA's
# partitioner cannot split TopK along its operand's last axis, so it all-gathers that axis and runs replicated.
opaque_top = Primitive("einshard_test_opaque_top")
opaque_top.def_impl(lambda x: jax.lax.top_k(x, 4)[0])
opaque_top.def_abstract_eval(lambda x: jax.core.ShapedArray((*x.shape[:-1], 4), x.dtype))
mlir.register_lowering(opaque_top, mlir.lower_fun(lambda x: jax.lax.top_k(x, 4)[0], multiple_results=False))


def scores(x, w):
    return jnp.sum(opaque_top.bind(jnp.tanh(x @ w)))


X = jax.ShapeDtypeStruct((32, 64), jnp.float32)
W = jax.ShapeDtypeStruct((64, 128), jnp.float32)
SPECS = (P("data"), P(None, "model"))


def test_the_first_line_says_incomplete_and_names_the_op_and_its_line():
    assert opaque_top.name not in RULES
    report = einshard.explain(scores, X, W, mesh={"data": 4, "model": 2}, in_specs=SPECS)
    first = str(report).splitlines()[0]
    assert first.startswith("INCOMPLETE: no layout rule for einshard_test_opaque_top at ")
    assert "test_explain_complete.py:" in first and "(scores)" in first and "profile: " in first
    assert not report.complete and report.unfollowed == ("einshard_test_opaque_top",)
    d = report.to_dict()
    assert d["complete"] is False and d["profile"] == report.profile.name
    assert d["unfollowed_at"] == list(report.unfollowed_at) and "test_explain_complete.py:" in d["unfollowed_at"][0]


def test_a_complete_report_says_nothing_of_the_kind():
    report = einshard.explain(lambda x, w: jnp.sum(jnp.tanh(x @ w)), X, W, mesh={"data": 4, "model": 2}, in_specs=SPECS)
    assert report.complete and report.to_dict()["complete"] is True
    assert str(report).splitlines()[0].startswith("mesh: data=4, model=2   profile: ")


def test_an_op_without_a_rule_costs_what_xla_compiles_for_it():
    """Split operands all-gathered whole, computed replicated (the consumer's slice is free): XLA's collectives."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    # The operand of the op is split over 'model' along its last axis, the axis XLA cannot split TopK along.
    specs = (P(), P(None, ("model", "data")))
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip((X, W), specs)]
    want = hlo.signature(hlo.normalized(jax.jit(scores).lower(*args).compile().as_text()))
    report = einshard.explain(scores, *args, mesh=mesh)
    got = hlo.signature([(c.kind, c.array_bytes, c.group_size) for op in report.ops for c in op.collectives])
    assert ("all-gather", 32 * 128 * 4, 8) in got  # the op's operand, gathered whole
    assert got == want, (got, want)
    assert not report.complete


def test_placed_arrays_on_an_explicit_mesh_under_jit_are_named_too():
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes
    x = einshard.einshard(jnp.ones((32, 64)), "b d -> b@data d", mesh=mesh)
    w = einshard.einshard(jnp.ones((64, 128)), "d f -> d f@model", mesh=mesh)

    def loss(w, x):
        return jnp.sum(opaque_top.bind(jax.sharding.reshard(jnp.tanh(x @ w), NamedSharding(mesh, P()))))

    report = einshard.explain(jax.jit(loss), w, x)
    assert not report.complete and str(report).startswith("INCOMPLETE")
