"""The explicit-sharding assistant (einshard.check_explicit) against JAX itself.

For every op the assistant flags, JAX raises ShardingTypeError when the same function is traced on the Explicit
mesh; for every fix it offers (out_sharding=, jax.reshard), JAX accepts the fixed function and its values equal
the unsharded result.  Functions it does not flag trace on the Explicit mesh.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax._src.core import ShardingTypeError
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.explicit import Fix


@pytest.fixture(scope="module")
def mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes: JAX's default


def _placed(mesh: Any, shape: tuple[int, ...], spec: P, seed: int = 0) -> jax.Array:
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return jax.device_put(x, NamedSharding(mesh, spec))


def _jax_rejects(fn: Any, *args: Any) -> bool:
    try:
        jax.jit(fn).trace(*args)
    except ShardingTypeError:
        return True
    return False


def _fixed_dot(fix: Fix, dn: Any) -> Any:
    """The matmul with the fix applied as the fix's code says."""

    def f(a: jax.Array, b: jax.Array) -> jax.Array:
        ops = [a, b]
        if fix.kind == "reshard":
            assert fix.operand is not None
            ops[fix.operand] = jax.reshard(ops[fix.operand], fix.spec)
        out = fix.spec if fix.kind == "out_sharding" else None
        return jax.lax.dot_general(ops[0], ops[1], dn, out_sharding=out)

    return f


def _check_dot(
    mesh: Any, ls: tuple[int, ...], rs: tuple[int, ...], lspec: P, rspec: P, dn: Any, expect: bool | None = None
) -> None:
    a, b = _placed(mesh, ls, lspec, 1), _placed(mesh, rs, rspec, 2)
    want = jax.lax.dot_general(np.asarray(a), np.asarray(b), dn, precision="highest")

    def plain(a: jax.Array, b: jax.Array) -> jax.Array:
        return jax.lax.dot_general(a, b, dn)

    report = einshard.check_explicit(plain, a, b)
    assert bool(report.findings) == _jax_rejects(plain, a, b), str(report)
    assert expect is None or bool(report.findings) == expect
    if not report.findings:
        return
    (finding,) = report.findings
    assert finding.primitive == "dot_general"
    assert "test_explicit_assistant.py" in finding.where
    priced = [f for f in finding.fixes if f.kind != "auto_axes"]
    assert priced, str(report)
    costs = [(f.time_s, f.comm_bytes) for f in priced]
    assert costs == sorted(costs)  # cheapest first
    for fix in priced:
        with jax.set_mesh(mesh):  # a P(...) in out_sharding= needs the mesh set, as the report says
            got = jax.jit(_fixed_dot(fix, dn))(a, b)  # JAX accepts it (it would raise otherwise) ...
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)  # ... and it computes the same
        if fix.kind == "out_sharding":
            assert jax.typeof(got).sharding.spec == fix.spec
    (auto,) = [f for f in finding.fixes if f.kind == "auto_axes"]  # the op run with the axes Auto
    with jax.set_mesh(mesh):
        wrapped = jax.sharding.auto_axes(lambda a, b: jax.lax.dot_general(a, b, dn), out_sharding=auto.spec)
        got = jax.jit(wrapped)(a, b)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert jax.typeof(got).sharding.spec == auto.spec


def test_megatron_row_matmul_is_flagged_with_the_line_and_fixes_jax_accepts(mesh: Any) -> None:
    _check_dot(mesh, (16, 32), (32, 8), P("data", "model"), P("model", None), (((1,), (0,)), ((), ())), True)


def test_contraction_split_on_one_side_only(mesh: Any) -> None:
    _check_dot(mesh, (16, 32), (32, 8), P(None, "model"), P(None, None), (((1,), (0,)), ((), ())))


def test_a_legal_matmul_is_not_flagged(mesh: Any) -> None:
    a, b = _placed(mesh, (16, 32), P("data", None)), _placed(mesh, (32, 8), P(None, "model"))
    report = einshard.check_explicit(lambda a, b: a @ b, a, b)
    assert report.ok and report.findings == ()
    assert "JAX accepts every op" in str(report)


_SIZES = st.sampled_from([8, 16])
_AXES = st.sampled_from([None, "data", "model", ("data", "model")])


def _spec_of(entries: list[Any]) -> P:
    """Entries as a valid PartitionSpec: a mesh axis used a second time is dropped (JAX allows one use)."""
    used: set[str] = set()
    out: list[Any] = []
    for e in entries:
        axes = () if e is None else (e,) if isinstance(e, str) else e
        keep = tuple(a for a in axes if a not in used)
        used.update(keep)
        out.append(None if not keep else keep[0] if len(keep) == 1 else keep)
    return P(*out)


