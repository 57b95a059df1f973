"""The planner's score from first principles, its mesh forms, its explanation, and its speed budget.

Expectations are derived by hand (FLOPs of an einsum = 2·∏ sizes; a device
computes a split einsum's share, a replicated one in full), never read back
from the planner's own output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType

import einshard
from einshard._src.analysis.cost import PROFILES, Profile, human_time
from einshard._src.planner.groups import Candidate, Group, search_candidates
from einshard.planner import LayoutPlan, parse_bytes, plan

f32 = jnp.float32


def sds(*shape, dtype=f32):
    return jax.ShapeDtypeStruct(shape, dtype)


def mlp_loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w0"]) @ p["w1"]) ** 2)


B, D, F = 8192, 512, 2048
PARAMS = {"w0": sds(D, F), "w1": sds(F, D)}
X = sds(B, D)
MESH = {"data": 4, "model": 2}
DP = ({".*": "x y -> x y"}, "b d -> b@(data,model) d")
REPLICATED = ({".*": "x y -> x y"}, "b d -> b d")


def test_public_names_import():
    assert einshard.plan is plan and einshard.LayoutPlan is LayoutPlan and parse_bytes("1KiB") == 1024


def test_replicated_work_is_counted_in_full():
    """A replicated batch computes the whole step on every device: 8x the FLOPs of 8-way data parallel."""
    step = jax.value_and_grad(mlp_loss)
    r = plan(step, PARAMS, X, mesh=MESH, profile="h100", presets={"dp8": DP, "replicated": REPLICATED})
    alts = {a.label: a for a in r.alternatives}
    # five matmuls of 2·B·D·F FLOPs: two forward, dW1, dH (the hidden's gradient) and dW0;
    # the batch itself needs no gradient
    full = 5 * 2 * B * D * F
    h100 = 989e12
    assert alts["preset replicated"].compute_s == pytest.approx(full / h100, rel=1e-6)
    assert alts["preset dp8"].compute_s == pytest.approx(full / 8 / h100, rel=1e-6)


def test_a_replicated_batch_never_beats_data_parallel_on_a_compute_bound_step():
    """Compute-bound (64k tokens of d=512 per step on H100): splitting the batch wins, whatever the budget."""
    step = jax.value_and_grad(mlp_loss)
    for budget in (None, "64MiB"):
        r = plan(step, PARAMS, X, mesh=MESH, profile="h100", memory_budget=budget, presets={"rep": REPLICATED})
        assert r.data_rules[0]["^$"] != "b s -> b s"
        rep = next(a for a in r.alternatives if a.label == "preset rep")
        assert r.time_s < rep.time_s
        # the chosen layout does at most data parallel's work per device: 1/8 of the step
        assert r.compute_s <= 5 * 2 * B * D * F / 8 / 989e12 * (1 + 1e-9)


def test_latency_bound_steps_may_replicate_and_the_why_says_so():
    """8 tokens: each device computing everything (µs) is cheaper than any collective (≥ 12 µs of latency)."""
    step = jax.value_and_grad(mlp_loss)
    r = plan(step, {"w0": sds(64, 64), "w1": sds(64, 64)}, sds(8, 64), mesh=MESH, profile="h100")
    if r.data_rules[0]["^$"] == "b s -> b s":
        assert r.comm_bytes == 0 and "the batch is not split" in r.explanation
    dp = next(a for a in r.alternatives if a.label == "preset dp")
    assert r.time_s <= dp.time_s


@pytest.mark.parametrize("how", ["dict", "mesh", "explicit", "set_mesh"])
def test_mesh_from_every_form_gives_the_same_plan(how):
    step = jax.value_and_grad(mlp_loss)
    params, x = {"w0": sds(256, 1024), "w1": sds(1024, 256)}, sds(512, 256)
    ref = plan(step, params, x, mesh=MESH, profile="h100")
    if how == "dict":
        got = plan(step, params, x, mesh=dict(MESH), profile="h100")
    elif how == "mesh":
        auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        got = plan(step, params, x, mesh=auto, profile="h100")
    elif how == "explicit":
        got = plan(step, params, x, mesh=jax.make_mesh((4, 2), ("data", "model")), profile="h100")
    else:
        with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"))):
            got = plan(step, params, x, profile="h100")
    assert got.rules == ref.rules and got.data_rules == ref.data_rules and got.time_s == ref.time_s


def test_no_mesh_anywhere_is_an_einshard_error():
    with pytest.raises(einshard.EinshardError, match="needs a mesh"):
        plan(jax.value_and_grad(mlp_loss), PARAMS, X, profile="h100")


def test_planned_rules_place_arrays_on_an_explicit_mesh():
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = {"w0": jnp.ones((256, 1024)), "w1": jnp.ones((1024, 256))}
    x = jnp.ones((512, 256))
    r = plan(jax.value_and_grad(mlp_loss), params, x, mesh=mesh, profile="h100")
    placed_p, placed_x = r.place(params, x, mesh=mesh)
    loss, _ = jax.jit(jax.value_and_grad(mlp_loss))(placed_p, placed_x)
    assert float(loss) == pytest.approx(float(mlp_loss(params, x)), rel=1e-5)


def test_search_candidates_keep_one_fsdp_placement_per_axis_set():
    """FSDP over 'data' on x or on y sends the same bytes (the weight is gathered whole): one is tried."""
    g = Group(
        "^w$", "w", ("x", "y"), ((256, 1024),), (0,), 0, False,
        (
            Candidate(((), ())),
            Candidate((("data",), ())),
            Candidate(((), ("data",))),
            Candidate(((), ("model",))),
            Candidate((("model",), ())),
            Candidate((("data",), ("model",))),
            Candidate((("data", "model"), ())),
        ),
    )  # fmt: skip
    keep = search_candidates(g, ("data",), {"data": 4, "model": 2})
    dims = [g.candidates[i].dims for i in keep]
    assert ((), ("data",)) in dims and (("data",), ()) not in dims  # FSDP on the larger axis only
    assert ((), ("model",)) in dims and (("model",), ()) in dims  # tensor parallel: both axes kept
    assert (("data", "model"), ()) not in dims  # one tensor axis never mixes batch and model axes
    assert (("data",), ("model",)) in dims  # FSDP x TP


def test_why_names_numbers_that_are_the_results():
    step = jax.value_and_grad(mlp_loss)
    r = plan(step, PARAMS, X, mesh=MESH, profile="h100")
    first = r.explanation.splitlines()[0]
    assert first.startswith("chosen: " + r.strategies["batch"])
    assert human_time(r.time_s) in r.explanation
    assert f"{r.report.comm_count} collectives" in r.explanation


@pytest.mark.parametrize(
    "batch, profile, budget",
    [(8, "h100", None), (8192, "h100", None), (8192, "h100", "40MiB"), (64, "cpu", None), (512, "tpu-v5p", None)],
)
def test_every_reason_in_the_why_is_true_of_the_numbers(batch, profile, budget):
    """Each sentence the explanation may print is checked against the result's own costs and rules."""
    step = jax.value_and_grad(mlp_loss)
    r = plan(step, PARAMS, sds(batch, D), mesh=MESH, profile=profile, memory_budget=budget)
    dp = next(a for a in r.alternatives if a.label == "preset dp")
    params_split = any("@" in e.split("->")[1] for e in r.rules.values())
    batch_rule = r.data_rules[0]["^$"]
    why = r.explanation
    if "sharding parameters communicates for less time" in why:
        assert params_split and r.time_s - r.compute_s < dp.time_s - dp.compute_s
    if "the batch is not split" in why:
        assert "(data,model)" not in batch_rule and r.compute_s > dp.compute_s and r.time_s <= dp.time_s
    if "data parallel does not fit" in why:
        assert not dp.fits and r.fits
    if "parameters stay replicated" in why:
        assert not params_split
    if "divides the compute further" in why:
        assert r.compute_s < dp.compute_s
    assert ("over budget" in why) == (not dp.fits or not r.alternatives[0].fits)


