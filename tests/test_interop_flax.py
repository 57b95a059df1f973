"""Flax NNX metadata and MaxText rule lists (issue 24): read through einshard's resolver, they give Flax's own
shardings; a plan written back as Flax rules + names, or as MaxText data, reads back to the plan's layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec

nnx = pytest.importorskip("flax.nnx", reason="Flax is not installed: pip install 'einshard[flax]'")
nn = pytest.importorskip("flax.linen")

import einshard  # noqa: E402
from einshard import interop  # noqa: E402

FLAX_RULES = [("batch", ("data",)), ("vocab", "model"), ("embed", None), ("mlp", "model"), ("heads", "model")]


def part(init, names):
    return nnx.with_partitioning(init, names)


class Block(nnx.Module):
    """A small decoder block from Flax's own layers, annotated with logical names (random init)."""

    def __init__(self, rngs):
        lecun = nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(64, 32, embedding_init=part(nnx.initializers.normal(), ("vocab", "embed")), rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=4,
            in_features=32,
            qkv_features=32,
            decode=False,
            rngs=rngs,
            kernel_init=part(lecun, ("embed", "heads", None)),
            out_kernel_init=part(lecun, ("heads", None, "embed")),
        )
        self.norm = nnx.LayerNorm(32, scale_init=part(nnx.initializers.ones_init(), ("embed",)), rngs=rngs)
        self.up = nnx.Linear(
            32,
            128,
            kernel_init=part(lecun, ("embed", "mlp")),
            bias_init=part(nnx.initializers.zeros_init(), ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(128, 32, kernel_init=part(lecun, ("mlp", "embed")), rngs=rngs)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="module")
def model(mesh):
    with jax.set_mesh(mesh), nn.logical_axis_rules(FLAX_RULES):
        return Block(nnx.Rngs(0))


def test_nnx_metadata_and_rules_give_flax_own_shardings(mesh, model):
    state = nnx.state(model, nnx.Param)
    with nn.logical_axis_rules(FLAX_RULES):
        flax_shardings = nnx.get_named_sharding(state, mesh)
    read = interop.from_nnx(model, FLAX_RULES, mesh=mesh)
    theirs = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(flax_shardings)[0]}
    pure = nnx.to_pure_dict(state)
    placed = einshard.einshard(pure, read.rules, mesh=mesh)
    mine = {jax.tree_util.keystr(p) + ".value": x.sharding for p, x in jax.tree_util.tree_flatten_with_path(placed)[0]}
    assert theirs.keys() == mine.keys() and len(mine) >= 9
    for key, sharding in theirs.items():
        ndim = len(np.shape(_leaf(pure, key)))
        assert mine[key].is_equivalent_to(sharding, ndim), (key, mine[key].spec, sharding.spec)
    # what the model holds (Flax placed it at init) is what einshard reads
    by_name = {m.leaf.name: m for m in read.leaves}
    assert by_name["up/kernel"].spec == PartitionSpec(None, "model") and by_name["up/kernel"].source == "embed mlp"
    assert by_name["attn/query/kernel"].spec == PartitionSpec(None, "model", None)
    assert by_name["down/bias"].source is None  # not annotated: replicated, and audit lists it
    # and the state's own paths (Variables as leaves) match the same rules
    assert einshard.einshard(pure, read.rules, mesh=mesh)["up"]["kernel"].sharding.spec == PartitionSpec(None, "model")


def _leaf(pure, key):
    path = [k.strip("'") for k in key.removesuffix(".value").strip("[]").split("][")]
    for k in path:
        pure = pure[k]
    return pure


def test_from_nnx_reads_the_rules_flax_has_current(model, mesh):
    with nn.logical_axis_rules(FLAX_RULES):
        read = interop.from_nnx(model, mesh=mesh)
    assert {m.leaf.name: m.spec for m in read.leaves}["embed/embedding"] == PartitionSpec("model", None)
    with pytest.raises(einshard.EinshardError, match="from_nnx needs the logical rules"):
        interop.from_nnx(model)


def params_and_names():
    params = {
        "token_embedder": {"embedding": jax.ShapeDtypeStruct((256, 64), jnp.float32)},
        "decoder": {
            "mlp": {
                "wi": jax.ShapeDtypeStruct((64, 256), jnp.float32),
                "wo": jax.ShapeDtypeStruct((256, 64), jnp.float32),
            },
            "attn": {"query": jax.ShapeDtypeStruct((64, 4, 16), jnp.float32)},
            "norm": {"scale": jax.ShapeDtypeStruct((64,), jnp.float32)},
        },
    }
    names = {
        "token_embedder/embedding": ("vocab", "embed"),
        "decoder/mlp/wi": ("embed", "mlp"),
        "decoder/mlp/wo": ("mlp", "embed"),
        "decoder/attn/query": ("embed", "q_heads", "kv"),
        "decoder/norm/scale": ("norm",),
    }
    return params, names


