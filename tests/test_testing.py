"""einshard.testing: strategies that shrink to the simplest layout, and checks against plain JAX and XLA.

* An Equinox MLP is layout-invariant (values and gradients) under drawn layouts on an Auto mesh; a
  params-dict loss under drawn layouts on an Explicit mesh.
* A hand-written shard_map kernel with a bug (a psum of local means, where a pmean belongs) is caught,
  and hypothesis shrinks the failure to a one-mesh-axis expression, which the message quotes.
* assert_collectives / assert_explained on a Megatron MLP under DP x TP, (4, 2) mesh: pass when right,
  name the op when the expectation (or explain) is wrong.  assert_fits around XLA's own number.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
import einshard.testing as et
from einshard import EinshardError


@pytest.fixture(scope="module")
def auto():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def explicit():
    return jax.make_mesh((4, 2), ("data", "model"))  # jax.make_mesh's default: Explicit axes


def _mesh_axes_used(expr: str) -> list[str]:
    right = expr.split("->")[1]
    return [a for group in re.findall(r"@\(?([\w,]+)\)?", right) for a in group.split(",")]


FIND = settings(max_examples=200, database=None, deadline=None)


# ---------------------------------------------------------------------------
# Strategies: valid, and shrinking to the simplest layout


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_drawn_expressions_place_on_drawn_meshes(data):
    mesh = data.draw(et.meshes())
    assert mesh.devices.size == jax.device_count() and 1 <= len(mesh.axis_names) <= 3
    shape = tuple(data.draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 16]), max_size=3)))
    expr = data.draw(et.expressions(shape, mesh))
    used = _mesh_axes_used(expr)
    assert len(used) == len(set(used))  # each mesh axis splits at most one array axis
    y = einshard.einshard(np.zeros(shape, np.float32), expr, mesh=mesh)
    assert y.sharding.spec == einshard.spec(expr, shape, mesh=mesh)
    counted = data.draw(et.expressions(shape, None))
    assert einshard.einshard(np.zeros(shape, np.float32), counted).shape == shape


def test_expressions_shrink_to_one_mesh_axis(auto):
    assert find(et.expressions((8, 6), auto), lambda e: "@" in e, settings=FIND) == "a b -> a@data b"
    # Needing a particular axis: still only that one.
    assert find(et.expressions((8, 6), auto), lambda e: "model" in e, settings=FIND) == "a b -> a@model b"
    # Only axes that divide: 6 is not split over data (4).
    assert find(et.expressions((3, 6), auto), lambda e: "@" in e, settings=FIND) == "a b -> a b@model"
    # Counts (mesh=None): one array axis split, by the smallest count or by a star.
    counted = find(et.expressions((8, 6), None), lambda e: e != "a b -> a b", settings=FIND)
    assert counted in ("a b -> a2 b", "a b -> a* b")


def test_meshes_shrink_to_one_axis_and_explicit():
    m = find(et.meshes(), lambda m: True, settings=FIND)
    assert dict(m.shape) == {"data": jax.device_count()} and m.axis_types == (AxisType.Explicit,)
    m = find(et.meshes(), lambda m: AxisType.Auto in m.axis_types, settings=FIND)
    assert len(m.axis_names) == 1


def test_layouts_shrink_to_one_sharded_leaf_and_keep_rules(auto):
    tree = {"w1": np.zeros((8, 16)), "w2": np.zeros((16, 8)), "b": np.zeros(16), "n": 3}
    rules = {r"\['b'\]": "a -> a@model"}
    lay = find(
        et.layouts(tree, auto, rules=rules),
        lambda t: sum(e != "a b -> a b" for k, e in t.items() if k in ("w1", "w2")) > 0,
        settings=FIND,
    )
    assert lay == {"w1": "a b -> a@data b", "w2": "a b -> a b", "b": "a -> a@model", "n": None}


def test_einsums_shrink_and_fit(auto):
    case = find(et.einsums(auto), lambda c: "@" in c.expression, settings=settings(FIND, max_examples=60))
    assert len(case.operands) == 2 and case.expression.count("@") == 1
    assert re.fullmatch(r"(\w)@data, \1 -> ", case.expression), case.expression  # one axis, on the first operand


@settings(max_examples=6, deadline=None)
@given(et.einsums(st.sampled_from([(4, 2), (8,)]).map(lambda s: jax.make_mesh(s, ("data", "model")[: len(s)]))))
def test_drawn_einsums_run_as_annotated(case):
    xs = case.arrays()
    y = einshard.einsum(case.expression, *xs, mesh=case.mesh)
    got = np.asarray(y).sum(0) if y.ndim > len(case.output) else np.asarray(y)
    np.testing.assert_allclose(got, np.einsum(case.subscripts, *xs), rtol=1e-4, atol=1e-3)
    for x, spec in zip(xs, case.in_specs):
        assert NamedSharding(case.mesh, spec).shard_shape(x.shape)  # every split divides


def test_strategies_name_bad_arguments(auto):
    with pytest.raises(EinshardError, match="axes=.*'pipe'"):
        et.expressions((4,), auto, axes=["pipe"])
    with pytest.raises(EinshardError, match="max_axes"):
        et.meshes(max_axes=5)
    with pytest.raises(EinshardError, match="axis_types"):
        et.meshes(axis_types=["manual"])
    with pytest.raises(EinshardError, match="operands"):
        et.einsums(auto, operands=(3, 2))
    with pytest.raises(EinshardError, match="not a valid regular expression"):
        et.layouts({"w": np.zeros(4)}, auto, rules={"(": "a -> a"})


# ---------------------------------------------------------------------------
# assert_layout_invariant: an Equinox model (Auto), a params loss (Explicit)

AUTO = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
MODEL = eqx.nn.MLP(8, 4, 16, 1, key=jax.random.key(0))
BATCH = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)


def mlp_loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


@pytest.mark.slow  # ~1 s of compiling per example (forward and gradient), on 2 shared cores
@settings(max_examples=24, deadline=None)
@given(et.layouts((MODEL, BATCH), AUTO))
def test_equinox_mlp_is_layout_invariant_on_auto_mesh(lay):
    et.assert_layout_invariant(mlp_loss, MODEL, BATCH, layouts=lay, mesh=AUTO, grad=True)


EXPLICIT = jax.make_mesh((4, 2), ("data", "model"))
PARAMS = {
    "scale": np.linspace(0.5, 1.5, 16, dtype=np.float32),
    "table": np.arange(64.0, dtype=np.float32).reshape(8, 8),
}


def norm_loss(p):
    # Elementwise work and reductions only: these type-check on Explicit axes under any layout.
    t = p["table"] / 64.0
    return jnp.sum(jnp.tanh(t) ** 2) + jnp.sum(jnp.sin(p["scale"])) * jnp.max(t)


@settings(max_examples=12, deadline=None)
@given(et.layouts(PARAMS, EXPLICIT))
def test_loss_is_layout_invariant_on_explicit_mesh(lay):
    et.assert_layout_invariant(norm_loss, PARAMS, layouts=lay, mesh=EXPLICIT, grad=True)


@settings(max_examples=6, deadline=None)
@given(et.expressions(PARAMS["table"].shape, None))
def test_count_layouts_without_a_mesh(expr):
    """einshard 0.2 counts (mesh=None): placed on einshard's anonymous meshes.

    One array: arrays placed by counts of different mesh shapes live on different anonymous meshes, and
    jax.jit does not combine those (an IndivisibleError from JAX; see the report of issue 14).
    """
    et.assert_layout_invariant(lambda t: jnp.sum(jnp.tanh(t / 64.0) ** 2), PARAMS["table"], layouts=expr, grad=True)


def test_mesh_from_set_mesh(explicit):
    with jax.set_mesh(explicit):
        et.assert_layout_invariant(norm_loss, PARAMS, layouts={"scale": "a -> a@model", "table": "a b -> a@data b"})
        et.assert_collectives(lambda x: jnp.sum(x, 0), BATCH, layouts="a b -> a@data b", expected={"all-reduce": 1})


def test_layouts_may_be_rules_or_one_expression(auto):
    et.assert_layout_invariant(
        mlp_loss, MODEL, BATCH, layouts=({r"weight": "a b -> a b@model", ".*": None}, "a b -> a@data b"), mesh=auto
    )
    et.assert_layout_invariant(lambda x: jnp.sum(x, 0), BATCH, layouts="a b -> a b@(data,model)", mesh=auto)
    with pytest.raises(EinshardError, match="one entry per argument"):
        et.assert_layout_invariant(mlp_loss, MODEL, BATCH, layouts=("a b -> a b",) * 3, mesh=auto)
    with pytest.raises(EinshardError, match="do not match"):
        et.assert_layout_invariant(lambda p: p[0], [BATCH, BATCH], layouts=[["a b -> a b"] * 3], mesh=auto)


# ---------------------------------------------------------------------------
# A broken kernel is caught and shrunk to one mesh axis


def row_means(x):
    """A hand-written kernel: the mean over the last axis, run as a shard_map in the input's own layout.

    The bug: the local means are psum'd (a sum of means) where pmean belongs; it only shows when the
    last axis is split.  check_vma stays on: the program type-checks, its values are wrong.
    """
    spec = tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim
    spec = spec[: x.ndim]
    red = spec[-1]

    def body(b):
        m = b.mean(-1)
        return jax.lax.psum(m, red) if red else m

    return jax.shard_map(body, in_specs=P(*spec), out_specs=P(*spec[:-1]))(x)


def _fails(fn, x, expr, mesh):
    try:
        et.assert_layout_invariant(fn, x, layouts=expr, mesh=mesh)
    except AssertionError as err:
        return str(err)
    return None


def test_broken_kernel_is_caught_and_shrunk_to_one_axis(explicit):
    x = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)
    et.assert_layout_invariant(row_means, x, layouts="a b -> a@(data,model) b", mesh=explicit)  # rows only: fine
    minimal = find(et.expressions(x.shape, explicit), lambda e: _fails(row_means, x, e, explicit), settings=FIND)
    assert minimal == "a b -> a b@data"  # one mesh axis (the first), on the reduced axis
    message = _fails(row_means, x, minimal, explicit)
    assert "fn(*args) differs from the unsharded run" in message and repr(minimal) in message

    # The same through @given: hypothesis reports the shrunk layout.
    @settings(max_examples=30, database=None, deadline=None)
    @given(et.layouts(x, explicit))
    def check(lay):
        et.assert_layout_invariant(row_means, x, layouts=lay, mesh=explicit)

    with pytest.raises(AssertionError) as err:
        check()
    text = str(err.value)
    assert "args[0]: 'a b -> a b@data'" in text, text


def test_explicit_type_errors_name_the_layout_outside_hypothesis_and_are_rejected_under_it(explicit):
    from hypothesis.errors import NoSuchExample, Unsatisfiable

    w, x = np.ones((8, 8), np.float32), np.ones((4, 8), np.float32)
    lay = ("a b -> a@data b", "a b -> a b@model")  # the contraction split over data in w, over model in x
    with pytest.raises(AssertionError, match="raised ShardingTypeError sharded"):
        et.assert_layout_invariant(lambda w, x: x @ w, w, x, layouts=lay, mesh=explicit)
    # Under hypothesis (find, @given) a layout JAX refuses to trace is a rejected example (issue 22): even drawing
    # leaves that share mesh axes, no layout "fails" x @ w, whose values are right wherever JAX runs it.
    with pytest.raises((NoSuchExample, Unsatisfiable)):
        find(
            et.layouts((w, x), explicit, sharing="any"),
            lambda t: _matmul_fails(w, x, t, explicit),
            settings=settings(FIND, max_examples=15),
        )


def _matmul_fails(w, x, lay, mesh):
    try:
        et.assert_layout_invariant(lambda w, x: x @ w, w, x, layouts=lay, mesh=mesh)
    except AssertionError:
        return True
    return False


# ---------------------------------------------------------------------------
# Collectives and memory: Megatron MLP under DP x TP on (4, 2)

MEGATRON = ({"w1": "d f -> d f@model", "w2": "f d -> f@model d"}, "b d -> b@data d")


def megatron(p, x):
    return jax.nn.relu(x @ p["w1"]) @ p["w2"]


def megatron_explicit(p, x):
    h = jax.nn.relu(x @ p["w1"])
    return jnp.matmul(h, p["w2"], out_sharding=P("data", None))  # contracted over model: say where the sum lands


def _megatron_args():
    rng = np.random.default_rng(0)
    p = {"w1": rng.standard_normal((16, 32)).astype(np.float32), "w2": rng.standard_normal((32, 16)).astype(np.float32)}
    return p, rng.standard_normal((8, 16)).astype(np.float32)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_megatron_collectives_and_explain(kind, auto, explicit):
    mesh, fn = (auto, megatron) if kind == "auto" else (explicit, megatron_explicit)
    p, x = _megatron_args()
    found = et.assert_collectives(fn, p, x, layouts=MEGATRON, mesh=mesh, expected={"all-reduce": 1})
    assert found[0].group_size == 2
    et.assert_collectives(fn, p, x, layouts=MEGATRON, mesh=mesh, expected=["all-reduce"])
    report = et.assert_explained(fn, p, x, layouts=MEGATRON, mesh=mesh)
    assert report.comm_count == 1
    with pytest.raises(AssertionError, match=r"1 all-reduce .*not compiled|more all-reduce"):
        et.assert_collectives(fn, p, x, layouts=MEGATRON, mesh=mesh, expected={"all-reduce": 2})
    with pytest.raises(AssertionError, match=r"1 more all-reduce than expected, e\.g\. .*all-reduce\("):
        et.assert_collectives(fn, p, x, layouts=MEGATRON, mesh=mesh, expected={"all-gather": 1})
    et.assert_layout_invariant(fn, p, x, layouts=MEGATRON, mesh=mesh)


def test_data_parallel_gradient_is_explained(auto):
    """docs/theory.md V12: the gradient of a replicated weight under a data-split batch is one all-reduce."""

    def loss(w, x):
        return jnp.mean((x @ w) ** 2)

    w, x = np.ones((16, 8), np.float32), np.ones((32, 16), np.float32)
    et.assert_explained(jax.grad(loss), w, x, layouts=("a b -> a b", "a b -> a@data b"), mesh=auto)
    et.assert_collectives(
        jax.grad(loss), w, x, layouts=("a b -> a b", "a b -> a@data b"), mesh=auto, expected=["all-reduce"]
    )


def test_cpu_reduce_scatter_is_an_all_reduce_and_a_slice():
    """On CPU a reduce-scatter compiles to all-reduce + dynamic-slice: read as a reduce-scatter, and equal to
    explain's, which reduce-scatters a partial sum that goes straight into a sharding constraint."""
    mesh = jax.make_mesh((8,), ("model",), axis_types=(AxisType.Auto,))
    x, w = np.ones((8, 16), np.float32), np.ones((16, 32), np.float32)

    def f(x, w):
        return jax.lax.with_sharding_constraint(x @ w, NamedSharding(mesh, P(None, "model")))

    lay = ("a b -> a b@model", "a b -> a@model b")
    (rs,) = et.assert_collectives(f, x, w, layouts=lay, mesh=mesh, expected={"reduce-scatter": 1})
    assert rs.sliced and rs.group_size == 8
    report = et.assert_explained(f, x, w, layouts=lay, mesh=mesh)
    assert [c.kind for op in report.ops for c in op.collectives] == ["reduce-scatter"]


