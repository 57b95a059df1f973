"""explain's report in the user's words: every op and collective says where it is (file:line) and what it reads
(argument paths), dots use the axis names of the user's expressions, no column is cut, to_dict() carries the
same; in_specs= takes path rules (the one matcher of einshard(tree, rules)) and NNX states."""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import einshard

MESH = {"data": 4, "model": 2}


def _loss(params: dict[str, Any], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w_in"])
    return jnp.mean((h @ params["w_out"]) ** 2)


def _shapes() -> tuple[dict[str, Any], Any]:
    params = {
        "w_in": jax.ShapeDtypeStruct((64, 128), jnp.float32),
        "w_out": jax.ShapeDtypeStruct((128, 64), jnp.float32),
    }
    return params, jax.ShapeDtypeStruct((32, 64), jnp.float32)


MEGATRON = ({"w_in": "d f -> d f@model", "w_out": "f d -> f@model d"}, "b d -> b@data d")


def test_every_op_says_where_it_is_and_what_it_reads() -> None:
    params, x = _shapes()
    report = einshard.explain(jax.grad(_loss), params, x, mesh=MESH, in_specs=MEGATRON)
    assert report.ops
    for op in report.ops:
        assert op.where, op
        assert op.where == "the program's output" or "test_explain_report_words.py:" in op.where
        assert op.reads, op
    forward = [op for op in report.ops if op.phase == "forward" and op.primitive == "dot_general"]
    assert forward[0].reads == ("x", "params.w_in")
    assert "params.w_out" in forward[1].reads and "(_loss)" in forward[1].where
    row = forward[1]
    assert [c.kind for c in row.collectives] == ["all-reduce"]
    d = report.to_dict()
    json.dumps(d)
    for op, od in zip(report.ops, d["ops"]):
        assert od["where"] == op.where and od["reads"] == list(op.reads) and od["inside"] == op.inside
    text = str(report)
    assert f"at {row.where}; reads " in text


def test_dots_use_the_axis_names_of_the_users_expressions() -> None:
    params, x = _shapes()
    report = einshard.explain(jax.grad(_loss), params, x, mesh=MESH, in_specs=MEGATRON)
    forward = [op.expression for op in report.ops if op.phase == "forward" and op.primitive == "dot_general"]
    assert forward[0] == "b@data d, d f@model -> b@data f@model"
    assert forward[1].endswith("f@model d -> b@data d")
    # With PartitionSpecs there are no names of the user's: the letters stay.
    specs = ({"w_in": jax.P(None, "model"), "w_out": jax.P("model", None)}, jax.P("data", None))
    plain = einshard.explain(jax.grad(_loss), params, x, mesh=MESH, in_specs=specs)
    assert plain.ops[0].expression.startswith("b@data a, a c@model")


def test_no_column_is_cut() -> None:
    def many(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.einsum("abcd,cdef->abef", x, w)

    x = jax.ShapeDtypeStruct((8, 8, 16, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 16, 8, 8), jnp.float32)
    report = einshard.explain(
        many,
        x,
        w,
        mesh=MESH,
        in_specs=(
            "batch seq heads dim -> batch@data seq heads@model dim",
            "heads dim hidden width -> heads@model dim hidden width",
        ),
    )
    (op,) = [op for op in report.ops if op.primitive == "dot_general"]
    assert len(op.expression) > 40
    assert op.expression in str(report)
    for c in op.collectives:
        assert f"{c.kind}@{'·'.join(c.axes)}" in str(report)


def test_in_specs_takes_path_rules_as_einshard_does() -> None:
    params, x = _shapes()
    # Patterns searched in each leaf's keystr path ("['w_in']"), as einshard(params, rules) reads them.
    rules = ({r"in'\]": "d f -> d f@model", r"out'\]": "f d -> f@model d"}, "b d -> b@data d")
    by_rules = einshard.explain(jax.grad(_loss), params, x, mesh=MESH, in_specs=rules)
    by_prefix = einshard.explain(jax.grad(_loss), params, x, mesh=MESH, in_specs=MEGATRON)
    assert by_rules.comm_bytes == by_prefix.comm_bytes and by_rules.flops == by_prefix.flops
    assert [op.expression for op in by_rules.ops] == [op.expression for op in by_prefix.ops]
    with pytest.raises(einshard.EinshardError, match="w_out"):
        einshard.explain(jax.grad(_loss), params, x, mesh=MESH, in_specs=({r"in'\]": "d f -> d f@model"}, None))


def test_in_specs_takes_an_nnx_state() -> None:
    nnx = pytest.importorskip("flax.nnx")

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.up = nnx.Linear(64, 128, rngs=rngs)
            self.down = nnx.Linear(128, 64, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.down(jax.nn.relu(self.up(x)))

    graphdef, state = nnx.split(nnx.eval_shape(lambda: MLP(nnx.Rngs(0))))

    def loss(state: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(nnx.merge(graphdef, state)(x) ** 2)

    rules = {r"up.*kernel": "d f -> d f@model", r"up.*bias": "f -> f@model", r"down.*kernel": "f d -> f@model d"}
    rules[".*"] = "... -> ..."
    x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    report = einshard.explain(jax.grad(loss), state, x, mesh=MESH, in_specs=(rules, "b d -> b@data d"))
    forward = [op for op in report.ops if op.phase == "forward" and op.primitive == "dot_general"]
    assert forward[0].expression == "b@data d, d f@model -> b@data f@model"
    assert forward[0].reads == ("x", "state.up.kernel.value")
    assert "inside flax/nnx/nn/linear.py" in str(report)
