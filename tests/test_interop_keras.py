"""Keras 3 LayoutMaps (issue 24): einshard rules -> LayoutMap -> ModelParallel lays every variable out as einshard
does; a LayoutMap read back gives Keras's own layouts, unmatched variables included; audit catches them."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras reads it once, at import

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType, PartitionSpec  # noqa: E402

keras = pytest.importorskip("keras", reason="Keras is not installed: pip install 'einshard[test]'")
if keras.backend.backend() != "jax":
    pytest.skip("Keras was imported with another backend than jax", allow_module_level=True)

from keras import distribution as kd  # noqa: E402

import einshard  # noqa: E402
from einshard import interop  # noqa: E402

D, H, K, F, V, S = 32, 4, 8, 128, 64, 8

RULES = {
    r"embed/embeddings": "v d -> v@model d",
    r"attn/(query|key|value)/kernel": "d h k -> d h@model k",
    r"attn/attention_output/kernel": "h k d -> h@model k d",
    r"up/kernel": "d f -> d f@model",
    r"down/kernel": "f d -> f@model d",
    r".*": "... -> ...",
}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def build():
    """A small transformer block from Keras's own layers (random init); the names fix the variable paths."""
    tokens = keras.Input((S,), dtype="int32")
    x = keras.layers.Embedding(V, D, name="embed")(tokens)
    x = x + keras.layers.MultiHeadAttention(num_heads=H, key_dim=K, name="attn")(x, x)
    x = keras.layers.LayerNormalization(name="norm")(x)
    x = x + keras.layers.Dense(D, name="down")(keras.layers.Dense(F, activation="relu", name="up")(x))
    return keras.Model(tokens, x, name="block")


def test_einshard_rules_to_layout_map_to_model_parallel_match_einshard_placement(mesh):
    params = interop.keras_params(build())
    layout_map = interop.to_keras(RULES, params, mesh)
    placed = einshard.einshard(params, RULES, mesh=mesh)
    with kd.ModelParallel(layout_map=layout_map, batch_dim_name="data").scope():
        model = build()
    assert len(model.variables) == len(placed) > 10
    sharded = 0
    for v in model.variables:
        mine = placed[v.path].sharding
        theirs = v.value.sharding
        assert theirs.is_equivalent_to(mine, len(v.shape)), (v.path, theirs.spec, mine.spec)
        sharded += any(e is not None for e in mine.spec)
    assert sharded == 7  # embeddings, query, key, value, attention output, up, down


def test_a_layout_map_read_back_gives_keras_own_layouts_unmatched_included(mesh):
    device_mesh = kd.DeviceMesh((2, 4), ["data", "model"], jax.devices())
    layout_map = kd.LayoutMap(device_mesh)
    layout_map["mlp/up/kernel"] = (None, "model")  # the layer was renamed 'up': Keras matches whole paths
    layout_map["down/kernel"] = ("model", None)
    layout_map[".*bias"] = (None,)  # shorter than a bias of rank 2: the rest whole, as JAX reads it
    layout_map["nothing/.*"] = (None,)
    with kd.ModelParallel(layout_map=layout_map, batch_dim_name="data").scope():
        model = build()
    params = interop.keras_params(model)
    read = interop.from_keras(layout_map, params)
    placed = einshard.einshard(params, read.rules, mesh=mesh)
    for v in model.variables:
        assert v.value.sharding.is_equivalent_to(placed[v.path].sharding, len(v.shape)), v.path
    by_name = {m.leaf.name: m for m in read.leaves}
    assert by_name["up/kernel"].source is None and by_name["up/kernel"].spec == PartitionSpec(None, None)
    assert by_name["down/kernel"].source == "down/kernel" and by_name["down/kernel"].spec == PartitionSpec(
        "model", None
    )
    assert read.unmatched[0].leaf.name == "up/kernel"  # the largest replicated leaf first (D x F floats)
    assert [m.leaf.nbytes for m in read.unmatched] == sorted((m.leaf.nbytes for m in read.unmatched), reverse=True)
    assert read.matched_by("nothing/.*") == ()


def test_a_path_two_keys_match_is_an_error_as_in_keras():
    params = {"block/up/kernel": np.zeros((4, 8), np.float32)}
    with pytest.raises(einshard.EinshardError, match="matches several LayoutMap keys"):
        interop.from_keras({".*up.*": (None, "model"), ".*kernel": ("model", None)}, params)
    with pytest.raises(einshard.EinshardError, match="2 entries for rank 1"):  # longer than the rank
        interop.from_keras({".*": (None, "model")}, {"b": np.zeros(4)})


def test_audit_catches_the_large_layer_a_renamed_regex_leaves_replicated(mesh):
    params = {
        "block/up/kernel": jax.ShapeDtypeStruct((512, 2048), jnp.float32),
        "block/down/kernel": jax.ShapeDtypeStruct((2048, 512), jnp.float32),
        "block/norm/scale": jax.ShapeDtypeStruct((512,), jnp.float32),
    }
    layout_map = {"mlp/up/kernel": (None, "model"), ".*/down/kernel": ("model", None)}  # 'mlp' was renamed 'block'

    def loss(p, x):
        h = jax.nn.relu(x @ p["block/up/kernel"])
        return jnp.mean(((h @ p["block/down/kernel"]) * p["block/norm/scale"]) ** 2)

    x = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    report = einshard.audit(
        jax.value_and_grad(loss), params, x, rules=interop.from_keras(layout_map, params), mesh=mesh, budget="8MiB"
    )
    assert [(m.leaf.name, m.leaf.nbytes) for m in report.unmatched] == [
        ("block/up/kernel", 512 * 2048 * 4),
        ("block/norm/scale", 512 * 4),
    ]
    assert [r.source for r in report.rules if not r.leaves] == ["mlp/up/kernel"]
    assert not report.fits and report.memory_bytes > 8 * 2**20
    assert report.plan.memory_bytes < report.memory_bytes
    assert any(d.name == "block/up/kernel" for d in report.differences)
    text = str(report)
    assert "block/up/kernel  (512, 2048)  4 MiB" in text and "OVER BUDGET" in text and "mlp/up/kernel" in text
    assert report.to_dict()["unmatched"][0] == {"leaf": "block/up/kernel", "shape": [512, 2048], "bytes": 4194304}


def test_a_dimension_over_two_mesh_axes_is_named_not_dropped(mesh):
    """Keras's TensorLayout takes one mesh axis per dimension: FSDP x TP on one dimension has no Keras form, so
    to_keras names the variable, dimension and axes (Keras itself would raise a bare ValueError, and dropping an
    axis would replicate the kernel over it)."""
    params = interop.keras_params(build())
    rules = {**RULES, r"up/kernel": "d f -> d f@(data,model)"}
    with pytest.raises(einshard.EinshardError) as err:
        interop.to_keras(rules, params, mesh)
    text = str(err.value)
    assert "up/kernel" in text and "dimension 1 (size 128)" in text and "data=2 x model=4" in text
    assert "to_flax" in text  # the hint names an export that takes it
    # One mesh axis per dimension on every variable, the other axis included: exported as before.
    layout_map = interop.to_keras({**RULES, r"up/kernel": "d f -> d@data f@model"}, params, mesh)
    assert tuple(layout_map[r"up/kernel"].axes) == ("data", "model")