def test_assert_explained_names_the_op_explain_got_wrong(auto, monkeypatch):
    import einshard._src.analysis as analysis  # where assert_explained reads explain from

    real = analysis.explain

    def forgets_collectives(*args, **kwargs):
        r = real(*args, **kwargs)
        return dataclasses.replace(r, ops=tuple(dataclasses.replace(op, collectives=()) for op in r.ops))

    monkeypatch.setattr(analysis, "explain", forgets_collectives)
    p, x = _megatron_args()
    with pytest.raises(AssertionError, match=r"explain predicted \{\}, XLA compiled \{'all-reduce': 1\}") as err:
        et.assert_explained(megatron, p, x, layouts=MEGATRON, mesh=auto)
    assert "1 more all-reduce than einshard.explain predicted" in str(err.value)


def test_expected_kinds_are_checked(auto):
    p, x = _megatron_args()
    with pytest.raises(EinshardError, match="collective kinds"):
        et.assert_collectives(megatron, p, x, layouts=MEGATRON, mesh=auto, expected={"allreduce": 1})


def test_assert_fits_around_xlas_number(auto):
    p, x = _megatron_args()
    placed, _ = et.place_args((p, x), MEGATRON, auto)
    mem = jax.jit(megatron).lower(*placed).compile().memory_analysis()
    need = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    assert et.assert_fits(megatron, p, x, layouts=MEGATRON, mesh=auto, budget=need) == need
    assert et.assert_fits(megatron, *placed, budget="1MiB") == need
    with pytest.raises(AssertionError, match=f"needs {need:,} bytes per device .*over the budget of {need - 1:,}"):
        et.assert_fits(megatron, *placed, budget=need - 1)
    with pytest.raises(EinshardError, match="not a size"):
        et.assert_fits(megatron, *placed, budget="lots")


# ---------------------------------------------------------------------------
# The optional extra


def test_strategies_without_hypothesis_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # `import hypothesis` now raises ImportError
    monkeypatch.delitem(sys.modules, "einshard._src.testing.strategies")
    with pytest.raises(ImportError, match=r"einshard\[testing\]"):
        importlib.import_module("einshard._src.testing.strategies")
    monkeypatch.delitem(sys.modules, "einshard._src.testing.strategies", raising=False)
    with pytest.raises(ImportError, match=r"einshard\[testing\]"):
        et.__getattr__("layouts")


@pytest.mark.slow
def test_import_einshard_does_not_import_hypothesis():
    code = (
        "import sys; import einshard\n"
        "assert 'hypothesis' not in sys.modules, 'import einshard imported hypothesis'\n"
        "sys.modules['hypothesis'] = None\n"
        "import einshard.testing, einshard.testing.hlo\n"
        "assert einshard.testing.hlo.normalized('') == []\n"
        "try:\n    einshard.testing.expressions\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "einshard[testing]" in out.stdout
