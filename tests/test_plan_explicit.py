"""plan() on a mesh with Explicit axes (jax.make_mesh's default, where users call it): each candidate ``verify=``
compiles is the typed program a user's step is there; a layout JAX refuses there is reported as refused (JAX's
first line, at the user's line, as explain reports it), ranked after those JAX accepts, and its numbers, compiled on
Auto axes, are labelled so; a chosen layout JAX refuses says so on the plan's first line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.cost import cpu_profile
from einshard.testing import hlo

MLP = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
BATCH = jax.ShapeDtypeStruct((256, 64), jnp.float32)


def mlp_loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"])  # the row-parallel matmul JAX refuses split on both sides


ONE = {"w": jax.ShapeDtypeStruct((64, 128), jnp.float32)}


def one_layer(p, x):
    return jnp.sum(jnp.tanh(x @ p["w"]))


def explicit_mesh():
    return jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes: jax.make_mesh's default


def specs_of(rules, data_rules, params, batch, mesh):
    """The PartitionSpecs the plan's rules give each leaf (as einshard(params, rules) places them)."""
    from einshard._src.core.layout import resolve_named
    from einshard._src.core.mesh import mesh_axes
    from einshard._src.parsing import parse_placement
    from einshard._src.tree_rules import leaf_expressions

    axes = mesh_axes(mesh)

    def spec(expr, shape):
        return P(*resolve_named(parse_placement(expr), shape, axes).spec_entries())

    leaves, tree = jax.tree_util.tree_flatten(params)
    p_specs = [spec(e, x.shape) for e, x in zip(leaf_expressions(params, rules), leaves)]
    (data_expr,) = data_rules[0].values()
    return jax.tree_util.tree_unflatten(tree, p_specs), spec(data_expr, batch.shape)


def direct_compile(step, params, batch, p_specs, x_spec, mesh):
    """The step compiled as a user runs it on ``mesh``: arguments typed (placed) by the specs, gradients laid out
    like their parameters; its collectives by kind, bytes sent per device and peak memory."""
    typed_p = jax.tree.map(
        lambda s, sp: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, sp)), params, p_specs
    )
    typed_x = jax.ShapeDtypeStruct(batch.shape, batch.dtype, sharding=NamedSharding(mesh, x_spec))
    outs = (None, jax.tree.map(lambda sp: NamedSharding(mesh, sp), p_specs))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, out_shardings=outs).lower(typed_p, typed_x).compile()
    kinds: dict[str, int] = {}
    for c in hlo.normalized(compiled.as_text()):
        kinds[c.kind] = kinds.get(c.kind, 0) + c.runs
    sent = sum(c.runs * c.sent_bytes for c in hlo.normalized(compiled.as_text()))
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return kinds, sent, peak


def test_candidates_jax_accepts_are_compiled_as_the_typed_program():
    step = jax.value_and_grad(one_layer)
    mesh = explicit_mesh()
    r = einshard.plan(step, ONE, BATCH, mesh=mesh, verify=3, profile="cpu")
    # The candidates JAX accepts on these axes are compiled there; one it refuses (a product contracting a split
    # both operands hold over 'model': the refused rows' own tests below) is a row of its own, on Auto axes.
    accepted = [v for v in r.verification if not v.refused]
    assert accepted and accepted[0].chosen and not r.needs_auto_axes
    assert all(v.compiled_axes == "the mesh's" for v in accepted)
    refused = len(r.verification) - len(accepted)
    assert all(
        v.refused.startswith("ShardingTypeError: Contracting dimensions are sharded")
        for v in r.verification
        if v.refused
    )
    # The two columns are two programs on Explicit axes, and the explanation says which.
    assert "predicted as the untyped step (Auto axes' propagation), compiled as the typed step" in r.explanation
    assert str(r).count("REFUSED by JAX") == refused and "NEEDS" not in str(r).splitlines()[0]
    chosen = next(v for v in r.verification if v.chosen)
    p_specs, x_spec = specs_of(r.rules, r.data_rules, ONE, BATCH, mesh)
    kinds, sent, peak = direct_compile(step, ONE, BATCH, p_specs, x_spec, mesh)
    assert chosen.compiled_kinds == kinds and chosen.compiled_comm_bytes == sent
    # The compiled memory is the program's peak plus Adam's two f32 moments of the parameters' pieces (as planned).
    assert chosen.compiled_memory == peak + 8 * sum(
        piece_elements(s, sp, mesh)
        for s, sp in zip(jax.tree.leaves(ONE), jax.tree.leaves(p_specs, is_leaf=lambda x: isinstance(x, P)))
    )