@st.composite
def _dots(draw: Any) -> tuple[Any, ...]:
    m, k, n = draw(_SIZES), draw(_SIZES), draw(_SIZES)
    specs = [draw(_AXES) for _ in range(4)]
    if draw(st.booleans()):
        b = draw(st.sampled_from([4, 8]))
        bspec = draw(st.sampled_from([None, "data"]))
        ls, rs = (b, m, k), (b, k, n)
        lspec, rspec = _spec_of([bspec, specs[0], specs[1]]), _spec_of([bspec, specs[2], specs[3]])
        dn = (((2,), (1,)), ((0,), (0,)))
    else:
        ls, rs = (m, k), (k, n)
        lspec, rspec = _spec_of(specs[:2]), _spec_of(specs[2:])
        dn = (((1,), (0,)), ((), ()))
    return ls, rs, lspec, rspec, dn


def _valid(shape: tuple[int, ...], spec: P) -> bool:
    used: list[str] = []
    for size, e in zip(shape, spec):
        axes = () if e is None else (e,) if isinstance(e, str) else e
        n = int(np.prod([{"data": 4, "model": 2}[a] for a in axes]))
        if size % n or any(a in used for a in axes):
            return False
        used += list(axes)
    return True


@settings(max_examples=15)  # each example compiles every fix: bounded so the default run stays fast
@given(_dots())
def test_property_dot_general_flagged_exactly_when_jax_rejects_and_fixes_run(mesh: Any, case: tuple[Any, ...]) -> None:
    ls, rs, lspec, rspec, dn = case
    from hypothesis import assume

    assume(_valid(ls, lspec) and _valid(rs, rspec))
    _check_dot(mesh, ls, rs, lspec, rspec, dn)


# -- reshape ---------------------------------------------------------------------------------------------------


def _check_reshape(
    mesh: Any, shape: tuple[int, ...], spec: P, new: tuple[int, ...], expect: bool | None = None
) -> None:
    x = _placed(mesh, shape, spec, 3)
    want = np.asarray(x).reshape(new)

    def plain(x: jax.Array) -> jax.Array:
        return jnp.reshape(x, new)

    report = einshard.check_explicit(plain, x)
    assert bool(report.findings) == _jax_rejects(plain, x), str(report)
    assert expect is None or bool(report.findings) == expect
    if not report.findings:
        return
    (finding,) = report.findings
    assert finding.primitive == "reshape" and finding.operands[0].name == "x"
    priced = [f for f in finding.fixes if f.kind != "auto_axes"]
    assert priced
    for fix in priced:

        def fixed(x: jax.Array, fix: Fix = fix) -> jax.Array:
            if fix.kind == "reshard":
                return jnp.reshape(jax.reshard(x, fix.spec), new)
            return jnp.reshape(x, new, out_sharding=fix.spec)

        with jax.set_mesh(mesh):
            got = jax.jit(fixed)(x)
        np.testing.assert_array_equal(np.asarray(got), want)
    (auto,) = [f for f in finding.fixes if f.kind == "auto_axes"]
    with jax.set_mesh(mesh):
        got = jax.jit(jax.sharding.auto_axes(plain, out_sharding=auto.spec))(x)
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(
    "shape,spec,new",
    [((8, 4), P(None, "data"), (32,)), ((32,), P("data"), (2, 16)), ((8, 6), P(None, "model"), (48,))],
)
def test_reshape_merging_or_splitting_split_dims_is_flagged(mesh: Any, shape: Any, spec: P, new: Any) -> None:
    _check_reshape(mesh, shape, spec, new, expect=True)


def test_reshape_merging_under_a_split_major_dim_is_legal(mesh: Any) -> None:
    x = _placed(mesh, (8, 4, 6), P("data", None, "model"))
    report = einshard.check_explicit(lambda x: x.reshape(32, 6), x)
    assert report.ok and not _jax_rejects(lambda x: x.reshape(32, 6), x)


