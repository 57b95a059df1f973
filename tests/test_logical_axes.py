"""Logical axis names in expressions (issue 24): 'b d -> b@batch d@embed' with a rules table, everywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType, PartitionSpec

import einshard
from einshard._src.core.logical import AxisRules, logical_to_mesh, resolve_side_names

RULES = {"batch": ("data", "fsdp"), "embed": None, "mlp": "model", "heads": "model"}


@pytest.fixture(scope="module", params=["explicit", "auto"])
def mesh(request):
    kind = AxisType.Explicit if request.param == "explicit" else AxisType.Auto
    return jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types=(kind,) * 3)


# ---------------------------------------------------------------------------
# The resolution rule, against a naive reference and against Flax's own


def naive_flax(dims, rules, taken=()):
    """Flax's logical_to_mesh_axes written out plainly: rules in order, first free one wins, else whole."""
    out = {}
    used = list(taken)
    for name, axes in rules:
        if name not in dims or name in out:
            continue
        if any(m in used for m in axes):
            continue
        out[name] = axes
        used += list(axes)
    return tuple(() if d is None else tuple(out.get(d, ())) for d in dims)


MESH = ("data", "fsdp", "model", "expert")
LOGICAL = ("batch", "embed", "mlp", "heads", "kv", "vocab")


@st.composite
def rule_sets(draw):
    n = draw(st.integers(0, 10))
    rules = []
    for _ in range(n):
        name = draw(st.sampled_from(LOGICAL))
        axes = tuple(draw(st.lists(st.sampled_from(MESH), max_size=3, unique=True)))
        rules.append((name, axes))
    return rules


@st.composite
def sides(draw):
    """A side: each dimension has a logical name, a direct mesh axis, or nothing."""
    n = draw(st.integers(0, 5))
    logical = draw(st.lists(st.sampled_from(LOGICAL), min_size=n, max_size=n, unique=True))
    direct = draw(st.lists(st.sampled_from(MESH), max_size=2, unique=True))
    dims = [(name,) for name in logical] + [(m,) for m in direct] + [None] * draw(st.integers(0, 2))
    return draw(st.permutations(dims))


@given(rule_sets(), sides())
def test_resolution_matches_a_naive_reference(rules, side):
    table = AxisRules.of(rules)
    names = [g[0] if g is not None and g[0] in LOGICAL else None for g in side]
    taken = [g[0] for g in side if g is not None and g[0] in MESH]
    known = set(table.names)
    if any(n is not None and n not in known for n in names):
        with pytest.raises(einshard.EinshardError, match="neither a mesh axis"):
            resolve_side_names(side, table, MESH)
        return
    got = resolve_side_names(side, table, MESH)
    want = naive_flax(names, rules, taken)
    for g, n, w, r in zip(side, names, want, got):
        if n is None:
            assert r == g  # a direct mesh axis, or no '@', is left as written
        else:
            assert r == w


@given(rule_sets(), st.lists(st.sampled_from(LOGICAL), max_size=5, unique=True))
def test_resolution_matches_flax(rules, dims):
    spmd = pytest.importorskip("flax.linen.spmd")
    flax_rules = [(n, None if not a else a[0] if len(a) == 1 else a) for n, a in rules]
    want = spmd.logical_to_mesh_axes(dims, flax_rules)
    got = logical_to_mesh(dims, AxisRules.of(rules))
    assert tuple(PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in got))) == tuple(want)


@given(rule_sets(), sides())
def test_expressions_with_logical_names_place_as_the_reference_says(rules, side):
    """Through the parser and einshard.spec (the text a user writes), against the naive reference."""
    table = AxisRules.of(rules)
    if any(g is not None and g[0] in LOGICAL and g[0] not in table.names for g in side):
        return  # (errors: the test above)
    names = [g[0] if g is not None and g[0] in LOGICAL else None for g in side]
    taken = [g[0] for g in side if g is not None and g[0] in MESH]
    want = naive_flax(names, rules, taken)
    axes = [chr(ord("a") + i) for i in range(len(side))]
    right = [a if g is None else f"{a}@{g[0]}" for a, g in zip(axes, side)]
    text = f"{' '.join(axes)} -> {' '.join(right)}"
    got = einshard.spec(text, (16,) * len(side), mesh=dict.fromkeys(MESH, 2), axis_rules=rules)
    expected = [w if n is not None else (g or ()) for n, w, g in zip(names, want, side)]
    assert tuple(got) == tuple(None if not e else e[0] if len(e) == 1 else tuple(e) for e in expected)


def test_first_free_rule_wins_and_a_taken_one_replicates():
    rules = AxisRules.of([("batch", ("data", "fsdp")), ("batch", "data"), ("embed", "fsdp"), ("mlp", "model")])
    # batch claims data+fsdp first, so embed's fsdp is taken: embed is whole
    assert logical_to_mesh(["batch", "embed"], rules) == (("data", "fsdp"), ())
    # with data named directly, batch's first rule is not free, its second is not either: whole
    assert resolve_side_names([("batch",), ("data",), ("mlp",)], rules, MESH) == ((), ("data",), ("model",))
    # rules are read in order, whichever dimension comes first
    assert logical_to_mesh(["embed", "batch"], rules) == ((), ("data", "fsdp"))