def piece_elements(shape_struct, spec, mesh):
    """Elements of one device's piece of an array laid out as ``spec``."""
    split = 1
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            split *= mesh.shape[axis]
    return shape_struct.size // split


@pytest.fixture(scope="module")
def mlp_plan():
    with jax.set_mesh(explicit_mesh()):
        return einshard.plan(jax.value_and_grad(mlp_loss), MLP, BATCH, verify=3, profile="cpu")


def test_a_refused_candidate_is_reported_and_ranked_after_those_jax_accepts(mlp_plan):
    rows = mlp_plan.verification
    refused = [v for v in rows if v.refused]
    accepted = [v for v in rows if not v.refused]
    assert refused and accepted, [(v.label, v.refused) for v in rows]
    # Those JAX accepts first; the plan is one of them, and nothing on its first line says it needs auto_axes.
    assert rows[: len(accepted)] == tuple(accepted) and rows[0].chosen and not mlp_plan.needs_auto_axes
    assert "NEEDS" not in str(mlp_plan).splitlines()[0]
    for v in refused:
        assert v.refused.startswith("ShardingTypeError: Contracting dimensions are sharded")
        assert v.refused.endswith("(mlp_loss))") and "test_plan_explicit.py:" in v.refused
        assert v.compiled_axes == "Auto" and v.to_dict()["refused"] == v.refused
    text = str(mlp_plan)
    assert text.count("REFUSED by JAX on the mesh's Explicit axes") == len(refused)
    assert text.count("compiled on Auto axes instead (as jax.sharding.auto_axes would run it)") == len(refused)
    # The prediction's first is refused, and the explanation says the plan is the best JAX accepts.
    assert f"JAX refuses {len(refused)} of them" in mlp_plan.explanation and "the best JAX accepts" in text


def test_the_plan_runs_as_written_and_a_refused_layout_raises_where_the_row_says(mlp_plan):
    mesh = explicit_mesh()
    step = jax.value_and_grad(mlp_loss)
    params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), MLP)
    x = jnp.ones(BATCH.shape, BATCH.dtype)
    placed_p, placed_x = mlp_plan.place(params, x, mesh=mesh)
    with jax.set_mesh(mesh):
        jax.jit(step)(placed_p, placed_x)  # the chosen layout: JAX types it
    row = next(v for v in mlp_plan.verification if v.refused)
    alt = next(a for a in mlp_plan.alternatives if a.label == row.label)
    bad_p = einshard.einshard(params, alt.rules, mesh=mesh)
    (data_expr,) = alt.data_rules[0].values()
    bad_x = einshard.einshard(x, data_expr, mesh=mesh)
    with jax.set_mesh(mesh), pytest.raises(Exception, match="Contracting dimensions are sharded") as raised:
        jax.jit(step)(bad_p, bad_x)
    assert type(raised.value).__name__ == row.refused.split(":")[0]
    # explain says so of the same layout: JAX rejects the op at the line the row names.
    report = einshard.explain(step, MLP, BATCH, mesh=mesh, in_specs=(alt.rules, alt.data_rules[0]))
    assert report.explicit is not None and report.explicit.findings
    assert any(f"(at {f.where})" in row.refused for f in report.explicit.findings)
    assert str(report).splitlines()[0].startswith("REFUSED ON EXPLICIT AXES: JAX rejects 1 op")


def test_a_refused_row_shows_the_auto_programs_compile_labelled_so(mlp_plan):
    mesh = explicit_mesh()
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    row = next(v for v in mlp_plan.verification if v.refused)
    alt = next(a for a in mlp_plan.alternatives if a.label == row.label)
    p_specs, x_spec = specs_of(alt.rules, alt.data_rules, MLP, BATCH, mesh)
    kinds, sent, _ = direct_compile(jax.value_and_grad(mlp_loss), MLP, BATCH, p_specs, x_spec, auto)
    assert row.compiled_kinds == kinds and row.compiled_comm_bytes == sent