@st.composite
def _reshapes(draw: Any) -> tuple[Any, ...]:
    shape = tuple(draw(st.lists(st.sampled_from([2, 4, 8]), min_size=2, max_size=3)))
    entries = [draw(_AXES) for _ in shape]
    # A dim too small for its split stays whole (the drawn layout must be one JAX can place).
    sizes = {"data": 4, "model": 2}
    fitting = [
        e if e is None or s % int(np.prod([sizes[a] for a in ((e,) if isinstance(e, str) else e)])) == 0 else None
        for s, e in zip(shape, entries)
    ]
    total = int(np.prod(shape))
    new = draw(
        st.sampled_from(
            [
                (total,),
                (shape[0] * shape[1], *shape[2:]),
                (shape[0], total // shape[0]),
                (2, total // 2),
                (total // 4, 4),
            ]
        )
    )
    return shape, _spec_of(fitting), new


@settings(max_examples=15)
@given(_reshapes())
def test_property_reshape_flagged_exactly_when_jax_rejects_and_fixes_run(mesh: Any, case: tuple[Any, ...]) -> None:
    from hypothesis import assume

    shape, spec, new = case
    assume(_valid(shape, spec))
    _check_reshape(mesh, shape, spec, new)


# -- gather, scatter, a whole model ----------------------------------------------------------------------------


def test_gather_across_split_axes_is_flagged_and_its_fix_runs(mesh: Any) -> None:
    table = _placed(mesh, (32, 8), P("data", "model"), 4)
    idx = jax.device_put(np.arange(8, dtype=np.int32)[::-1].copy(), NamedSharding(mesh, P("data")))

    def lookup(table: jax.Array, idx: jax.Array) -> jax.Array:
        return table[idx]

    report = einshard.check_explicit(lookup, table, idx)
    assert _jax_rejects(lookup, table, idx)
    (finding,) = report.findings
    assert finding.primitive == "gather"
    assert [o.name for o in finding.operands][0] == "table"
    want = np.asarray(table)[np.asarray(idx)]
    assert [f.kind for f in finding.fixes if f.kind != "auto_axes"]
    for fix in finding.fixes:
        with jax.set_mesh(mesh):
            if fix.kind == "out_sharding":
                got = jax.jit(lambda t, i, s=fix.spec: t.at[i].get(out_sharding=s))(table, idx)
            elif fix.kind == "reshard":
                got = jax.jit(_resharded_lookup(fix))(table, idx)
            else:  # auto_axes: the lookup run with the axes Auto
                got = jax.jit(jax.sharding.auto_axes(lookup, out_sharding=fix.spec))(table, idx)
        np.testing.assert_array_equal(np.asarray(got), want)


def _resharded_lookup(fix: Fix) -> Any:
    def f(table: jax.Array, idx: jax.Array) -> jax.Array:
        ops = [table, idx]
        assert fix.operand is not None
        ops[fix.operand] = jax.reshard(ops[fix.operand], fix.spec)
        return ops[0][ops[1]]

    return f


def test_scatter_across_split_axes_is_flagged(mesh: Any) -> None:
    x = _placed(mesh, (32, 8), P("data", "model"), 5)
    idx = jax.device_put(np.arange(8, dtype=np.int32), NamedSharding(mesh, P("data")))
    upd = _placed(mesh, (8, 8), P("data", None), 6)

    def update(x: jax.Array, idx: jax.Array, upd: jax.Array) -> jax.Array:
        return x.at[idx].add(upd)

    report = einshard.check_explicit(update, x, idx, upd)
    assert bool(report.findings) == _jax_rejects(update, x, idx, upd)
    want = np.asarray(x).copy()
    np.add.at(want, np.asarray(idx), np.asarray(upd))
    for finding in report.findings:
        assert finding.primitive.startswith("scatter")
        for fix in finding.fixes:
            if fix.kind == "out_sharding":
                with jax.set_mesh(mesh):
                    got = jax.jit(lambda x, i, u, s=fix.spec: x.at[i].add(u, out_sharding=s))(x, idx, upd)
                np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def _mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"])
    y = h @ params["w2"]
    return jnp.mean(y.reshape(-1) ** 2)


def _two_mistakes(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"])
    y = h @ params["w2"]  # row-parallel: contracts the split 'model' dim
    flat = params["t"].reshape(-1)  # merges two split dims
    return jnp.mean(y**2) + jnp.mean(flat**2)


def test_every_rejected_op_of_a_training_step_is_named_not_only_the_first(mesh: Any) -> None:
    params = {
        "w1": _placed(mesh, (16, 32), P(None, "model")),
        "w2": _placed(mesh, (32, 16), P("model", None)),
        "t": _placed(mesh, (8, 4), P(None, "data")),
    }
    x = _placed(mesh, (8, 16), P("data", None))
    with pytest.raises(ShardingTypeError):
        jax.jit(jax.grad(_two_mistakes)).trace(params, x)
    report = einshard.check_explicit(jax.grad(_two_mistakes), params, x)
    prims = [f.primitive for f in report.findings]
    assert prims[:2] == ["dot_general", "reshape"], str(report)
    first, second = report.findings[:2]
    names = sorted(o.name for o in first.operands)
    assert names[0] == "params.w2" and names[1].startswith("the result of tanh at tests/test_explicit_assistant.py:")
    assert second.operands[0].name == "params.t"
    assert all("_two_mistakes" in f.where for f in report.findings[:2])
    d = report.to_dict()
    json.dumps(d)
    assert d["findings"][0]["where"] == first.where and d["findings"][0]["fixes"][0]["code"]
    # The cheapest fixes, applied in the user's code, make JAX accept the step and compute the unsharded gradient.
    dot_fix, reshape_fix = first.fixes[0], second.fixes[0]
    assert dot_fix.kind == "out_sharding", str(report)

    def fixed(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ params["w1"])
        y = jnp.matmul(h, params["w2"], out_sharding=dot_fix.spec)
        t = params["t"]
        if reshape_fix.kind == "reshard":
            flat = jax.reshard(t, reshape_fix.spec).reshape(-1)
        else:
            flat = jnp.reshape(t, (-1,), out_sharding=reshape_fix.spec)
        return jnp.mean(y**2) + jnp.mean(flat**2)

    with jax.set_mesh(mesh):
        again = einshard.check_explicit(jax.grad(fixed), params, x)
        got = jax.jit(jax.grad(fixed))(params, x)
    want = jax.grad(_two_mistakes)(jax.tree.map(np.asarray, params), np.asarray(x))
    for k in params:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-4, atol=1e-6)
    assert again.ok, str(again)


def test_shape_only_arguments_and_mesh_sizes(mesh: Any) -> None:
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    w = jax.ShapeDtypeStruct((16, 4), jnp.float32)
    report = einshard.check_explicit(
        lambda x, w: x @ w, x, w, mesh={"data": 4, "model": 2}, in_specs=(P("data", "model"), P("model", None))
    )
    assert [f.primitive for f in report.findings] == ["dot_general"]
    placed = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    wp = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    assert [f.primitive for f in einshard.check_explicit(lambda x, w: x @ w, placed, wp).findings] == ["dot_general"]
    with jax.set_mesh(mesh):
        xs = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=P("data", "model"))
        ws = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=P("model", None))
        assert len(einshard.check_explicit(lambda x, w: x @ w, xs, ws).findings) == 1


def test_under_jit_scan_and_in_specs(mesh: Any) -> None:
    w = jax.ShapeDtypeStruct((3, 16, 16), jnp.float32)
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32)

    @jax.jit
    def layers(w: jax.Array, x: jax.Array) -> jax.Array:
        def body(h: jax.Array, wi: jax.Array) -> tuple[jax.Array, None]:
            return jnp.tanh(h @ wi), None

        return jax.lax.scan(body, x, w)[0]

    report = einshard.check_explicit(
        layers, w, x, mesh=mesh, in_specs=("l d f -> l d@model f", "b d -> b@data d@model")
    )
    assert [f.primitive for f in report.findings] == ["dot_general"]
    assert "body" in report.findings[0].where


