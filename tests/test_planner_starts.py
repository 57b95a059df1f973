"""The descent's standard starts: Megatron pairs read from the program, and the dp×tp / fsdp×tp layouts built on them.

``roles.megatron_pairs`` follows each weight's matmul output forward to the next weight's matmul: a weight fed by a
column-parallel one is row-parallel.  ``search.tensor_parallel_starts`` turns that into one dp×tp and one fsdp×tp
assignment per batch layout.  Under a memory budget that replicated parameters exceed, the default search must reach
them (before, its 160 evaluations went to the batch layout that frees the most memory and stopped there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from planner_models import eqx_transformer, mlp_step, nnx_transformer

import einshard
from einshard import planner as pl
from einshard._src.analysis.program import trace
from einshard._src.core.layout import MeshAxis
from einshard._src.planner.groups import Group, batch_candidates, param_candidates, param_groups
from einshard._src.planner.roles import megatron_pairs, weight_roles
from einshard._src.planner.search import tensor_parallel_starts

MESH = (MeshAxis("data", 4), MeshAxis("model", 2))
SIZES = {"data": 4, "model": 2}
f32 = jnp.float32


def sds(*shape):
    return jax.ShapeDtypeStruct(shape, f32)


def pairs_by_name(step, params, batch):
    """{group display: 'col' | 'row'} of a step, as plan() reads it."""
    traced = trace(step, params, batch, mesh=SIZES)
    groups, _ = param_groups(params, MESH)
    kinds = megatron_pairs(traced.jaxpr, {leaf: k for k, g in enumerate(groups) for leaf in g.leaves})
    return {g.display: kinds[k] for k, g in enumerate(groups) if k in kinds}


def test_an_mlp_is_column_then_row_whatever_the_weights_axis_order():
    """(in, out) weights and (out, in) weights (Equinox's) alike: the pair alternates along the data flow."""

    def loss(p, x):
        h = jnp.tanh(x @ p["up"])  # (in, out)
        h = jnp.tanh(jnp.einsum("bf,df->bd", h, p["down"]))  # (out, in)
        return jnp.mean((h @ p["up2"] @ p["down2"]) ** 2)

    params = {"up": sds(64, 256), "down": sds(64, 256), "up2": sds(64, 256), "down2": sds(256, 64)}
    kinds = pairs_by_name(jax.value_and_grad(loss), params, sds(128, 64))
    assert kinds == {"['up']": "col", "['down']": "row", "['up2']": "col", "['down2']": "row"}


def test_a_weight_fed_by_two_column_parallel_ones_is_row_parallel():
    """A gated MLP (gate and up both column-parallel, down row-parallel) after attention-like q/k/v."""

    def loss(p, x):
        q, k, v = (jnp.einsum("bsd,dhe->bshe", x, p[n]) for n in ("q", "k", "v"))
        a = jax.nn.softmax(jnp.einsum("bshe,bthe->bhst", q, k), axis=-1)
        o = jnp.einsum("bhst,bthe->bshe", a, v)
        x = x + jnp.einsum("bshe,hed->bsd", o, p["o"])
        h = jax.nn.silu(x @ p["gate"]) * (x @ p["up"])
        return jnp.mean((x + h @ p["down"]) ** 2)

    params = {
        **{n: sds(32, 4, 8) for n in ("q", "k", "v")},
        "o": sds(4, 8, 32),
        "gate": sds(32, 128),
        "up": sds(32, 128),
        "down": sds(128, 32),
    }
    kinds = pairs_by_name(jax.value_and_grad(loss), params, sds(16, 8, 32))
    assert kinds == {
        "['q']": "col",
        "['k']": "col",
        "['v']": "col",
        "['o']": "row",
        "['gate']": "col",
        "['up']": "col",
        "['down']": "row",
    }


def test_pairs_are_read_inside_a_scan_over_stacked_layers():
    def loss(p, x):
        def layer(h, w):
            return h + jnp.tanh(h @ w["up"]) @ w["down"], None

        h, _ = jax.lax.scan(layer, x, p["layers"])
        return jnp.mean(h**2)

    params = {"layers": {"up": sds(3, 32, 128), "down": sds(3, 128, 32)}}
    kinds = pairs_by_name(jax.value_and_grad(loss), params, sds(16, 32))
    assert kinds == {"['layers']['up']": "col", "['layers']['down']": "row"}


@pytest.mark.parametrize("model", [nnx_transformer, eqx_transformer])
def test_library_transformers_pair_as_their_megatron_presets(model):
    """Flax NNX (3-D attention kernels) and Equinox ((out, in) weights under vmap): the columns and rows are those
    of the hand-written Megatron preset in tests/planner_models.py."""
    step, params, tokens, _ = model(batch=8)
    kinds = pairs_by_name(step, params, tokens)
    col = [k for k, v in kinds.items() if v == "col"]
    row = [k for k, v in kinds.items() if v == "row"]
    assert col and row
    for name in col:
        assert any(s in name for s in ("query", "key", "value", "up", "head")), kinds
    for name in row:
        assert any(s in name for s in ("out", "down")), kinds


def _groups(params):
    groups, _ = param_groups(params, MESH)
    return [
        Group(g.pattern, g.display, g.names, g.shapes, g.leaves, g.nbytes, g.stacked, param_candidates(g, MESH, False))
        for g in groups
    ]


def test_the_starts_are_dp_tp_and_fsdp_tp_for_each_batch_layout():
    """Column-parallel w0 split on the axis its matmul keeps, row-parallel w1 on the one it contracts, over the mesh
    axes the batch leaves free; the fsdp×tp variant adds the batch's axes on the other tensor axis."""
    params = {"w0": sds(64, 256), "w1": sds(256, 64)}
    traced = trace(mlp_step(2), params, sds(128, 64), mesh=SIZES)
    groups = _groups(params)
    batch = Group("", "batch", (), ((128, 64),), (), 0, False, batch_candidates([(128, 64)], MESH), True)
    kinds = megatron_pairs(traced.jaxpr, {0: 0, 1: 1})
    roles = [weight_roles(traced.jaxpr, g.leaves[0]) for g in groups]
    starts = tensor_parallel_starts(groups, batch, kinds, roles, SIZES)

    def dims(assign):
        return tuple(g.candidates[c].dims for g, c in zip(groups, assign)), batch.candidates[assign[-1]].dims

    got = {dims(a) for a in starts}
    dm = ("data", "model")
    assert ((((), ("model",)), (("model",), ())), (("data",), ())) in got  # dp×tp: Megatron over model
    assert (((("data",), ("model",)), (("model",), ("data",))), (("data",), ())) in got  # fsdp×tp
    assert ((((), ("data",)), (("data",), ())), (("model",), ())) in got  # the mirror: Megatron over data
    assert ((((), dm), (dm, ())), ((), ())) in got  # pure tp, the batch replicated
    # no start splits the batch over every axis (nothing is left for tensor parallelism) or the sequence
    assert all(dims(a)[1] != (dm, ()) and not dims(a)[1][1] for a in starts)
    assert len(starts) == len(set(starts))


def _loss_stack(p, x):
    def layer(h, w):
        q, k, v = (jnp.einsum("bsd,dhe->bshe", h, w[n]) for n in ("q", "k", "v"))
        a = jax.nn.softmax(jnp.einsum("bshe,bthe->bhst", q, k), axis=-1)
        h = h + jnp.einsum("bshe,hed->bsd", jnp.einsum("bhst,bthe->bshe", a, v), w["o"])
        return h + jax.nn.gelu(h @ w["up"]) @ w["down"], None

    h, _ = jax.lax.scan(layer, x, p["layers"])
    return jnp.mean(h**2)


STACK = {
    "layers": {
        **{n: sds(4, 256, 8, 32) for n in ("q", "k", "v")},
        "o": sds(4, 8, 32, 256),
        "up": sds(4, 256, 1024),
        "down": sds(4, 1024, 256),
    }
}
STACK_BATCH = sds(32, 16, 256)
MEGATRON = (
    {
        r"\['(q|k|v)'\]": "l d h e -> l d h@model e",
        r"\['o'\]": "l h e d -> l h@model e d",
        r"\['up'\]": "l d f -> l d f@model",
        r"\['down'\]": "l f d -> l f@model d",
    },
    ["b s d -> b@data s d"],
)


def test_under_a_memory_budget_the_default_search_is_no_slower_than_megatron_by_its_model():
    """A scanned transformer stack, a budget halfway between the fsdp and dp presets (replicated parameters do not
    fit): the plan at the default search options is at least as fast, by the cost model, as the dp×tp hand layout,
    which fits, and as the fastest fitting built-in preset.  Before the Megatron starts the default search returned
    FSDP and pipeline splits with the batch over (data, model), 19% slower by the same model."""
    step = jax.value_and_grad(_loss_stack)
    common = dict(mesh=SIZES, profile="cpu")
    starts = einshard.plan(
        step, STACK, STACK_BATCH, search=pl.SearchOptions(exhaustive_limit=0, max_evaluations=1), **common
    )
    memory = {a.label: a.memory_bytes for a in starts.alternatives}
    budget = (memory["preset dp"] + memory["preset fsdp"]) // 2
    plan = einshard.plan(step, STACK, STACK_BATCH, memory_budget=budget, **common)
    assert plan.method == "coordinate descent" and plan.evaluated <= pl.SearchOptions().max_evaluations
    assert plan.fits
    only_starts = pl.SearchOptions(exhaustive_limit=0, max_evaluations=1)  # the presets are priced all the same
    priced = einshard.plan(
        step, STACK, STACK_BATCH, memory_budget=budget, presets={"megatron": MEGATRON}, search=only_starts, **common
    )
    hand = next(a for a in priced.alternatives if a.label == "preset megatron")
    assert hand.fits, "the budget should leave the hand layout room"
    assert plan.time_s <= hand.time_s * (1 + 1e-9), (plan.strategies, plan.time_s, hand.time_s)
    fitting = [a.time_s for a in plan.alternatives if a.label.startswith("preset ") and a.fits]
    assert plan.time_s <= min(fitting) * (1 + 1e-9)


def _costing_order(monkeypatch, memory_budget):
    """(the assignments in the order the search costs them, the Megatron starts it was given)."""
    from einshard._src.planner import core, scoring

    order: list[tuple[int, ...]] = []
    given: list[list[tuple[int, ...]]] = []
    score, starts = scoring.Costs.score, core.tensor_parallel_starts

    def spy_score(self, assign):
        if assign not in self.cache:
            order.append(assign)
        return score(self, assign)

    def spy_starts(*args):
        given.append(starts(*args))
        return given[-1]

    monkeypatch.setattr(scoring.Costs, "score", spy_score)
    monkeypatch.setattr(core, "tensor_parallel_starts", spy_starts)
    params = {"w0": sds(64, 256), "w1": sds(256, 64)}
    search = pl.SearchOptions(exhaustive_limit=0, max_evaluations=40)
    plan = einshard.plan(
        mlp_step(2), params, sds(128, 64), mesh=SIZES, profile="cpu", memory_budget=memory_budget, search=search
    )
    assert plan.method == "coordinate descent"
    return order, given[0], plan


@pytest.mark.parametrize("budget", [None, 0.9])
def test_the_megatron_starts_are_costed_right_after_the_presets(monkeypatch, budget):
    """Without a budget, and under one that no preset meets (0.9 of fsdp's memory), the dp×tp / fsdp×tp starts are
    costed right after the presets, before the replicated batch layouts and any descent move."""
    if budget is not None:
        _, _, free = _costing_order(monkeypatch, None)
        budget = int(next(a for a in free.alternatives if a.label == "preset fsdp").memory_bytes * budget)
    order, megatron, plan = _costing_order(monkeypatch, budget)
    assert megatron and set(megatron) <= set(order[: 2 + len(megatron)])  # the dp and fsdp presets, then these
    assert plan.evaluated <= 40


def test_roles_are_read_through_an_unrolled_loops_slice_of_a_stacked_weight():
    """``w[i]`` of a stacked (layers, in, out) weight in a Python loop (a slice and a squeeze, not a scan): the roles
    stop at the slice, so the dp×tp start leaves every layer weight replicated."""

    def loss(p, x):
        for i in range(3):
            x = x + jnp.tanh(x @ p["layers"]["up"][i]) @ p["layers"]["down"][i]
        return jnp.mean(x**2)

    params = {"layers": {"down": sds(3, 128, 32), "up": sds(3, 32, 128)}}
    traced = trace(jax.value_and_grad(loss), params, sds(16, 32), mesh=SIZES)
    groups = _groups(params)
    roles = [weight_roles(traced.jaxpr, g.leaves[0]) for g in groups]
    assert roles == [{1: "in", 2: "out"}, {1: "in", 2: "out"}]  # down, up: axis 0 (the layer) is sliced away
    kinds = megatron_pairs(traced.jaxpr, {leaf: k for k, g in enumerate(groups) for leaf in g.leaves})
    assert kinds == {0: "row", 1: "col"}
    batch = Group("", "batch", (), ((16, 32),), (), 0, False, batch_candidates([(16, 32)], MESH), True)
    starts = tensor_parallel_starts(groups, batch, kinds, roles, SIZES)
    over_data = next(a for a in starts if batch.candidates[a[-1]].dims == (("data",), ()))
    dims = [g.candidates[c].dims for g, c in zip(groups, over_data)]
    assert dims == [((), ("model",), ()), ((), (), ("model",))]  # down row-parallel on f, up column-parallel on f


@pytest.mark.parametrize(
    "view, roles",
    [
        (lambda w: w[:16], {0: "in", 1: "out"}),  # a prefix of the rows: lax.slice
        (lambda w: w[:, 8:24], {0: "in", 1: "out"}),
        (lambda w: jax.lax.dynamic_slice(w, (0, 4), (32, 16)), {0: "in", 1: "out"}),
        (lambda w: w[None].astype(jnp.bfloat16)[0], {0: "in", 1: "out"}),  # a unit axis added, cast, dropped
        (lambda w: w.reshape(32, 1, 32).reshape(32, 32).T, {0: "out", 1: "in"}),  # a unit reshape, transposed
        (lambda w: w.reshape(32, 2, 16).sum(1), {}),  # a split axis (no longer one axis of w) stops the roles
    ],
    ids=["slice-rows", "slice-cols", "dynamic_slice", "unit-axis", "unit-reshape-transposed", "split-axis"],
)
def test_roles_follow_slices_and_unit_reshapes_of_a_weight(view, roles):
    """``weight_roles`` follows the weight through slices (keeping its axes), squeezes and reshapes that only add
    or drop unit axes to its first matmul; a reshape that merges or splits axes ends the trail."""

    def loss(p, x):
        w = view(p["w"])
        return jnp.sum(x[:, : w.shape[0]].astype(w.dtype) @ w)

    traced = trace(jax.value_and_grad(loss), {"w": sds(32, 32)}, sds(8, 32), mesh=SIZES)
    assert weight_roles(traced.jaxpr, 0) == roles
