"""The one mesh resolver (einshard/core/mesh.py), the validated Layout, and placement where users are.

Placement on jax.make_mesh's default (Explicit) mesh, Auto and mixed meshes; the mesh from mesh=, from
jax.set_mesh, or from the operands; eager and under jax.jit / jax.grad / jax.vmap.  Each cell is compared with
what plain JAX says (the sharding in the value's type, or the concrete array's sharding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard import EinshardError
from einshard._src.core.layout import Layout, MeshAxis, spec_partitions
from einshard._src.core.mesh import current_mesh, mesh_axes, operand_mesh, resolve_mesh

KINDS = {
    "explicit": None,  # jax.make_mesh's default
    "auto": (AxisType.Auto, AxisType.Auto),
    "mixed": (AxisType.Explicit, AxisType.Auto),
}
MESHES = {
    k: jax.make_mesh((4, 2), ("data", "model"), **({} if t is None else {"axis_types": t})) for k, t in KINDS.items()
}
OTHER = jax.make_mesh((2, 4), ("data", "model"))
X = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
EXPR = "b d -> b@data d@model"


# ---------------------------------------------------------------------------
# The resolver's precedence


@pytest.mark.parametrize("kind", KINDS)
def test_precedence_mesh_arg_then_context_then_operands(kind):
    mesh = MESHES[kind]
    placed = einshard.einshard(X, EXPR, mesh=mesh)
    assert resolve_mesh(None, [placed]) == mesh  # the operands' mesh
    with jax.set_mesh(mesh):
        assert resolve_mesh(None, [X]) == mesh  # the current mesh
        assert resolve_mesh(mesh, [placed]) == mesh

    @jax.jit
    def traced(x):
        # Under jit without set_mesh: the tracer's type carries the abstract mesh.
        found = resolve_mesh(None, [x])
        assert dict(found.shape) == {"data": 4, "model": 2}
        assert operand_mesh(x) == found
        return x

    traced(placed)
    with jax.set_mesh(mesh):
        jax.jit(lambda x: (assert_abstract(resolve_mesh(None, [x])), x)[1])(placed)


def assert_abstract(m):
    assert isinstance(m, jax.sharding.AbstractMesh) and dict(m.shape) == {"data": 4, "model": 2}


def test_operands_on_another_mesh_are_an_error_naming_both():
    placed = einshard.einshard(X, EXPR, mesh=MESHES["explicit"])
    with jax.set_mesh(OTHER), pytest.raises(EinshardError) as err:
        resolve_mesh(None, [placed], what="einshard.einsum")
    text = str(err.value)
    assert "'data': 4, 'model': 2" in text and "'data': 2, 'model': 4" in text and "einshard.einsum" in text
    # Placement moves arrays between meshes on purpose: no check there.
    assert resolve_mesh(OTHER, [placed], check_operands=False) == OTHER


@pytest.mark.parametrize("kind", list(KINDS))
def test_shape_dtype_structs_with_shardings_give_their_mesh_and_layouts(kind):
    """What ``jit(f).lower`` takes is enough for explain: no mesh=, no set_mesh, no data."""
    from einshard.testing import hlo

    mesh = MESHES[kind]
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))  # noqa: E731
    w, x = sds((64, 128), P(None, "model")), sds((32, 64), P("data"))
    assert operand_mesh(w) == mesh and resolve_mesh(None, [w, x]) == mesh

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    fn = jax.grad(loss)
    report = einshard.explain(fn, w, x)
    named = einshard.explain(fn, w, x, mesh=mesh, in_specs=(P(None, "model"), P("data")))
    assert report.comm_bytes == named.comm_bytes and report.peak_bytes == named.peak_bytes
    # Against the compiler, on the same description of the arguments.
    compiled = jax.jit(fn, out_shardings=w.sharding).lower(w, x).compile()
    xla = sorted(c.kind for c in hlo.normalized(compiled.as_text()) for _ in range(c.runs))
    ours = sorted(c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1)
    assert ours == xla


def test_no_mesh_anywhere_is_an_error_that_says_how():
    with pytest.raises(EinshardError, match="set_mesh"):
        resolve_mesh(None, [X], what="einshard.analyze")
    assert resolve_mesh(None, [X], required=False) is None


@pytest.mark.parametrize(
    "bad, words",
    [({"data": 0}, "positive integers"), ({"data": 2.5}, "positive integers"), ({3: 2}, "axis names"), ("data", "str")],
)
def test_bad_mesh_argument(bad, words):
    with pytest.raises(EinshardError, match=words):
        resolve_mesh(bad)


def test_dict_of_sizes_is_enough_for_layouts_but_not_to_place_data():
    assert mesh_axes({"data": 4, "model": 2}) == (MeshAxis("data", 4), MeshAxis("model", 2))
    assert str(einshard.layout(EXPR, (8, 4), mesh={"data": 4, "model": 2})) == "[b:8@data d:4@model]"
    assert tuple(einshard.spec(EXPR, (8, 4), mesh={"data": 4, "model": 2})) == ("data", "model")
    with pytest.raises(EinshardError, match="concrete jax.sharding.Mesh"):
        einshard.einshard(X, EXPR, mesh={"data": 4, "model": 2})


# ---------------------------------------------------------------------------
# Placement in every context, against the sharding JAX reports


@pytest.mark.parametrize("source", ["mesh=", "set_mesh", "operands"])
@pytest.mark.parametrize("kind", KINDS)
def test_placement_under_jit_grad_vmap(kind, source):
    mesh = MESHES[kind]
    start = einshard.einshard(X, "b d -> b d", mesh=mesh)  # on the mesh, replicated
    kw = {"mesh": mesh} if source == "mesh=" else {}

    def f(x):
        return einshard.einshard(x, EXPR, **kw)

    ctx = jax.set_mesh(mesh) if source == "set_mesh" else _null()
    with ctx:
        eager = f(start)
        jitted = jax.jit(f)(start)
        refused = kind != "auto" and source != "set_mesh"  # plain JAX cannot either (see below)
        if refused:
            with pytest.raises(EinshardError, match="jax.set_mesh"):
                jax.grad(lambda x: (f(x) ** 2).sum())(start)
            grad = jax.jit(jax.grad(lambda x: (f(x) ** 2).sum()))(start)  # what the error recommends
        else:
            grad = jax.grad(lambda x: (f(x) ** 2).sum())(start)
        vm = jax.jit(jax.vmap(lambda row: einshard.einshard(row, "d -> d@model", **kw)))(start)
    want = NamedSharding(mesh, P("data", "model"))
    for y in (eager, jitted):
        np.testing.assert_array_equal(np.asarray(y), X)
        assert y.sharding.is_equivalent_to(want, 2), (kind, source, y.sharding)
    np.testing.assert_allclose(np.asarray(grad), 2 * X)
    np.testing.assert_array_equal(np.asarray(vm), X)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("kind", KINDS)
def test_sharding_and_host_constants_under_jit_inside_set_mesh(kind):
    mesh = MESHES[kind]
    seen = {}

    @jax.jit
    def f(x):
        seen["sharding"] = einshard.sharding("b d -> b@data d", (8, 4))
        c = einshard.einshard(X, "b d -> b@data d")  # a host constant inside jit
        seen["constant"] = jax.typeof(c).sharding.spec
        return x + c

    with jax.set_mesh(mesh):
        out = f(einshard.einshard(X, "b d -> b d"))
    np.testing.assert_array_equal(np.asarray(out), 2 * X)
    assert seen["sharding"].spec == P("data", None)
    assert dict(seen["sharding"].mesh.shape) == {"data": 4, "model": 2}
    assert seen["constant"] == ({"auto": P(None, None)}.get(kind, P("data", None)))


def test_describe_reads_traced_values_from_their_type():
    mesh = MESHES["explicit"]
    got = {}

    @jax.jit
    def f(x):
        got["inside"] = einshard.describe(x, names="b d")
        return x

    f(einshard.einshard(X, EXPR, mesh=mesh))
    assert got["inside"] == "b d -> b@data d@model"


@pytest.mark.parametrize("kind", ["auto", "mixed"])
def test_describe_refuses_traced_values_on_auto_axes(kind):
    # Their layout over Auto axes is chosen by XLA after tracing: 'replicated' would be silently wrong.
    mesh = MESHES[kind]

    @jax.jit
    def f(x):
        einshard.describe(x)
        return x

    with pytest.raises(EinshardError, match="Auto mesh axes"):
        f(einshard.einshard(X, EXPR, mesh=mesh))


def test_current_mesh_while_tracing_is_the_abstract_mesh():
    mesh = MESHES["explicit"]
    with jax.set_mesh(mesh):
        assert current_mesh() == mesh
        jax.jit(lambda x: (assert_abstract(current_mesh()), x)[1])(jnp.ones(3))
    assert current_mesh() is None


# ---------------------------------------------------------------------------
# Bad input to placement names the argument


def test_non_numeric_leaf_names_its_path():
    with pytest.raises(EinshardError, match=r"at \['name'\].*str"):
        einshard.einshard({"name": "hello", "w": X}, "... -> ...")


def test_describe_names_that_do_not_parse():
    with pytest.raises(EinshardError, match="names="):
        einshard.describe(X, names="a a")


# ---------------------------------------------------------------------------
# The validated Layout


MESH = (MeshAxis("data", 4), MeshAxis("model", 2))


@pytest.mark.parametrize(
    "args, words",
    [
        ((("a", "b"), (8,), MESH, ((), ())), "one of each per axis"),
        ((("a",), (8,), MESH, (("dta",),)), "not a mesh axis"),
        ((("a", "b"), (8, 8), MESH, (("data",), ("data",))), "splits two axes"),
        ((("a",), (6,), MESH, (("data",),)), "size 6"),
        ((("a",), (-1,), MESH, ((),)), "non-negative"),
        ((("a",), (8,), (*MESH, MeshAxis("data", 2)), ((),)), "twice"),
    ],
)
def test_inconsistent_layouts_are_refused(args, words):
    with pytest.raises(EinshardError, match=words):
        Layout(*args)


def test_pending_sums_must_be_on_unused_mesh_axes():
    with pytest.raises(EinshardError, match="pending sums"):
        Layout(("a",), (8,), MESH, (("data",),), frozenset({"data"}))
    with pytest.raises(EinshardError, match="not a mesh axis"):
        Layout(("a",), (8,), MESH, ((),), frozenset({"x"}))


def test_mesh_axis_sizes_are_checked():
    with pytest.raises(EinshardError, match="positive integers"):
        MeshAxis("data", 0)


@st.composite
def layouts(draw):
    rank = draw(st.integers(0, 3))
    free = ["data", "model"]
    dims = []
    for _ in range(rank):
        take = draw(st.sampled_from([(), *[(m,) for m in free], tuple(free)]))
        take = tuple(m for m in take if m in free)
        free = [m for m in free if m not in take]
        dims.append(take)
    shape = tuple(draw(st.integers(0, 3)) * 8 for _ in range(rank))
    unreduced = frozenset(draw(st.sets(st.sampled_from(free)))) if free else frozenset()
    return Layout(tuple(f"d{i}" for i in range(rank)), shape, MESH, tuple(dims), unreduced)


@given(layouts())
def test_partition_spec_round_trip(lay):
    spec = lay.to_spec()
    back = Layout.from_spec(spec, lay.shape, lay.mesh)
    assert back.dims == lay.dims
    if getattr(spec, "unreduced", None) is not None:  # JAX releases whose PartitionSpec has unreduced=
        assert back.unreduced == lay.unreduced
    # The spec is the one JAX builds for the same placement.
    assert spec_partitions(spec) == tuple(None if not d else d[0] if len(d) == 1 else d for d in lay.dims)


def test_plain_jax_cannot_transpose_an_explicit_reshard_outside_a_mesh_context():
    # The refusal above is documented because JAX fails here too (with an error about cotangent types).
    mesh = MESHES["mixed"]
    x = jax.device_put(X, NamedSharding(mesh, P()))

    def f(x):
        return (jax.sharding.reshard(x, NamedSharding(mesh, P("data", None))) ** 2).sum()

    with pytest.raises(ValueError):
        jax.grad(f)(x)


def test_clear_caches_empties_every_registered_cache():
    from einshard._src import _caches
    from einshard._src.placement import resolve_layout
    from einshard._src.tree_rules import _CACHE as rule_matches

    einshard.sharding("b d -> b@data d", (8, 4), mesh=MESHES["explicit"])
    einshard.einshard({"w": X}, {"w": "b d -> b d"}, mesh=MESHES["explicit"])
    assert resolve_layout.cache_info().currsize > 0 and rule_matches
    einshard.clear_caches()
    assert resolve_layout.cache_info().currsize == 0 and not rule_matches
    assert len(_caches._CLEARERS) >= 5


@pytest.mark.parametrize(
    ("expr", "counts", "instead"),
    [
        ("x y -> x y*", "('y*')", "'x y -> x y@data'"),
        ("x y -> 2 x2* y*", "('2', 'x2*', 'y*')", "'x y -> x@data y@model'"),
    ],
)
def test_a_count_mesh_conflict_speaks_in_the_users_names(expr, counts, instead):
    """Issue 22: the error said counts ('a4', '*') for 'x y*': names the user never wrote."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with pytest.raises(EinshardError) as err:
        einshard.einshard(np.zeros((8, 8), np.float32), expr, mesh=mesh)
    text = str(err.value)
    assert f"counts {counts} build an anonymous mesh" in text and f"instead: {instead}" in text
    assert "a4" not in text


