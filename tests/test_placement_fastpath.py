"""The cached hot path of eager placement gives the same answers as the uncached one, in every context.

``einshard(x, expr)`` looks its sharding up in one cache keyed by the text,
the shape, ``mesh=``, the current mesh and the array's own mesh; pytrees also
cache which rule each leaf takes, per tree structure.  These tests change each
of those inputs between repeated calls and check that the answer follows,
comparing with ``einshard.sharding`` (which resolves without that cache), and
that errors are raised again on every call rather than remembered.
"""

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

import einshard
from einshard import EinshardError
from einshard._src.placement import _cached_eager_sharding
from einshard._src.tree_rules import cache_clear as _clear_leaf_rules

AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]


@pytest.fixture(scope="module")
def meshes(devices):
    n = len(devices)
    if n < 4:
        pytest.skip("needs 4 devices for two differently shaped meshes")  # pragma: no cover
    return {
        t: (
            jax.make_mesh((n // 2, 2), ("data", "model"), axis_types=(t, t)),
            jax.make_mesh((2, n // 2), ("data", "model"), axis_types=(t, t)),
        )
        for t in AXIS_TYPES
    }


@pytest.fixture(autouse=True)
def _cold_caches():
    _cached_eager_sharding.cache_clear()
    _clear_leaf_rules()


EXPRESSIONS = [
    "a b -> a@data b",
    "a b -> a b@model",
    "a b -> a@(data,model) b",
    "a b -> a@model b@data",
    "... b -> ... b@data",
    "a b -> a b",
]


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_mesh_argument_is_part_of_the_key(meshes, axis_type):
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    for _ in range(2):  # the second round is served from the cache
        for mesh in meshes[axis_type]:
            for expr in EXPRESSIONS:
                y = einshard.einshard(x, expr, mesh=mesh)
                assert y.sharding == einshard.sharding(expr, x.shape, mesh=mesh), (expr, mesh)
                np.testing.assert_array_equal(np.asarray(y), x)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_current_mesh_is_part_of_the_key(meshes, axis_type):
    x = np.ones((16, 8), np.float32)
    first, second = meshes[axis_type]
    for _ in range(2):
        for mesh in (first, second):
            with jax.set_mesh(mesh):
                y = einshard.einshard(x, "a b -> a@data b@model")
            assert y.sharding == NamedSharding(mesh, PartitionSpec("data", "model"))


def test_own_mesh_is_part_of_the_key(meshes):
    x = np.ones((16, 8), np.float32)
    first, second = meshes[AxisType.Auto]
    on_first = jax.device_put(x, NamedSharding(first, PartitionSpec()))
    on_second = jax.device_put(x, NamedSharding(second, PartitionSpec()))
    for _ in range(2):
        assert einshard.einshard(on_first, "a b -> a@data b").sharding.mesh == first
        assert einshard.einshard(on_second, "a b -> a@data b").sharding.mesh == second
    # A host array has no mesh of its own: nothing sharded, so replicated over every device.
    y = einshard.einshard(x, "a b -> a b")
    assert y.sharding.is_fully_replicated and len(y.sharding.device_set) == jax.device_count()


def test_shape_is_part_of_the_key():
    n = jax.device_count()
    for rows in (n, 2 * n, n):
        y = einshard.einshard(np.zeros((rows, 3)), "a b -> a* b")
        assert y.sharding.shard_shape(y.shape) == (rows // n, 3)


def test_count_expression_under_a_mesh_fails_every_time(meshes):
    x = np.ones((16, 8), np.float32)
    einshard.einshard(x, "a b -> a* b")  # cached outside any mesh
    mesh = meshes[AxisType.Auto][0]
    for _ in range(2):
        with jax.set_mesh(mesh), pytest.raises(EinshardError, match="anonymous mesh"):
            einshard.einshard(x, "a b -> a* b")
        with pytest.raises(EinshardError, match="anonymous mesh"):
            einshard.einshard(x, "a b -> a* b", mesh=mesh)
    assert einshard.einshard(x, "a b -> a* b").sharding == einshard.sharding("a b -> a* b", x.shape)


def test_errors_are_not_cached(meshes):
    mesh = meshes[AxisType.Auto][0]
    for _ in range(2):
        with pytest.raises(EinshardError, match="does not split"):
            einshard.einshard(np.ones((3, 8)), "a b -> a@data b", mesh=mesh)
        with pytest.raises(EinshardError, match="nope"):
            einshard.einshard(np.ones((8, 8)), "a b -> a@nope b", mesh=mesh)


@pytest.mark.parametrize("expr", ["a b -> a* b", "a b -> a@data b"])
@pytest.mark.parametrize("bad", [[1, 2], "data", 3])
def test_a_mesh_that_is_not_a_mesh_is_an_einshard_error(expr, bad):
    with pytest.raises(EinshardError, match="mesh= takes a jax.sharding.Mesh"):
        einshard.einshard(np.ones((8, 8)), expr, mesh=bad)
    with pytest.raises(EinshardError, match="mesh= takes a jax.sharding.Mesh"):
        einshard.einshard({"w": np.ones((8, 8))}, expr, mesh=bad)


def _tree():
    return {
        "dense": {"w": np.ones((16, 8), np.float32), "b": np.ones((8,), np.float32)},
        "out": {"w": np.ones((8, 16), np.float32), "b": np.ones((16,), np.float32)},
    }


def test_pytree_rules_are_part_of_the_key(meshes):
    mesh = meshes[AxisType.Auto][0]
    tree = _tree()
    rows = {r"\['w'\]": "a b -> a@data b", r"\['b'\]": "a -> a@model"}
    cols = {r"\['w'\]": "a b -> a b@model", r"\['b'\]": "a -> a"}
    for _ in range(2):
        for rules, w_spec, b_spec in (
            (rows, PartitionSpec("data", None), PartitionSpec("model")),
            (cols, PartitionSpec(None, "model"), PartitionSpec(None)),
        ):
            out = einshard.einshard(tree, rules, mesh=mesh)
            for layer in ("dense", "out"):
                assert out[layer]["w"].sharding == NamedSharding(mesh, w_spec)
                assert out[layer]["b"].sharding == NamedSharding(mesh, b_spec)
    # Mutating the rules in place is seen by the next call.
    rows[r"\['b'\]"] = "a -> a"
    out = einshard.einshard(tree, rows, mesh=mesh)
    assert out["dense"]["b"].sharding == NamedSharding(mesh, PartitionSpec(None))


def test_pytree_rule_order_is_part_of_the_key(meshes):
    mesh = meshes[AxisType.Auto][0]
    tree = _tree()
    first = {r"dense": "... -> ...", r".*": "a ... -> a@data ..."}
    second = dict(reversed(list(first.items())))
    for _ in range(2):
        assert einshard.einshard(tree, first, mesh=mesh)["dense"]["w"].sharding.is_fully_replicated
        assert einshard.einshard(tree, second, mesh=mesh)["dense"]["w"].sharding.spec[0] == "data"


def test_pytree_structure_is_part_of_the_key(meshes):
    mesh = meshes[AxisType.Auto][0]
    rules = {r"\['w'\]": "a b -> a@data b", r".*": "... -> ..."}
    for _ in range(2):
        a = einshard.einshard({"w": np.ones((16, 8)), "v": np.ones((16, 8))}, rules, mesh=mesh)
        b = einshard.einshard({"v": np.ones((16, 8)), "x": np.ones((16, 8))}, rules, mesh=mesh)
        assert a["w"].sharding.spec[0] == "data" and a["v"].sharding.is_fully_replicated
        assert b["v"].sharding.is_fully_replicated and b["x"].sharding.is_fully_replicated


def test_pytree_errors_name_the_leaf_every_time(meshes):
    mesh = meshes[AxisType.Auto][0]
    tree = {"a": np.ones((16, 8)), "b": np.ones((16, 8)), "c": np.ones((3, 8))}
    rules = {".*": "x y -> x@data y"}
    for _ in range(2):
        with pytest.raises(EinshardError, match=r"at \['c'\] \(shape \(3, 8\)\)"):
            einshard.einshard(tree, rules, mesh=mesh)
        with pytest.raises(EinshardError, match=r"no rule matches the leaf at \['b'\]"):
            einshard.einshard(tree, {r"\['[ac]'\]": "x y -> x y"}, mesh=mesh)


@pytest.mark.parametrize("rule", [["a -> a"], 3, b"a -> a"])
def test_a_rule_that_is_not_an_expression_is_an_einshard_error(rule):
    with pytest.raises(EinshardError, match="rule for path pattern"):
        einshard.einshard({"w": np.ones(8)}, {".*": rule})


def test_pytree_with_none_rule_and_scalars_round_trips(meshes):
    mesh = meshes[AxisType.Auto][0]
    tree = {"w": np.arange(16.0).reshape(16, 1), "step": 3, "frozen": np.ones(4)}
    rules = {"frozen": None, "step": " -> ", ".*": "a b -> a@data b"}
    for _ in range(2):
        out = einshard.einshard(tree, rules, mesh=mesh)
        assert out["frozen"] is tree["frozen"]
        assert int(out["step"]) == 3
        np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"])


class _Box:
    """A pytree node whose data cannot be compared for equality (as some frameworks' nodes)."""

    def __init__(self, value, tag):
        self.value, self.tag = value, tag


jax.tree_util.register_pytree_node(
    _Box, lambda b: ((b.value,), np.array(b.tag)), lambda tag, children: _Box(children[0], int(tag))
)


def test_pytree_whose_structure_cannot_be_compared_still_places():
    for _ in range(3):
        out = einshard.einshard([_Box(np.ones((8, 2)), 1)], {".*": "a b -> a* b"})
        assert out[0].value.sharding.shard_shape((8, 2)) == (8 // jax.device_count(), 2)
