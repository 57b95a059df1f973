"""Plans' rules lay out the API they are handed to, the rules file has one format, and no rule set is silently
empty (issue 22, item 3).

einshard.plan on an NNX state writes patterns for the state flattened to arrays (``['up']['kernel'].value``)
while einshard.nnx.init_sharded matches the variables (``['up']['kernel']``): every kernel came out replicated
without a word.  Here: plan -> init_sharded -> every planned kernel is really split (asserted on each spec).
"""

import json
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx", reason="Flax is not installed: pip install 'einshard[flax]'")

import einshard  # noqa: E402
import einshard.nnx as esx  # noqa: E402
from einshard._src import tree_rules  # noqa: E402
from einshard._src.tree_rules import read_rules_file  # noqa: E402
from einshard.errors import EinshardWarning  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(64, 256, rngs=rngs)
        self.down = nnx.Linear(256, 64, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(x)))


def _make():
    return MLP(nnx.Rngs(0))


@pytest.fixture(scope="module")
def auto_mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def planned(auto_mesh):
    """einshard.plan's rules for the model's NNX state (objective 'memory': every kernel is split)."""
    graphdef, state = nnx.split(nnx.eval_shape(_make))
    step = jax.value_and_grad(lambda s, x: jnp.mean(nnx.merge(graphdef, s)(x) ** 2))
    batch = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    return einshard.plan(step, state, batch, mesh=auto_mesh, profile="cpu", objective="memory")


def _by_path(state):
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def _check_every_planned_leaf_is_laid_out_as_planned(state, rules, mesh):
    leaves = _by_path(state)
    split = 0
    for pattern, expr in rules.items():
        (path,) = [p for p in leaves if re.search(pattern, p)]
        value = leaves[path]
        want = einshard.spec(expr, value.shape, mesh=mesh)
        assert value.sharding.spec == want, (path, expr, value.sharding.spec)
        split += any(e is not None for e in want)
    return split


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_plan_then_init_sharded_splits_every_planned_kernel(planned, auto_mesh, mesh_kind):
    mesh = auto_mesh if mesh_kind == "auto" else jax.make_mesh((2, 4), ("data", "model"))
    assert all(p.endswith(r"\.value$") for p in planned.rules)  # the paths plan was handed
    kernels = {p: e for p, e in planned.rules.items() if "kernel" in p}
    assert len(kernels) == 2 and all("@" in e for e in kernels.values()), planned.rules
    with warnings.catch_warnings():
        warnings.simplefilter("error", EinshardWarning)  # every rule matches: nothing to warn
        model = esx.init_sharded(_make, mesh=mesh, rules=planned.rules)
    assert _check_every_planned_leaf_is_laid_out_as_planned(nnx.state(model), planned.rules, mesh) == 2
    # The same rules place an existing model's state (its arrays: paths with '.value').
    placed = einshard.einshard(nnx.state(_make()), planned.rules, mesh=mesh)
    assert _check_every_planned_leaf_is_laid_out_as_planned(placed, planned.rules, mesh) == 2


def test_rules_written_for_variables_place_the_arrays_too(auto_mesh):
    """The other direction: a pattern ending at the variable (its ['kernel'] key) matches its '.value' leaf."""
    rules = {r"\['kernel'\]$": "i o -> i o@model", r"\['bias'\]$": "o -> o"}
    placed = einshard.einshard(nnx.state(_make()), rules, mesh=auto_mesh)
    leaves = _by_path(placed)
    assert leaves["['up']['kernel'].value"].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    model = esx.init_sharded(_make, mesh=auto_mesh, rules=rules)
    assert model.up.kernel.get_value().sharding.spec == jax.sharding.PartitionSpec(None, "model")


def test_the_rules_file_has_one_format_every_consumer_reads(planned, auto_mesh, tmp_path):
    from einshard_apps.presets import load_rules

    path = tmp_path / "rules.json"
    planned.save_rules(str(path), mesh={"data": 2, "model": 4})
    data = json.loads(path.read_text())
    assert set(data) == {"params", "batch", "mesh"} and data["params"] == planned.rules
    read = read_rules_file(path)
    assert read.params == planned.rules and read.mesh == {"data": 2, "model": 4} and read.batch == data["batch"]
    preset, mesh_sizes = load_rules(path)  # einshard demo --rules
    assert preset.params == planned.rules and preset.batch == data["batch"] and mesh_sizes == {"data": 2, "model": 4}
    model = esx.init_sharded(_make, mesh=auto_mesh, rules=pathlib.Path(path))  # init_sharded(rules=path)
    assert _check_every_planned_leaf_is_laid_out_as_planned(nnx.state(model), planned.rules, auto_mesh) == 2
    placed = einshard.einshard(nnx.state(_make()), pathlib.Path(path), mesh=auto_mesh)  # tree rules
    assert _check_every_planned_leaf_is_laid_out_as_planned(placed, planned.rules, auto_mesh) == 2