# ---------------------------------------------------------------------------
# Every function that takes a mesh


def test_placement_functions_take_axis_rules(mesh):
    expr = "b s d -> b@batch s d@mlp"
    want = PartitionSpec(("data", "fsdp"), None, "model")
    assert einshard.spec(expr, (8, 4, 16), mesh=mesh, axis_rules=RULES) == want
    assert einshard.sharding(expr, (8, 4, 16), mesh=mesh, axis_rules=RULES).spec == want
    assert einshard.layout(expr, (8, 4, 16), mesh=mesh, axis_rules=RULES).dims == (("data", "fsdp"), (), ("model",))
    x = einshard.einshard(np.ones((8, 4, 16), np.float32), expr, mesh=mesh, axis_rules=RULES)
    assert x.sharding.spec == want
    with einshard.axis_rules(list(RULES.items())):  # Flax's list-of-pairs form
        assert einshard.spec(expr, (8, 4, 16), mesh=mesh) == want
        with jax.set_mesh(mesh):
            y = einshard.einshard(np.ones((8, 4, 16), np.float32), expr)
            assert y.sharding.spec == want


def test_the_same_text_under_other_rules_is_resolved_again(mesh):
    expr = "b d -> b@batch d"
    x = np.ones((8, 4), np.float32)
    a = einshard.einshard(x, expr, mesh=mesh, axis_rules={"batch": "data"})
    b = einshard.einshard(x, expr, mesh=mesh, axis_rules={"batch": "model"})
    assert a.sharding.spec == PartitionSpec("data", None) and b.sharding.spec == PartitionSpec("model", None)
    assert einshard.layout(expr, (8, 4), mesh=mesh, axis_rules={"batch": "fsdp"}).dims == (("fsdp",), ())


def test_tree_rules_and_jit_and_grad(mesh):
    params = {"w_in": np.ones((16, 32), np.float32), "w_out": np.ones((32, 16), np.float32)}
    tree = {r"w_in": "d f -> d@embed f@mlp", r"w_out": "f d -> f@embed d@mlp"}
    placed = einshard.einshard(params, tree, mesh=mesh, axis_rules=RULES)
    assert placed["w_in"].sharding.spec == PartitionSpec(None, "model")

    def loss(p, x):
        x = einshard.einshard(x, "b d -> b@batch d@embed")
        h = einshard.einshard(jnp.tanh(x @ p["w_in"]), "b f -> b@batch f")
        return jnp.mean((h @ p["w_out"]) ** 2)

    x = np.ones((8, 16), np.float32)

    def plain(p, x):
        return jnp.mean((jnp.tanh(x @ p["w_in"]) @ p["w_out"]) ** 2)

    with jax.set_mesh(mesh), einshard.axis_rules(RULES):
        g = jax.jit(jax.grad(loss))(placed, x)
    want = jax.grad(plain)(params, x)
    if mesh.axis_types[0] == AxisType.Explicit:  # (on Auto axes XLA chooses the gradient's layout)
        assert g["w_in"].sharding.spec == PartitionSpec(None, "model")
    np.testing.assert_allclose(np.asarray(g["w_in"]), np.asarray(want["w_in"]), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(g["w_out"]), np.asarray(want["w_out"]), rtol=1e-5)


