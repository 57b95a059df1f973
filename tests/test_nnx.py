"""Flax NNX: einshard expressions as variable metadata or rules; models created directly sharded."""

import jax
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="Flax is not installed: pip install 'einshard[flax]'")

import einshard  # noqa: E402
import einshard.nnx as esx  # noqa: E402

D = 512  # two 512 x 2048 kernels: 8 MiB of weights, 1 MiB per device


class MLP(nnx.Module):
    def __init__(self, rngs):
        up = esx.with_layout(nnx.initializers.lecun_normal(), "i o -> i o@model")
        self.up = nnx.Linear(D, 4 * D, kernel_init=up, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)  # laid out by a rule instead


RULES = {r"down.*kernel": "f d -> f@model d"}


@pytest.fixture(scope="module")
def mesh():
    return jax.sharding.Mesh(
        np.asarray(jax.devices()[:8]).reshape(1, 8), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


def _value(v):
    return v.get_value() if hasattr(v, "get_value") else v.value


def test_metadata_and_rules_give_the_layouts(mesh):
    model = esx.init_sharded(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules=RULES)
    assert esx.layout_of(model.up.kernel) == "i o -> i o@model"
    up, down = _value(model.up.kernel), _value(model.down.kernel)
    assert up.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert down.sharding.spec == jax.sharding.PartitionSpec("model", None)
    assert _value(model.up.bias).sharding.is_fully_replicated  # unannotated: the default, replicated
    assert einshard.describe(up, names="i o") == "i o -> i o@model"
    # The same values as an unsharded initialisation with the same seed.
    ref = MLP(nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(up), np.asarray(_value(ref.up.kernel)), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(down), np.asarray(_value(ref.down.kernel)), rtol=1e-6, atol=1e-7)


def test_init_never_materialises_a_whole_parameter(mesh):
    create, _ = esx.init_function(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules=RULES)
    memory = create.lower().compile().memory_analysis()
    kernel = D * 4 * D * 4  # one whole kernel, bytes
    biases = (4 * D + D) * 4
    full_model = 2 * kernel + biases
    sharded = 2 * kernel // 8 + biases  # what each device must end up holding
    assert memory.output_size_in_bytes <= sharded + 64  # + the RNG state's few bytes
    # Peak on one device (outputs plus every temporary) stays below even ONE whole kernel.
    assert memory.output_size_in_bytes + memory.temp_size_in_bytes < kernel
    # Without layouts, the same initialisation holds the whole model on the device.
    whole = jax.jit(lambda: nnx.state(MLP(nnx.Rngs(0)))).lower().compile().memory_analysis()
    assert whole.output_size_in_bytes >= full_model
    for shard in _value(create()["up"]["kernel"]).addressable_shards:
        assert shard.data.nbytes == kernel // 8


def test_unannotated_variables_can_be_refused(mesh):
    with pytest.raises(einshard.EinshardError, match="has no einshard layout"):
        esx.init_function(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules=RULES, default=None)


def test_bad_layout_names_the_variable(mesh):
    with pytest.raises(einshard.EinshardError, match=r"down.*kernel.*mesh axis 'modle'"):
        esx.init_function(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules={"down.*kernel": "f d -> f@modle d"})


def test_rules_follow_the_one_path_matcher(mesh):
    """A None rule wins over metadata (replicated); a bad pattern is named; as einshard._src.tree_rules everywhere."""
    model = esx.init_sharded(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules={r"up.*kernel": None, **RULES})
    assert _value(model.up.kernel).sharding.is_fully_replicated
    assert _value(model.down.kernel).sharding.spec == jax.sharding.PartitionSpec("model", None)
    with pytest.raises(einshard.EinshardError, match=r"path pattern 'up\(' is not a valid regular expression"):
        esx.init_function(lambda: MLP(nnx.Rngs(0)), mesh=mesh, rules={"up(": "i o -> i o"})


def test_module_docstring_example():
    class Small(nnx.Module):
        def __init__(self, rngs):
            init = esx.with_layout(nnx.initializers.lecun_normal(), "i o -> i o@model")
            self.up = nnx.Linear(16, 64, kernel_init=init, use_bias=False, rngs=rngs)

    mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
    model = esx.init_sharded(lambda: Small(nnx.Rngs(0)), mesh=mesh)
    assert _value(model.up.kernel).sharding.spec == jax.sharding.PartitionSpec(None, "model")
