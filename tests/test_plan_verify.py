"""plan(verify=k): the planner compiles its best candidates (shapes only) and chooses by XLA's numbers; the
profile of this machine by default, named on the first line."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard._src.analysis.cost import PROFILES, cpu_profile, default_profile, get_profile, profile_for
from einshard._src.planner.verify import DEFAULT_VERIFY
from einshard.testing import hlo

# An op of this test's own, so no layout rule will ever exist for it: a sort along the last axis.  explain
# prices it as an op XLA cannot partition (operands gathered whole); XLA does partition a sort along its
# other axes, so with the batch split it moves nothing: the prediction ranks data parallelism wrong.
opaque_sort = Primitive("einshard_test_opaque_sort")
opaque_sort.def_impl(lambda x: jnp.sort(x, axis=-1))
opaque_sort.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(opaque_sort, mlir.lower_fun(lambda x: jnp.sort(x, axis=-1), multiple_results=False))


def forward(p, x):
    return opaque_sort.bind(jnp.tanh(x @ p["w1"]) @ p["w2"])


PARAMS = {"w1": jax.ShapeDtypeStruct((16, 16), jnp.float32), "w2": jax.ShapeDtypeStruct((16, 4096), jnp.float32)}
X = jax.ShapeDtypeStruct((512, 16), jnp.float32)


# The cpu profile with each of the 8 devices on a core of its own, whatever host runs this: on a host with fewer
# cores its devices share them (Profile.host_cores), compute costs more, and the prediction already ranks data
# parallelism first.  FLOPs only (small_ops=False): the default profile prices the elementwise work on the (512, 4096)
# logits the batch split divides 8 ways, and ranks data parallelism first as well
# (test_the_default_profile_ranks_first_what_the_compiler_chooses); these tests need a prediction the compiler
# must correct.
FLOPS_ONLY = cpu_profile(8, small_ops=False)


@pytest.fixture(scope="module")
def plans():
    kw = dict(mesh={"data": 8}, objective="inference", profile=FLOPS_ONLY)
    return einshard.plan(forward, PARAMS, X, verify=0, **kw), einshard.plan(forward, PARAMS, X, **kw)


def test_the_default_profile_ranks_first_what_the_compiler_chooses(plans):
    """The same program on the default profile: the prediction still thinks data parallelism gathers the sort's
    operand, but the element work on the logits, whole on every device with the batch replicated, outweighs that
    gather, so the prediction alone ranks first the layout XLA's numbers choose (the FLOPs-only verify's choice)."""
    _, verified = plans
    kw = dict(mesh={"data": 8}, objective="inference", profile=cpu_profile(8))
    predicted = einshard.plan(forward, PARAMS, X, verify=0, **kw)
    assert predicted.data_rules == verified.data_rules and predicted.rules == verified.rules
    replicated = einshard.plan(
        forward, PARAMS, X, verify=0, presets={"whole": ({".*": "x y -> x y"}, "b s -> b s")}, **kw
    )
    whole = next(a for a in replicated.alternatives if a.label == "preset whole")
    # its predicted communication is the gather (more than the replicated batch's none), its compute the less
    assert predicted.comm_bytes > whole.comm_bytes and predicted.compute_s < whole.compute_s


def test_an_incomplete_model_is_verified_by_default_and_the_compiler_decides(plans):
    predicted, verified = plans
    assert not predicted.report.complete and not predicted.verification
    assert "incomplete" in predicted.warning and "prediction alone" in predicted.warning
    # The prediction's choice: the batch replicated (it thinks data parallelism gathers the logits).
    assert predicted.data_rules[0]["^$"] == "b s -> b s"
    rows = verified.verification
    # The best k candidates and the best preset, which is one of them here (data parallelism, parameters
    # replicated: ranked third since a row-split w2's all-reduce of the logits is predicted as XLA compiles it).
    labels = [r.label for r in rows]
    assert len(rows) == DEFAULT_VERIFY and len(set(labels)) == len(labels) and sum(r.chosen for r in rows) == 1
    chosen = next(r for r in rows if r.chosen)
    assert chosen.label == "dp(data) · params replicated" and verified.data_rules[0]["^$"] == "b s -> b@data s"
    assert chosen.predicted_comm_bytes > 0 and chosen.compiled_comm_bytes == 0 and chosen.compiled_count == 0
    first = next(r for r in rows if r.label == "replicated batch · params replicated")
    # dp's compiled time (no collective) beats the prediction's first; both computes are XLA's FLOPs on the profile.
    assert chosen.compiled_time_s < first.compiled_time_s and chosen.compiled_time_s < chosen.predicted_time_s
    assert chosen.compute_from == first.compute_from == "cost_analysis"
    text = str(verified)
    assert text.splitlines()[0].startswith("plan (inference, budget none, profile cpu, INCOMPLETE model")
    assert "verified with XLA (predicted -> compiled; * the plan):" in text and "chose dp(data)" in text
    d = verified.to_dict()
    assert d["complete"] is False and d["profile"] == "cpu"
    assert [v["chosen"] for v in d["verification"]] == [r.chosen for r in rows]
    assert d["verification"][0]["compiled"]["comm_bytes"] == chosen.compiled_comm_bytes


def test_the_compiled_numbers_are_a_direct_compile_of_that_layout(plans):
    _, verified = plans
    for row, batch_spec, params_spec in (
        (next(r for r in verified.verification if r.chosen), P("data"), P()),
        (next(r for r in verified.verification if r.label == "replicated batch · params replicated"), P(), P()),
    ):
        mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
        p = {
            "w1": jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=NamedSharding(mesh, P())),
            "w2": jax.ShapeDtypeStruct((16, 4096), jnp.float32, sharding=NamedSharding(mesh, params_spec)),
        }
        x = jax.ShapeDtypeStruct((512, 16), jnp.float32, sharding=NamedSharding(mesh, batch_spec))
        compiled = jax.jit(forward).lower(p, x).compile()
        colls = hlo.normalized(compiled.as_text())
        assert row.compiled_comm_bytes == sum(c.sent_bytes * c.runs for c in colls)
        assert row.compiled_count == sum(c.runs for c in colls)
        m = compiled.memory_analysis()
        assert row.compiled_memory == (
            m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        )


def mlp_loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


MLP = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
BATCH = jax.ShapeDtypeStruct((256, 64), jnp.float32)


def test_a_complete_model_is_not_verified_unless_asked_and_then_on_the_callers_mesh():
    step = jax.value_and_grad(mlp_loss)
    plain = einshard.plan(step, MLP, BATCH, mesh={"data": 4, "model": 2})
    assert plain.report.complete and not plain.verification and not plain.warning
    mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes, the default
    with jax.set_mesh(mesh):
        checked = einshard.plan(step, MLP, BATCH, verify=2)
    rows = checked.verification
    assert 2 <= len(rows) <= 3 and rows[0].chosen
    # A training step on a complete model: the compiled collectives are those predicted, in count.  Both counted
    # before XLA's combiner (compiled_count counts each piece of a tuple-shaped op; predicted_count is the combined
    # ops since the program's end is no longer chained after every collective: tests/test_combining_outputs.py).
    for r in rows:
        assert r.compiled_count == sum(r.predicted_kinds.values()), r
    assert checked.explanation.startswith(f"verified with XLA ({len(rows)} candidates compiled, shapes only): ")
    # Arrays already placed: their mesh is the one compiled on.
    placed = einshard.einshard(jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), MLP), "x y -> x y", mesh=mesh)
    x = einshard.einshard(jnp.ones(BATCH.shape), "b d -> b@data d", mesh=mesh)
    again = einshard.plan(step, placed, x, verify=1)
    assert again.verification and all(r.compiled_count == sum(r.predicted_kinds.values()) for r in again.verification)


def test_verify_needs_the_meshs_devices_and_says_so():
    too_big = {"data": 16}
    with pytest.raises(einshard.EinshardError, match=r"plan\(verify=...\).*16 devices"):
        einshard.plan(jax.value_and_grad(mlp_loss), MLP, BATCH, mesh=too_big, verify=1)
    # An incomplete model that cannot be verified here is planned, and the result says it was not verified.
    r = einshard.plan(forward, PARAMS, X, mesh=too_big, objective="inference")
    assert not r.verification and "ranked on the prediction alone" in r.warning and "16 devices" in r.warning
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(einshard.EinshardError, match="verify must be a count"):
            einshard.plan(forward, PARAMS, X, mesh={"data": 8}, verify=bad)


def test_the_default_profile_is_this_machines_and_every_report_names_it():
    assert default_profile() is PROFILES["cpu"] and get_profile(None) is PROFILES["cpu"]
    assert profile_for("gpu", "NVIDIA H100 80GB HBM3") is PROFILES["h100"]
    assert profile_for("tpu", "TPU v5p") is PROFILES["tpu-v5p"]
    h200 = profile_for("gpu", "NVIDIA H200")
    assert h200.name == "h100 (for NVIDIA H200)" and h200.flops == PROFILES["h100"].flops
    other = profile_for("gpu", "NVIDIA A100-SXM4-80GB")
    assert other.name.startswith("h100 (stand-in for NVIDIA A100") and other.bandwidth == PROFILES["h100"].bandwidth
    r = einshard.plan(jax.value_and_grad(mlp_loss), MLP, BATCH, mesh={"data": 8})
    assert "profile cpu" in str(r).splitlines()[0] and r.to_dict()["profile"] == "cpu"
    h = einshard.plan(jax.value_and_grad(mlp_loss), MLP, BATCH, mesh={"data": 8}, profile="h100")
    assert "profile h100" in str(h).splitlines()[0]
    report = einshard.explain(mlp_loss, MLP, BATCH, mesh={"data": 8}, in_specs=(None, P("data")))
    assert str(report).splitlines()[0].endswith("profile: cpu")


def test_the_cli_verifies_on_request(capsys):
    from einshard_apps.cli import main

    code = main(["plan", "--mesh", "data=4,model=2", "--width", "64", "--batch", "256", "--verify", "1"])
    out = capsys.readouterr().out
    assert code == 0
    assert "profile cpu, verified with XLA" in out.splitlines()[1]
    assert "verified with XLA (predicted -> compiled; * the plan):" in out


def elementwise_heavy(p, x):
    # 200 multiply-adds per element that explain does not count (it counts the dots' FLOPs), then one small dot:
    # replicated, every device computes all of them; with the batch split, an eighth.
    y = x
    for _ in range(200):
        y = y * y + x
    return jnp.sum(y @ p["w"])


def test_the_compiled_flops_decide_where_they_disagree_with_the_prediction():
    # The prediction counts the dot only (and the element price of its 512 outputs): the batch replicated costs no
    # collective and ~6 µs of compute, so it ranks first; XLA's cost analysis counts the elementwise chain too (80 MFLOP replicated, a ms on the
    # profile), and with the batch split the all-reduce of the sum is cheaper than that: the plan follows XLA.
    kw = dict(mesh={"data": 8}, objective="inference", profile=dataclasses.replace(PROFILES["cpu"], host_cores=8))
    w, x = {"w": jax.ShapeDtypeStruct((512,), jnp.float32)}, jax.ShapeDtypeStruct((512, 512), jnp.float32)
    predicted = einshard.plan(elementwise_heavy, w, x, verify=0, **kw)
    verified = einshard.plan(elementwise_heavy, w, x, verify=3, **kw)
    assert predicted.data_rules[0]["^$"] == "b s -> b s"
    assert verified.data_rules[0]["^$"] == "b s -> b@data s"
    rows = verified.verification
    assert all(r.compute_from == "cost_analysis" for r in rows)
    first = next(r for r in rows if r.label == "replicated batch · params replicated")
    chosen = next(r for r in rows if r.chosen)
    assert first.predicted_time_s < chosen.predicted_time_s and chosen.compiled_time_s < first.compiled_time_s
    # The compiled compute is XLA's FLOPs per device on the profile, read from a direct compile of that layout.
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    for row, spec in ((first, P()), (chosen, P("data"))):
        xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        ws = {"w": jax.ShapeDtypeStruct((512,), jnp.float32, sharding=NamedSharding(mesh, P()))}
        cost = jax.jit(elementwise_heavy).lower(ws, xs).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        # plus what no FLOP count sees, priced as the prediction prices it: the one product's kernel and the
        # elements it writes per device (512 replicated, 64 split): the next test, on prices of its own
        elements = 512 if row is first else 64
        profile = verified.report.profile
        assert row.compiled_compute_s == pytest.approx(cost["flops"] / profile.flops + profile.small_op_time(elements))
    assert verified.to_dict()["verification"][0]["compiled"]["compute_from"] == "cost_analysis"


def test_the_compiled_compute_keeps_the_profiles_kernel_and_element_prices():
    """On a profile that prices what FLOPs do not (``op_overhead``, ``element_time``: ``cpu_profile(small_ops=True)``)
    the compiled compute is XLA's FLOPs on the profile plus those prices, as the prediction adds them to the walk's
    FLOPs (``scoring.unwalked_compute_s``): elementwise_heavy's one product, (512, 512) @ (512,), no backward, writes
    512 elements replicated, 64 with the batch split."""
    overhead, per_element = 2e-6, 3e-9
    profile = dataclasses.replace(PROFILES["cpu"], host_cores=8, op_overhead=overhead, element_time=per_element)
    w, x = {"w": jax.ShapeDtypeStruct((512,), jnp.float32)}, jax.ShapeDtypeStruct((512, 512), jnp.float32)
    verified = einshard.plan(
        elementwise_heavy, w, x, verify=3, mesh={"data": 8}, objective="inference", profile=profile
    )
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows = {r.label.split(" · ")[0]: r for r in verified.verification}
    for label, spec, elements in (("replicated batch", P(), 512), ("dp(data)", P("data"), 64)):
        xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))
        ws = {"w": jax.ShapeDtypeStruct((512,), jnp.float32, sharding=NamedSharding(mesh, P()))}
        cost = jax.jit(elementwise_heavy).lower(ws, xs).compile().cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        expected = cost["flops"] / profile.flops + overhead + elements * per_element
        assert rows[label].compiled_compute_s == pytest.approx(expected), rows[label]


def looped(p, x):
    return jnp.sum(jax.lax.fori_loop(0, 4, lambda i, y: jnp.tanh(y @ p["w"]), x))


def test_a_program_with_a_loop_keeps_the_predicted_compute():
    # XLA's cost analysis counts a while loop's body once, not per iteration: its FLOPs would undercount, so
    # every candidate's compute is the prediction's (one count for all).
    kw = dict(mesh={"data": 8}, objective="inference", profile=dataclasses.replace(PROFILES["cpu"], host_cores=8))
    w, x = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)}, jax.ShapeDtypeStruct((256, 64), jnp.float32)
    verified = einshard.plan(looped, w, x, verify=2, **kw)
    assert verified.verification
    for row in verified.verification:
        assert row.compute_from == "prediction" and row.compiled_compute_s == row.predicted_compute_s