def test_a_flat_pattern_mapping_is_refused_with_the_format(tmp_path):
    path = tmp_path / "flat.json"
    path.write_text(json.dumps({"kernel": "i o -> i o@model"}))
    with pytest.raises(einshard.EinshardError, match=r"(?s)unknown keys \['kernel'\].*put the path patterns under"):
        read_rules_file(path)


def test_rules_that_match_no_variable_warn_naming_the_paths(auto_mesh):
    with pytest.warns(EinshardWarning, match=r"match no leaf.*'\^w_in\$'.*\['down'\]\['bias'\]"):
        model = esx.init_sharded(_make, mesh=auto_mesh, rules={"^w_in$": "i o -> i o@model"})
    assert model.up.kernel.get_value().sharding.is_fully_replicated  # the fallback, as the warning says


def test_a_large_leaf_left_replicated_warns_naming_it(auto_mesh, monkeypatch):
    monkeypatch.setattr(tree_rules, "LARGE_LEAF_BYTES", 32 * 1024)  # the kernels (64 KiB) count as large
    tree_rules.cache_clear()
    tree = {"w": np.zeros((64, 256), np.float32), "b": np.zeros((256,), np.float32)}
    with pytest.warns(EinshardWarning, match=r"leave 1 large leaf.*\['w'\] \(0 MiB\)"):
        einshard.einshard(tree, {"w": "i o -> i o", "b": None}, mesh=auto_mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EinshardWarning)
        einshard.einshard(tree, {"w": "i o -> i o@model", "b": None}, mesh=auto_mesh)  # split: nothing to say
    # init_sharded: a rule set that leaves the kernels to the (replicated) default says which.
    with pytest.warns(EinshardWarning, match=r"large leaf.*\['up'\]\['kernel'\]"):
        esx.init_sharded(_make, mesh=auto_mesh, rules={r"down.*kernel": "f d -> f@model d"})


def test_checkpoint_restore_rules_say_so_too(auto_mesh, tmp_path, monkeypatch):
    pytest.importorskip("orbax.checkpoint")
    from einshard import checkpoint

    tree = {"w": einshard.einshard(np.ones((64, 256), np.float32), "i o -> i o@model", mesh=auto_mesh)}
    checkpoint.save(tmp_path / "ckpt", tree)
    monkeypatch.setattr(tree_rules, "LARGE_LEAF_BYTES", 32 * 1024)
    tree_rules.cache_clear()
    with jax.set_mesh(auto_mesh), pytest.warns(EinshardWarning, match=r"large leaf.*\['w'\]"):
        back = checkpoint.restore(tmp_path / "ckpt", like=tree, expressions={r"^\['w'\]$": "i o -> i o"})
    np.testing.assert_array_equal(np.asarray(back["w"]), np.ones((64, 256), np.float32))


def test_rules_that_say_none_on_purpose_are_not_a_rule_set_that_matches_nothing(auto_mesh):
    tree = {"w": np.zeros((4, 4), np.float32)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", EinshardWarning)
        assert tree_rules.leaf_expressions(tree, {"w": None}, unmatched=tree_rules.UNMATCHED) == (None,)


def test_plan_output_names_a_large_leaf_its_rules_leave_replicated(monkeypatch):
    monkeypatch.setattr(tree_rules, "LARGE_LEAF_BYTES", 16 * 1024)  # the biases (1 KiB) stay small, w1/w2 large
    tree_rules.cache_clear()

    def loss(p, x):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b"]) @ p["w2"]) ** 2)

    params = {
        "w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
        "b": jax.ShapeDtypeStruct((256,), jnp.float32),
        "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32),
    }
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    # A latency-bound step on the h100 profile: the plan replicates the weights (docs/planner.md, Limits).
    with pytest.warns(EinshardWarning, match=r"large leaf/leaves replicated.*\['w1'\]"):
        result = einshard.plan(jax.value_and_grad(loss), params, x, mesh={"data": 4, "model": 2}, profile="h100")
    assert "@" not in result.rules[r"^\['w1'\]$"]