def test_when_jax_refuses_every_candidate_the_first_line_says_it_needs_auto_axes():
    # A hand layout the search also reaches (Megatron over both axes) is the best preset: every candidate
    # verify=1 compiles is refused, so the plan is chosen by the Auto compile and says so.
    megatron = ({r"\['w1'\]": "x y -> x y@(data,model)", r"\['w2'\]": "x y -> x@(data,model) y"}, "b s -> b s")
    with jax.set_mesh(explicit_mesh()):
        r = einshard.plan(
            jax.value_and_grad(mlp_loss), MLP, BATCH, verify=1, profile="cpu", presets={"megatron": megatron}
        )
    assert all(v.refused for v in r.verification), [(v.label, v.refused) for v in r.verification]
    first = str(r).splitlines()[0]
    assert "NEEDS jax.sharding.auto_axes" in first and "compiled on Auto axes:" in first
    assert r.needs_auto_axes.startswith("ShardingTypeError: Contracting dimensions are sharded")
    assert "needs jax.sharding.auto_axes" in r.warning and r.to_dict()["needs_auto_axes"] == r.needs_auto_axes
    assert "none is accepted" in r.explanation


def test_an_unverified_plan_says_its_prediction_is_the_auto_programs_and_checks_the_choice_types():
    step = jax.value_and_grad(mlp_loss)
    with jax.set_mesh(explicit_mesh()):
        r = einshard.plan(step, MLP, BATCH, verify=0, profile="cpu")
    sizes = einshard.plan(step, MLP, BATCH, mesh={"data": 4, "model": 2}, verify=0, profile="cpu")
    # The same prediction (the untyped program) and the same choice as from sizes, now said so.
    assert r.rules == sizes.rules and r.time_s == sizes.time_s
    assert "predicted for the step as XLA lays it out by propagation (Auto axes)" in r.explanation
    assert "Auto axes" not in sizes.explanation and not sizes.needs_auto_axes
    # The cpu profile's choice is Megatron over both axes: JAX refuses it on Explicit axes, and the plan says so.
    assert r.needs_auto_axes.startswith("ShardingTypeError: Contracting dimensions are sharded")
    assert "NEEDS jax.sharding.auto_axes" in str(r).splitlines()[0] and "needs jax.sharding.auto_axes" in r.warning
    # ... and names the best-ranked layout JAX does type (the one verify= chooses: test above).
    assert "the best-ranked layout JAX accepts is preset dp (predicted " in r.explanation
    # A choice JAX types says nothing of the kind (and does type: placed as planned, the step traces).
    mesh = explicit_mesh()
    one = jax.value_and_grad(one_layer)
    ok = einshard.plan(one, ONE, BATCH, mesh=mesh, verify=0, profile="cpu")
    assert not ok.needs_auto_axes and "NEEDS" not in str(ok) and "needs jax.sharding" not in ok.warning
    p_specs, x_spec = specs_of(ok.rules, ok.data_rules, ONE, BATCH, mesh)
    direct_compile(one, ONE, BATCH, p_specs, x_spec, mesh)


def test_the_cli_plans_on_explicit_axes_and_prints_the_refused_candidates(capsys):
    from einshard_apps.cli import main

    code = main(["plan", "--mesh", "data=4,model=2", "--width", "64", "--batch", "256", "--verify", "1", "--explicit"])
    out = capsys.readouterr().out
    assert code == 0
    assert "REFUSED by JAX on the mesh's Explicit axes: ShardingTypeError" in out
    assert "compiled on Auto axes instead" in out and "the best JAX accepts" in out
    assert "NEEDS" not in out.splitlines()[1]


def test_an_abstract_mesh_keeps_its_axis_types():
    step = jax.value_and_grad(mlp_loss)
    explicit = jax.sharding.AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    auto = jax.sharding.AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    typed = einshard.plan(step, MLP, BATCH, mesh=explicit, verify=3, profile="cpu")
    assert any(v.refused for v in typed.verification) and not next(v for v in typed.verification if v.chosen).refused
    untyped = einshard.plan(step, MLP, BATCH, mesh=auto, verify=3, profile="cpu")
    assert not any(v.refused for v in untyped.verification) and not untyped.needs_auto_axes
    assert "typed step" not in untyped.explanation and "Auto axes" not in untyped.explanation
    # Unverified: an Explicit AbstractMesh's choice is traced typed on this process's devices, and said so.
    unverified = einshard.plan(step, MLP, BATCH, mesh=explicit, verify=0, profile="cpu")
    assert unverified.needs_auto_axes and "Auto axes" in unverified.explanation