# MaxText's rule list as it stands in its YAML (a subset): lists, several rules for one name, [] for whole.
MAXTEXT_RULES = [
    ["activation_batch", ["data", "fsdp"]],
    ["mlp", ["tensor", "tensor_transpose"]],
    ["vocab", ["tensor", "tensor_transpose"]],
    ["embed", ["fsdp", "sequence", "expert"]],
    ["embed", ["fsdp", "sequence"]],
    ["embed", ["fsdp"]],
    ["q_heads", ["tensor", "tensor_transpose"]],
    ["kv", []],
    ["norm", ["tensor", "tensor_transpose"]],
]
MAXTEXT_MESH = {"data": 1, "fsdp": 4, "sequence": 1, "expert": 1, "tensor": 2, "tensor_transpose": 1}


def test_maxtext_rules_as_data_resolve_as_flax_resolves_them():
    params, names = params_and_names()
    read = interop.from_maxtext(MAXTEXT_RULES, names, params, mesh=MAXTEXT_MESH)
    flax_rules = [(n, tuple(a) or None) for n, a in MAXTEXT_RULES]
    for m in read.leaves:
        want = nn.logical_to_mesh_axes(names[m.leaf.name], flax_rules)
        got = tuple(m.spec) + (None,) * (len(m.leaf.shape) - len(m.spec))
        assert got == tuple(want), (m.leaf.name, got, want)
        assert m.source == " ".join(names[m.leaf.name])
    (embedding,) = [m.expression for m in read.leaves if m.leaf.name == "token_embedder/embedding"]
    mesh = jax.make_mesh((1, 4, 1, 1, 2, 1), tuple(MAXTEXT_MESH))
    want = PartitionSpec(("tensor", "tensor_transpose"), ("fsdp", "sequence", "expert"))
    assert einshard.sharding(embedding, (256, 64), mesh=mesh).spec == want
    with pytest.raises(einshard.EinshardError, match="'embed' maps to .* but 'sequence' is not an axis of the mesh"):
        interop.from_maxtext(MAXTEXT_RULES, names, params, mesh={"data": 2, "fsdp": 4})


def test_a_plan_writes_back_as_flax_rules_and_maxtext_data_that_read_back_the_same():
    params, _ = params_and_names()
    params = {"w1": params["decoder"]["mlp"]["wi"], "w2": params["decoder"]["mlp"]["wo"]}
    sizes = {"data": 2, "model": 4}

    def step(p, x):
        return jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2))(p)

    x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
    # The least-memory plan (sharded parameters): on the time objective a batch of 4096 over all 8 devices with
    # the parameters replicated is fastest since the gradient all-reduces are priced as XLA combines them.
    result = einshard.plan(step, params, x, mesh=sizes, objective="memory")
    want = {
        k: einshard.spec(e, params[k].shape, mesh=sizes)
        for k, e in zip(sorted(params), einshard._src.tree_rules.leaf_expressions(params, result.rules))
    }
    assert any(any(e is not None for e in s) for s in want.values())  # the plan shards something
    flax = result.to_flax(params, sizes)
    for name, names in flax.names.items():
        assert tuple(nn.logical_to_mesh_axes(names, flax.flax_rules())) == _padded(want[name], len(names))
    data = result.to_maxtext(params, sizes)
    back = interop.from_maxtext(data["logical_axis_rules"], data["logical_axes"], params, mesh=sizes)
    assert {m.leaf.name: _padded(m.spec, len(m.leaf.shape)) for m in back.leaves} == {
        k: _padded(s, len(params[k].shape)) for k, s in want.items()
    }


def _padded(spec, rank):
    return tuple(spec) + (None,) * (rank - len(tuple(spec)))


def test_audit_of_nnx_rules_lists_the_unannotated_leaves(mesh, model):
    state = nnx.state(model, nnx.Param)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(state))

    def loss(p, tokens):
        h = p["embed"]["embedding"][tokens]
        h = jax.nn.relu(h @ p["up"]["kernel"] + p["up"]["bias"]) @ p["down"]["kernel"] + p["down"]["bias"]
        return jnp.mean(h**2)

    tokens = jax.ShapeDtypeStruct((16, 8), jnp.int32)
    report = einshard.audit(
        jax.value_and_grad(loss), shapes, tokens, rules=interop.from_nnx(model, FLAX_RULES, mesh=mesh), mesh=mesh
    )
    unmatched = [m.leaf.name for m in report.unmatched]
    assert "down/bias" in unmatched and "up/kernel" not in unmatched
    assert {r.source for r in report.rules} >= {"embed mlp", "mlp embed", "vocab embed"}
    assert report.fits and report.plan.rules


def test_einshard_nnx_takes_axis_rules(mesh):
    import einshard.nnx as esx

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(32, 128, rngs=rngs)

    model = esx.init_sharded(
        lambda: Plain(nnx.Rngs(0)),
        mesh=mesh,
        rules={"kernel": "i o -> i@embed o@mlp", "bias": "o -> o@mlp"},
        axis_rules=FLAX_RULES,
    )
    assert model.up.kernel.get_value().sharding.spec == PartitionSpec(None, "model")
    assert model.up.bias.get_value().sharding.spec == PartitionSpec("model")