_P = jax.sharding.PartitionSpec


@pytest.mark.parametrize(
    "w0, w1, data",
    [
        (_P(), _P(), _P(("data", "model"))),  # data parallel: the gradients are pending sums at the end
        (_P("data"), _P(None, "data"), _P("data")),  # FSDP: gradients brought to their parameters' split
        (_P(None, "model"), _P("model"), _P("data")),  # Megatron
    ],
)
def test_the_planners_walk_is_explains_walk(w0, w1, data):
    """The planner scores with ``TracedProgram.report(walker=DependencyWalker)``: the report is explain's own,
    field by field; the dependency walker only adds which collectives XLA may merge."""
    from einshard._src.analysis.program import trace
    from einshard._src.planner.combining import DependencyWalker, combined_report
    from einshard.errors import EinshardError

    traced = trace(jax.value_and_grad(mlp_loss), {"w0": sds(64, 256), "w1": sds(256, 64)}, sds(256, 64), mesh=MESH)
    in_specs, out_specs = ({"w0": w0, "w1": w1}, data), [None, w0, w1]  # (loss, grads like the parameters)
    plain = traced.report(in_specs, out_specs)
    walked, combined = combined_report(traced, in_specs, out_specs)
    for field in ("flops", "comm_bytes", "comm_count", "peak_bytes", "time_s", "phases", "unfollowed"):
        assert getattr(walked, field) == getattr(plain, field), field
    assert [(o.primitive, o.expression, o.collectives) for o in walked.ops] == [
        (o.primitive, o.expression, o.collectives) for o in plain.ops
    ]
    assert plain.comm_count > 0 and 0 < combined.ops <= plain.comm_count and combined.saved_s >= 0.0
    used = DependencyWalker(traced.costs)
    traced.report(in_specs, out_specs, walker=used)
    with pytest.raises(EinshardError, match="fresh walker"):
        traced.report(in_specs, out_specs, walker=used)