def test_a_mesh_without_explicit_axes_is_refused_by_name() -> None:
    auto = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(einshard.EinshardError, match="no Explicit axes"):
        einshard.check_explicit(lambda x: x, jnp.ones(8), mesh=auto)


def test_without_the_typed_trace_the_walk_still_names_the_op(mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where JAX's internals moved (the typed trace is unavailable), the check types the untyped jaxpr itself."""
    from einshard._src.analysis import explicit

    def moved(*_: Any, **__: Any) -> Any:
        raise LookupError("moved")

    monkeypatch.setattr(explicit, "typed_jaxpr", moved)
    a, b = _placed(mesh, (16, 32), P("data", "model")), _placed(mesh, (32, 8), P("model", None))
    report = einshard.check_explicit(lambda a, b: a @ b, a, b)
    assert [f.primitive for f in report.findings] == ["dot_general"]
    assert report.findings[0].fixes[0].kind == "out_sharding"


def test_the_check_leaves_jax_raising_as_before(mesh: Any) -> None:
    """Tracing past JAX's errors must not leave a trace typed past one in JAX's caches."""
    a, b = _placed(mesh, (16, 32), P("data", "model")), _placed(mesh, (32, 8), P("model", None))

    @jax.jit
    def inner(a: jax.Array, b: jax.Array) -> jax.Array:
        return a @ b

    assert einshard.check_explicit(lambda a, b: inner(a, b) * 2, a, b).findings
    with pytest.raises(ShardingTypeError):
        inner(a, b)


def test_explain_on_an_explicit_mesh_goes_past_jax_errors_and_carries_the_findings(mesh: Any) -> None:
    params = {"w1": _placed(mesh, (16, 32), P(None, "model")), "w2": _placed(mesh, (32, 16), P("model", None))}
    x = _placed(mesh, (8, 16), P("data", None))
    with pytest.raises(ShardingTypeError):
        jax.jit(jax.grad(_two_mistakes_free)).trace(params, x)
    report = einshard.explain(jax.grad(_two_mistakes_free), params, x)
    assert report.explicit is not None and [f.primitive for f in report.explicit.findings] == ["dot_general"]
    finding = report.explicit.findings[0]
    assert "_two_mistakes_free" in finding.where
    # Costed as JAX runs the program with the assumed fix: the row-parallel matmul summed back over 'model'.
    assert any(c.kind == "all-reduce" and c.axes == ("model",) for op in report.ops for c in op.collectives)
    text = str(report)
    assert "JAX rejects 1 op" in text and finding.where in text
    d = report.to_dict()
    json.dumps(d)
    assert d["explicit"]["findings"][0]["where"] == finding.where
    # A program JAX accepts has no findings on its report.
    with jax.set_mesh(mesh):
        assert einshard.explain(lambda x: x * 2, x).explicit is None


def _two_mistakes_free(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)


_USER_FILE = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

def check():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    w = jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    return (lambda x, w: jnp.tanh(x @ w)), (x, w)
"""


def test_cli_check_explicit_on_a_users_function(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from einshard_apps.cli import main

    path = tmp_path / "my_model.py"
    path.write_text(_USER_FILE)
    assert main(["check-explicit", "--function", f"{path}:check"]) == 1  # a rejected op: a CI step fails
    out = capsys.readouterr().out
    assert "1 op JAX rejects" in out and "my_model.py:9 (check.<locals>.<lambda>)" in out and "out_sharding=" in out
    assert main(["check-explicit", "--function", f"{path}:check", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["findings"][0]["primitive"] == "dot_general"
    assert main(["check-explicit", "--function", f"{path}:nothing"]) == 2
    assert "has no 'nothing'" in capsys.readouterr().err


def test_cli_check_explicit_on_the_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    from einshard_apps.cli import main

    # The demo model says the layouts JAX cannot infer (out_sharding=, reshard, auto_axes): JAX accepts every op.
    status = main(["check-explicit", "--layout", "hybrid", "--mesh", "data=4,model=2"])
    out = capsys.readouterr().out
    assert status == 0 and "layout hybrid" in out and "(Explicit: data, model): JAX accepts every op" in out
    assert main(["check-explicit", "--layout", "fsdp-tp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.split("\n", 1)[1])["findings"] == []


def test_a_refusal_that_is_no_sharding_rule_is_reported_with_the_line(mesh: Any) -> None:
    """A weight closed over inside auto_axes: JAX refuses it (its type is on the Explicit axes), not a rule."""
    w = _placed(mesh, (16, 8), P("model", None))
    x = _placed(mesh, (8, 16), P("data", "model"))

    def closes_over(w: jax.Array, x: jax.Array) -> jax.Array:
        return jax.sharding.auto_axes(lambda x: x @ w, out_sharding=P("data", None))(x)

    with jax.set_mesh(mesh):
        report = einshard.check_explicit(closes_over, w, x)
    assert not report.ok and "context mesh" in report.refused
    assert "test_explicit_assistant.py" in report.refused and "JAX refuses the program" in str(report)
    assert report.to_dict()["refused"] == report.refused


def test_a_mixed_mesh_checks_its_explicit_axes_only() -> None:
    """On a mesh with 'data' Explicit and 'model' Auto, JAX types (and refuses) only what 'data' splits."""
    from jax.sharding import AxisType

    mixed = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    a = jax.device_put(np.ones((16, 32), np.float32), NamedSharding(mixed, P(None, "data")))
    b = jax.device_put(np.ones((32, 8), np.float32), NamedSharding(mixed, P("data", "model")))
    report = einshard.check_explicit(lambda a, b: a @ b, a, b)
    assert report.explicit_axes == ("data",)
    assert [f.primitive for f in report.findings] == ["dot_general"]
    assert _jax_rejects(lambda a, b: a @ b, a, b)
    assert all("model" not in str(o.spec) for o in report.findings[0].operands)  # Auto axes are not in types
    for fix in report.findings[0].fixes:
        if fix.kind == "out_sharding":
            with jax.set_mesh(mixed):
                got = jax.jit(lambda a, b, s=fix.spec: jnp.matmul(a, b, out_sharding=s))(a, b)
            np.testing.assert_allclose(np.asarray(got), np.full((16, 8), 32.0))