def test_analyze_explain_einsum_lower_and_plan(mesh):
    sizes = {"data": 2, "fsdp": 2, "model": 2}
    logical = einshard.analyze(
        "b d@embed, d f@mlp -> b? f?", sizes={"b": 8, "d": 16, "f": 32}, mesh=sizes, axis_rules=RULES
    )
    direct = einshard.analyze("b d, d f@model -> b? f?", sizes={"b": 8, "d": 16, "f": 32}, mesh=sizes)
    assert str(logical.out_layout) == str(direct.out_layout) and logical.collectives == direct.collectives

    x = np.arange(8 * 16, dtype=np.float32).reshape(8, 16) / 100
    w = np.arange(16 * 32, dtype=np.float32).reshape(16, 32) / 100
    y = einshard.einsum("b d, d f@mlp -> b f@mlp", x, w, mesh=mesh, axis_rules=RULES)
    np.testing.assert_allclose(np.asarray(y), x @ w, rtol=1e-5)
    assert y.sharding.spec == PartitionSpec(None, "model")
    with jax.set_mesh(mesh), einshard.axis_rules(RULES):  # the mesh and the rules both current
        z = einshard.einsum("b@batch d, d f@mlp -> b@batch f@mlp", x, w)
    assert z.sharding.spec == PartitionSpec(("data", "fsdp"), "model")
    np.testing.assert_allclose(np.asarray(z), x @ w, rtol=1e-5)
    prog = einshard.lower("b@batch d, d f -> b@batch f", x, w, mesh=mesh, axis_rules=RULES)
    np.testing.assert_allclose(np.asarray(prog(x, w)), x @ w, rtol=1e-5)

    def fwd(w, x):
        return jnp.tanh(x @ w)

    report = einshard.explain(fwd, w, x, mesh=sizes, in_specs=("d f -> d f@mlp", "b d -> b@batch d"), axis_rules=RULES)
    same = einshard.explain(fwd, w, x, mesh=sizes, in_specs=("d f -> d f@model", "b d -> b@(data,fsdp) d"))
    assert report.comm_bytes == same.comm_bytes and report.peak_bytes == same.peak_bytes

    def step(p, x):
        return jax.value_and_grad(lambda p: jnp.mean(fwd(p, x) ** 2))(p)

    def preset(result):
        (alt,) = [a for a in result.alternatives if a.label == "preset mine"]
        return alt.time_s, alt.memory_bytes, alt.comm_bytes

    logical_preset = {"mine": ({".*": "d f -> d f@mlp"}, ({".*": "b d -> b@batch d"},))}
    direct_preset = {"mine": ({".*": "d f -> d f@model"}, ({".*": "b d -> b@(data,fsdp) d"},))}
    with_rules = einshard.plan(step, w, x, mesh=sizes, presets=logical_preset, axis_rules=RULES)
    assert preset(with_rules) == preset(einshard.plan(step, w, x, mesh=sizes, presets=direct_preset))


def test_fsdp_loss_keeps_its_rules_when_called_later(mesh):
    params = {"w": np.ones((16, 8), np.float32)}
    loss = einshard.fsdp(
        lambda p, x: jnp.mean(x @ p["w"]),
        {"w": "d f -> d@batch f"},
        mesh=mesh,
        batch_axis=("data", "fsdp"),
        axis_rules={"batch": ("data", "fsdp")},
    )
    x = np.ones((8, 16), np.float32)
    with jax.set_mesh(mesh):
        g = jax.jit(jax.grad(loss))(params, x)
    np.testing.assert_allclose(np.asarray(g["w"]), np.full((16, 8), 1 / 8, np.float32), rtol=1e-6)


# ---------------------------------------------------------------------------
# Errors name both tables and point at the column


def test_an_unknown_name_names_both_tables_and_points_at_it(mesh):
    with pytest.raises(einshard.EinshardError) as err:
        einshard.spec("b s d -> b@batch s d@embd", (8, 4, 16), mesh=mesh, axis_rules=RULES)
    text = str(err.value)
    assert "'embd' is neither a mesh axis (mesh axes: 'data', 'fsdp', 'model')" in text
    assert "axis rules: 'batch', 'embed', 'mlp', 'heads'" in text and "Did you mean 'embed'?" in text
    line, caret = text.splitlines()[1:3]
    assert line.strip() == "b s d -> b@batch s d@embd" and line[caret.index("^") :] == "embd"


@pytest.mark.parametrize(
    ("expr", "rules", "message"),
    [
        ("b d -> b@(batch,model) d", RULES, "a logical axis name stands alone after '@'"),
        ("b d -> b@data d", {"data": "model"}, "is both a mesh axis and a logical axis name"),
        ("b d -> b@batch d", {"batch": "pipeline"}, "'pipeline' is not an axis of the mesh"),
        ("b d -> b@batch d@batch", RULES, "'batch' shards two array axes of one side"),
    ],
)
def test_bad_uses_are_errors(mesh, expr, rules, message):
    with pytest.raises(einshard.EinshardError, match=message):
        einshard.spec(expr, (8, 16), mesh=mesh, axis_rules=rules)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ("batch", "axis_rules= takes a dict"),
        ([("batch",)], "a rule is a \\(logical name, mesh axes\\) pair"),
        ({"batch": 3}, "maps to 3"),
        ({"": "data"}, "a logical name is a non-empty string"),
        ({"batch": ("data", "data")}, "names a mesh axis twice"),
    ],
)
def test_bad_tables_are_errors(rules, message):
    with pytest.raises(einshard.EinshardError, match=message):
        einshard.spec("b d -> b@batch d", (8, 16), mesh={"data": 2}, axis_rules=rules)


def test_a_mesh_axis_name_still_means_the_mesh_axis_and_no_rules_change_nothing(mesh):
    assert einshard.spec("b d -> b@data d", (8, 16), mesh=mesh, axis_rules={"data": "data"}) == PartitionSpec(
        "data", None
    )
    with pytest.raises(einshard.EinshardError, match="'batch' is not an axis of the mesh"):
        einshard.spec("b d -> b@batch d", (8, 16), mesh=mesh)
    # no mesh at all: rule names are logical, the rest are taken for mesh axes
    assert einshard.spec("b d -> b@batch d@model", (8, 16), axis_rules=RULES) == PartitionSpec(
        ("data", "fsdp"), "model"
    )