def test_float_noise_in_a_sum_does_not_decide_between_layouts():
    """Found on the Equinox model: FSDP beat plain DP by 3e-20 s (the same costs summed in another order).
    Costs equal to 9 significant digits are a tie, and the layout that splits fewer parameters wins it."""
    from einshard._src.planner.scoring import Score

    def score(time_s: float, sharded: int) -> Score:
        return Score(True, time_s, time_s, time_s, 1000, 10.0, sharded, report=None)  # type: ignore[arg-type]

    fsdp, dp = score(0.0008965075800000003, 4), score(0.0008965075800000006, 0)
    assert min([fsdp, dp], key=lambda s: s.key) is dp
    assert min([score(0.00089, 4), score(0.00090, 0)], key=lambda s: s.key).sharded == 4  # a real difference


def test_two_tensor_axes_each_over_a_batch_axis_are_tried_first_for_the_memory_objective_only():
    """Under a batch over (data, model), ``x@data y@model`` peaks lower than FSDP on one tensor axis (it is never
    gathered whole at once) but sends the same bytes: the memory objective tries it first, step time in the
    polish round (tried first it cost a memory-bound descent the evaluations that made its plan: docs/planner.md)."""
    g = Group(
        "^w$", "w", ("x", "y"), ((256, 1024),), (0,), 0, False,
        (
            Candidate(((), ())),
            Candidate(((), ("data", "model"))),
            Candidate((("data",), ("model",))),
            Candidate((("model",), ("data",))),
        ),
    )  # fmt: skip
    sizes = {"data": 4, "model": 2}
    for_time = [g.candidates[i].dims for i in search_candidates(g, ("data", "model"), sizes)]
    for_memory = [g.candidates[i].dims for i in search_candidates(g, ("data", "model"), sizes, for_memory=True)]
    assert for_time == [((), ()), ((), ("data", "model"))]
    assert for_memory == [((), ()), ((), ("data", "model")), (("data",), ("model",)), (("model",), ("data",))]


# --- the compute the walk's FLOPs leave out (Profile.op_overhead, Profile.element_time) ------------------------