def test_the_cli_refuses_explicit_with_a_target_naming_both(capsys):
    from einshard_apps.cli import main

    assert main(["plan", "--explicit", "--target", "gpu:h100x8", "--width", "64", "--batch", "256"]) == 2
    err = capsys.readouterr().err
    assert "--explicit" in err and "--target" in err


def test_each_spec_lands_on_its_own_leaf_past_an_empty_node():
    """A parameter tree with an empty node (an Equinox layer's ``bias=None``): the specs unflattened from the
    parameters' structure hold a None there that is no leaf; flattened alone they shifted every later spec onto
    the wrong array (a 2-D spec on a bias: JAX's rank error from plan() on an Explicit mesh, where the candidates
    are traced typed; on Auto axes verify compiled the shifted layouts)."""
    from einshard._src.planner.verify import specs_per_leaf

    arg = {"a": jnp.zeros((4, 8)), "b": None, "c": jnp.zeros((8,))}
    assert specs_per_leaf(arg, {"a": P("data", None), "b": None, "c": P(None)}) == [P("data", None), P(None)]
    assert specs_per_leaf(arg, P()) == [P(), P()]  # a prefix: one spec for the whole tree

    params = {
        "bias": None,
        "w0": jax.ShapeDtypeStruct((64, 128), jnp.float32),
        "w1": jax.ShapeDtypeStruct((128,), jnp.float32),
    }

    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w0"]) * p["w1"])

    batch = jax.ShapeDtypeStruct((64, 64), jnp.float32)
    for verify in (0, 2):
        r = einshard.plan(loss, params, batch, mesh=explicit_mesh(), profile="cpu", verify=verify)
        assert not any(row.refused for row in r.verification)
        chosen = next((row for row in r.verification if row.chosen), None) if verify else None
        if chosen is not None:  # the chosen layout's compiled numbers are its own program's: explain's bytes
            assert chosen.compiled_comm_bytes == pytest.approx(chosen.predicted_comm_bytes, rel=0.1, abs=1.0)


def test_an_unverified_plan_says_where_the_typed_step_moves_other_collectives():
    """The search ranks the untyped step (Auto axes' propagation); on Explicit axes the step a user runs is typed.
    Where explain's typed step of the choice moves other collectives than the prediction, the explanation says so
    with both (APPROXIMATE ...), and the typed ones are what XLA compiles; where they agree it says nothing more.
    The Haiku layer stack of the external corpus: its typed step gathers 24 times where propagation gathers none."""
    pytest.importorskip("haiku")
    from external_corpus.families import FAMILIES
    from external_corpus.planning import step_of

    from einshard._src.planner.verify import collective_kinds

    family = FAMILIES["hk_stack"]()
    step, mesh = step_of(family), explicit_mesh()
    # The FLOPs-only profile plans a split of this small stack; the default one plans the step replicated (measured
    # the fastest: benchmarks/results/plan_prediction.json), whose typed step is its untyped one and moves nothing.
    flops_only = cpu_profile(small_ops=False)
    r = einshard.plan(step, family.params, family.batch, mesh=mesh, profile=flops_only, verify=0)
    (note,) = [ln for ln in r.explanation.splitlines() if ln.startswith("APPROXIMATE on this mesh's Explicit axes")]
    predicted = ", ".join(f"{n} {k}" for k, n in sorted(collective_kinds(r.report).items()))
    assert f"against the prediction's {einshard_bytes(r.report.comm_bytes)}/device ({predicted})" in note
    # What XLA compiles of the typed step of that layout (verify= compiles it on the mesh's Explicit axes).
    typed = einshard.plan(step, family.params, family.batch, mesh=mesh, profile=flops_only, verify=1)
    chosen = next(v for v in typed.verification if v.chosen)
    assert typed.rules == r.rules and not chosen.refused and chosen.compiled_axes == "the mesh's"
    compiled = ", ".join(f"{n} {k}" for k, n in sorted(chosen.compiled_kinds.items()))
    assert f"sends {einshard_bytes(chosen.compiled_comm_bytes)}/device ({compiled}) against" in note
    assert chosen.compiled_kinds != collective_kinds(r.report)
    # Where the typed step is the untyped one's (one tanh layer), nothing of the kind is said.
    ok = einshard.plan(jax.value_and_grad(one_layer), ONE, BATCH, mesh=mesh, verify=0, profile="cpu")
    assert "APPROXIMATE" not in ok.explanation


def einshard_bytes(n: float) -> str:
    from einshard._src.analysis.cost import human_bytes

    return human_bytes(n)