def test_einshard_with_mesh_inside_jit_without_set_mesh_works_as_device_put():
    """Issue 22: einshard(x, expr, mesh=mesh) inside jax.jit without jax.set_mesh was refused on Explicit axes,
    where plain jax.device_put(x, NamedSharding(mesh, spec)) inside jax.jit works."""
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    plain = jax.jit(lambda v: jax.device_put(v, NamedSharding(mesh, P("data", "model"))) * 2)(x)
    ours = jax.jit(lambda v: einshard.einshard(v, "b d -> b@data d@model", mesh=mesh) * 2)(x)
    assert ours.sharding.is_equivalent_to(plain.sharding, 2) and ours.sharding.spec == P("data", "model")
    np.testing.assert_array_equal(np.asarray(ours), 2 * x)
    grad = jax.jit(jax.grad(lambda v: jnp.sum(einshard.einshard(v, "b d -> b@data d", mesh=mesh) ** 2)))(x)
    np.testing.assert_allclose(np.asarray(grad), 2 * x)


@pytest.mark.parametrize("types", [(AxisType.Auto, AxisType.Auto), (AxisType.Explicit, AxisType.Auto)])
def test_describe_under_eager_grad_reads_the_concrete_value_on_auto_axes(types):
    """Issue 22: describe() under eager jax.grad inside set_mesh on a mesh with Auto axes was refused, although
    the concrete value under the tracer carries its layout; under jax.jit it still is (XLA decides it later)."""
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=types)
    x = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("data", "model")))
    seen = []

    def loss(v):
        seen.append(einshard.describe(v, names="b d"))
        return jnp.sum(v**2)

    with jax.set_mesh(mesh):
        jax.grad(loss)(x)
        assert seen == ["b d -> b@data d@model"]
        with pytest.raises(EinshardError, match="Auto mesh"):
            jax.jit(jax.grad(loss))(x)