def test_each_product_pays_its_kernel_and_the_elementwise_work_on_the_activations_it_writes():
    """Per dot, ``op_overhead``; per element a forward dot writes on the device, ``element_time`` twice (the forward's
    elementwise work on it and the backward's on its cotangent), derived by hand for the MLP's five products: forward
    x@w0 (B, F) and h@w1 (B, D) priced; backward dW1 (F, D), dH (B, F), dW0 (D, F) pay their kernel only (dH is the
    cotangent already counted, and a weight gradient is followed by no elementwise work)."""
    b, d, f = 64, 32, 48
    params, x = {"w0": sds(d, f), "w1": sds(f, d)}, sds(b, d)
    overhead, per_element = 1e-6, 1e-9
    # FLOPs priced at ~nothing, so compute_s is the new part alone
    profile = Profile("t", flops=1e30, bandwidth=1e10, latency=0.0, op_overhead=overhead, element_time=per_element)
    r = plan(
        jax.value_and_grad(mlp_loss), params, x, mesh=MESH, profile=profile, presets={"dp8": DP, "rep": REPLICATED}
    )
    alts = {a.label: a for a in r.alternatives}
    for label, rows in (("preset rep", b), ("preset dp8", b // 8)):
        elements = 2 * (rows * f + rows * d)
        assert alts[label].compute_s == pytest.approx(5 * overhead + elements * per_element, rel=1e-6)
    # without a backward (the loss alone) each forward result is counted once
    fwd = plan(mlp_loss, params, x, mesh=MESH, profile=profile, presets={"rep": REPLICATED})
    rep = next(a for a in fwd.alternatives if a.label == "preset rep")
    assert rep.compute_s == pytest.approx(2 * overhead + (b * f + b * d) * per_element, rel=1e-6)


def test_under_small_ops_a_weight_gradient_leaves_the_element_price_alone():
    """``cpu_profile(small_ops=True)`` on the MLP: the data-parallel layout leaves each (D, F) weight gradient whole on
    every device, the replicated one computes everything everywhere; their unwalked compute differs by the forward
    activations' elements alone (the kernels' cost is the same five).  Before, every product's result was priced,
    weight gradients included, which on the large planning sizes (tests/test_plan_hand_presets.py) made the plan a
    mirrored hybrid sending 1.4-1.6x a hand layout's XLA bytes to leave those gradients split; on XLA:CPU a product's
    result elements cost nothing measurable beyond its FLOPs (benchmarks/cpu_calibration.py --dots)."""
    import dataclasses

    from einshard._src.analysis.cost import cpu_profile

    small = cpu_profile(2, small_ops=True)
    shared = small.on_devices(8)  # 8 devices on 2 cores: each price 4x a core's
    profile = dataclasses.replace(small, flops=1e30)
    b, d, f = 64, 32, 48
    params, x = {"w0": sds(d, f), "w1": sds(f, d)}, sds(b, d)
    r = plan(
        jax.value_and_grad(mlp_loss), params, x, mesh=MESH, profile=profile, presets={"dp8": DP, "rep": REPLICATED}
    )
    alts = {a.label: a for a in r.alternatives}
    for label, rows in (("preset rep", b), ("preset dp8", b // 8)):
        expected = 5 * shared.op_overhead + 2 * (rows * f + rows * d) * shared.element_time
        assert alts[label].compute_s == pytest.approx(expected, rel=1e-6)


def test_profiles_without_the_small_op_prices_score_flops_only():
    """GPU and TPU profiles price neither (their FLOP/s stand for a step's): compute is the FLOPs over the rate."""
    step = jax.value_and_grad(mlp_loss)
    for name in ("h100", "tpu-v5p"):
        assert PROFILES[name].op_overhead == 0 and PROFILES[name].element_time == 0
        r = plan(step, PARAMS, X, mesh=MESH, profile=name, presets={"dp8": DP})
        dp8 = next(a for a in r.alternatives if a.label == "preset dp8")
        assert dp8.compute_s == pytest.approx(5 * 2 * B * D * F / 8 / r.report.profile.flops, rel=1e-6)


def test_the_small_op_price_reads_a_replayed_copys_ops_as_its_walk_made_them():
    """The score reads the ops' cost fields without making a replayed stretch's ops (OpLog.cost_ops): the same
    fields, op for op, as the ops made (a replay changes an op's index, words and equation, not its cost)."""
    from test_segment_memo import _specs, _traced  # a six-layer decoder whose copies replay

    from einshard._src.analysis.program.oplog import OpLog, ReplayRun
    from einshard._src.planner.combining import combined_report
    from einshard._src.planner.scoring import unwalked_compute_s

    t = _traced(6, "remat", "auto")
    specs = _specs(1, 1, 1)
    combined_report(t, specs, None)  # the planner's costing: the first records the stretches, the second replays
    report, _ = combined_report(t, specs, None)
    ops = report.ops
    assert isinstance(ops, OpLog) and any(isinstance(c, ReplayRun) for c in ops._chunks)
    fields = [(op.flops, op.repeat, op.out_layout) for op in ops.cost_ops()]
    priced = unwalked_compute_s(dataclass_replace_profile(report))
    assert fields == [(op.flops, op.repeat, op.out_layout) for op in ops]  # iterating makes the runs' ops
    assert unwalked_compute_s(dataclass_replace_profile(report)) == pytest.approx(priced)


def dataclass_replace_profile(report):
    """``report`` on a profile that prices the small ops (the traced program's is the default cpu one)."""
    import dataclasses

    return dataclasses.replace(report, profile=Profile("t", flops=1e11, bandwidth=1e10, latency=0.0, element_time=1e-9))


# -- near-ties in time: settled by bytes, FLOPs, memory (scoring.NEAR_TIE) -------------------------------------------


def _tie_score(fits: bool, time_s: float, comm: float, flops: float, memory: int):
    from types import SimpleNamespace

    from einshard._src.planner.scoring import Score

    report = SimpleNamespace(flops=flops)  # the ranking reads only the FLOPs of the report
    return Score(fits, time_s, time_s, time_s, memory, comm, 0, report=report)  # type: ignore[arg-type]


_drawn_scores = st.lists(
    st.tuples(
        st.booleans(),
        st.sampled_from([1.0, 1.002, 1.005, 1.0099, 1.0101, 1.05, 1.2]),  # near-ties, the band's edge, real gaps
        st.sampled_from([0.0, 1e6, 2e6, 3e6]),
        st.sampled_from([1e9, 2e9]),
        st.sampled_from([100, 200]),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(_drawn_scores)
def test_near_ties_in_time_are_ranked_by_bytes_then_flops_then_memory(drawn):
    """Drawn scores, many within 1% of the best time: the first is the fewest bytes (then FLOPs, split parameters, memory) of those
    within NEAR_TIE of the best, never a layout slower than that; outside the band the key's order stands."""
    from einshard._src.planner.scoring import NEAR_TIE, near_ties_first

    scores = {(i,): _tie_score(*d) for i, d in enumerate(drawn)}
    ranked = sorted(scores, key=lambda a: scores[a].key)
    out = near_ties_first(ranked, scores.__getitem__, "training")
    assert sorted(out) == sorted(ranked)
    best = scores[ranked[0]]
    if not best.fits:
        assert out == ranked  # over the budget: the memory decides, as the key says
        return
    band = [a for a in ranked if scores[a].fits and scores[a].time_s <= best.time_s * (1 + NEAR_TIE)]
    certain = lambda a: (scores[a].comm, scores[a].report.flops, scores[a].sharded, scores[a].memory)  # noqa: E731
    assert out[: len(band)] == sorted(band, key=certain)  # stable: the key's order among equal ones
    assert out[len(band) :] == [a for a in ranked if a not in band]
    first = scores[out[0]]
    assert first.time_s <= best.time_s * (1 + NEAR_TIE)  # a tie is never bought with a priced gap beyond the band
    # the other objectives rank by their own measure, and a band of zero width is the key's order
    assert near_ties_first(ranked, scores.__getitem__, "memory") == ranked
    if all(scores[a].time_s > best.time_s for a in ranked[1:]):  # no exact tie: a band of zero width is the key's
        assert near_ties_first(ranked, scores.__getitem__, "training", tolerance=0.0) == ranked


def test_a_near_tie_in_time_goes_to_the_layout_sending_fewer_bytes():
    """hk_stack under a memory budget (small_ops, session 18): the search's best was priced 282.51 ms sending
    32.07 MB, the dp_tp layout 282.73 ms sending 24.18 MB at its FLOPs -- 0.08% apart, one time to the model."""
    from einshard._src.planner.scoring import near_ties_first

    plan_s = _tie_score(True, 0.28251, 32.07e6, 5e12, 900)
    dp_tp = _tie_score(True, 0.28273, 24.18e6, 5e12, 950)
    slower = _tie_score(True, 0.29, 0.0, 5e12, 100)  # 2.6% slower: a real difference, however few its bytes
    scores = {(0,): plan_s, (1,): dp_tp, (2,): slower}
    ranked = sorted(scores, key=lambda a: scores[a].key)
    assert ranked == [(0,), (1,), (2,)]
    assert near_ties_first(ranked, scores.__getitem__, "training") == [(1,), (0,), (2,)]
    assert near_ties_first(ranked, scores.__getitem__, "inference")[0] == (1,)
    assert near_ties_first(ranked, scores.__getitem__, "memory") == ranked  # memory is its own measure
    # over the budget: ranked last, however near its time
    over = {**scores, (0,): _tie_score(False, 0.28251, 32.07e6, 5e12, 900)}
    assert near_ties_first(sorted(over, key=lambda a: over[a].key), over.__getitem__, "training")[-1] == (0,)
