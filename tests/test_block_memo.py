"""Identical blocks are costed once (einshard.analysis.program.blocks): walks counted, never timed.

A model of 2L identical blocks walks no more call bodies than one of L, and
steps only the program's own extra equations; a scanned stack walks the same
whatever its length; and the memo never changes a result: reports and the
planner's combined collectives are equal with and without it, over layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard
from einshard._src.analysis.program import trace
from einshard._src.planner.combining import combined_report
from einshard.planner import SearchOptions

MESH = {"data": 4, "model": 2}
D, F, B = 16, 32, 8


def _block(x, w):
    h = jax.nn.silu(jnp.einsum("bd,df->bf", x, w["up"]))  # a jitted function: a call nested in the block
    return x + jnp.einsum("bf,fd->bd", h, w["down"])


def decoder(layers: int, how: str):
    """``value_and_grad`` of a loss over ``layers`` blocks, and its shapes.

    ``how``: 'remat' (unrolled, ``jax.checkpoint``: the backward is one remat call per layer, one shared
    body), 'jit' (unrolled, one ``jax.jit`` per layer traced anew: bodies of one structure, distinct
    objects; at the program's top level explain inlines them, as XLA does: :mod:`.inline`), 'jit_in_remat'
    (those jits inside one ``jax.checkpoint`` of the whole stack: calls walked as blocks), 'scan' (``lax.scan``
    over the stack).
    """

    def stack(params, x):
        for i in range(layers):
            step = jax.checkpoint(_block) if how == "remat" else jax.jit(lambda c, w: _block(c, w))
            x = step(x, jax.tree.map(lambda a, i=i: a[i], params))
        return x

    def loss(params, x):
        if how == "scan":
            x, _ = jax.lax.scan(lambda c, w: (jax.checkpoint(_block)(c, w), None), x, params)
        elif how == "jit_in_remat":
            x = jax.checkpoint(stack)(params, x)
        else:
            x = stack(params, x)
        return jnp.mean(x**2)

    params = {
        "up": jax.ShapeDtypeStruct((layers, D, F), jnp.float32),
        "down": jax.ShapeDtypeStruct((layers, F, D), jnp.float32),
    }
    return jax.value_and_grad(loss), params, jax.ShapeDtypeStruct((B, D), jnp.float32)


# Layouts of the stacked weights and the batch, as the planner proposes them.
UP = ["l d f -> l d f", "l d f -> l d f@model", "l d f -> l d@data f", "l d f -> l d@model f@data"]
DOWN = ["l f d -> l f d", "l f d -> l f@model d", "l f d -> l f d@data", "l f d -> l f@(data,model) d"]
BATCH = ["b d -> b d", "b d -> b@data d", "b d -> b@(data,model) d", "b d -> b d@model"]


def _specs(up: int, down: int, batch: int):
    return ({"up": UP[up], "down": DOWN[down]}, BATCH[batch])


def _walks(layers: int, how: str, layouts: list[tuple[int, int, int]]) -> tuple[int, int, int]:
    fn, params, x = decoder(layers, how)
    t = trace(fn, params, x, mesh=MESH)
    for up, down, batch in layouts:
        combined_report(t, _specs(up, down, batch))
    c = t.costs.counts
    return c.walks, c.equations, len(t.jaxpr.eqns)


LAYOUTS = [(0, 0, 1), (1, 1, 0), (2, 2, 2), (1, 3, 1), (0, 0, 1)]


@pytest.mark.parametrize("how", ["remat", "jit"])
@pytest.mark.parametrize("layers", [3, 4])  # the first, middle and last blocks may each meet own layouts
def test_twice_the_blocks_walk_no_more_bodies(how, layers):
    walks, visits, top = _walks(layers, how, LAYOUTS)
    walks2, visits2, top2 = _walks(2 * layers, how, LAYOUTS)
    assert walks2 <= walks
    # The only extra equations stepped are the program's own (slicing each layer's weights, summing its
    # gradients into the stack, calling it; fewer where its repeated stretches replay): no block's body is
    # stepped again.
    assert visits2 - visits <= len(LAYOUTS) * (top2 - top)


# Layouts under which no dot leaves a partial sum in the forward (data parallel, FSDP-like): the look-ahead of
# sharding propagation (rules_indexing.consumer_split) is not asked, and each layer's walk stays closed.
CLOSED = [(0, 0, 1), (2, 2, 2), (0, 0, 1)]


@pytest.mark.parametrize("layouts", [CLOSED, LAYOUTS[2:3]])
def test_twice_the_unrolled_layers_step_no_more_equations(layouts):
    """The inlined forward's layers and the backward's glue between the remat calls (each layer's cotangent
    padded into the stack at its row and summed) are repeated stretches, replayed: 2L layers step only the
    program's own glue more than L, per costing, never three more layers' worth."""
    _, visits, _ = _walks(3, "remat", layouts)
    _, visits2, _ = _walks(6, "remat", layouts)
    assert visits2 <= visits + 8 * len(layouts)


def test_twice_the_unrolled_layers_step_no_more_equations_under_tensor_parallel_layouts():
    """Under tensor-parallel layouts a layer's down projection leaves a partial sum, and the look-ahead of sharding
    propagation (rules_indexing.consumer_split) follows it along the residual stream through every later layer,
    past the copy's horizon: the rest of that search reads nothing of the copy, so its answer is kept with the
    tape and a copy replays it where its own answer agrees (segment_memo.past_copy): 2L layers step no more than
    L and a constant."""
    _, visits, _ = _walks(3, "remat", LAYOUTS)
    _, visits2, _ = _walks(6, "remat", LAYOUTS)
    assert visits2 <= visits + 8 * len(LAYOUTS)


def _visited(monkeypatch, layers: int) -> list[tuple[object, object]]:
    """The layouts (arguments', outputs') the planner costs on the ``layers``-layer decoder, in its order."""
    from einshard._src.planner import scoring

    seen: list[tuple[object, object]] = []
    original = scoring.combined_report

    def spy(traced, in_specs, out_specs=None):
        seen.append((in_specs, out_specs))
        return original(traced, in_specs, out_specs)

    monkeypatch.setattr(scoring, "combined_report", spy)
    fn, params, x = decoder(layers, "remat")
    einshard.plan(fn, params, x, mesh=MESH, search=SearchOptions(max_evaluations=24))
    monkeypatch.undo()
    return seen


def _steps(traced, layouts: list[tuple[object, object]]) -> int:
    """The equations the costings of ``layouts`` step on ``traced`` (its earlier costings' tapes kept)."""
    before = traced.costs.counts.equations
    for in_specs, out_specs in layouts:
        combined_report(traced, in_specs, out_specs)
    return traced.costs.counts.equations - before


# L and 2L: from six layers on the layers whose entering layouts settle (the first ones) and those whose look-ahead
# reaches the loss (the last ones) are a part of L (measured: 4 -> 8 layers step ~21 more equations per costing,
# 8 -> 16 none).
DEPTHS = (6, 12)


def test_under_the_planners_layouts_twice_the_layers_step_at_most_a_constant_more(monkeypatch):
    """Every layout the planner costs (tensor-parallel ones among them), on L and 2L unrolled layers: 2L layers
    step no more equations than L and a constant per costing, never a walk per layer."""
    visited = _visited(monkeypatch, DEPTHS[0])
    assert len(visited) >= 8
    short, deep = (trace(*decoder(n, "remat"), mesh=MESH) for n in DEPTHS)
    assert _steps(deep, visited) <= _steps(short, visited) + 8 * len(visited)


_DECODERS: dict[int, object] = {}


def _decoder(layers: int):
    if layers not in _DECODERS:
        _DECODERS[layers] = trace(*decoder(layers, "remat"), mesh=MESH)
    return _DECODERS[layers]


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=3))
def test_twice_the_layers_step_at_most_a_constant_more_under_any_layouts(layouts):
    """The same over random layouts of the stacked weights and the batch (each costed on programs that have
    costed the earlier examples': their tapes kept, as in a planner's search)."""
    specs = [(_specs(*lay), None) for lay in layouts]
    assert _steps(_decoder(DEPTHS[1]), specs) <= _steps(_decoder(DEPTHS[0]), specs) + 8 * len(specs)


def test_a_scanned_stack_walks_the_same_whatever_its_length():
    assert _walks(2, "scan", LAYOUTS)[:2] == _walks(16, "scan", LAYOUTS)[:2]


def test_each_distinct_body_and_layouts_is_walked_once():
    fn, params, x = decoder(6, "remat")
    t = trace(fn, params, x, mesh=MESH)
    combined_report(t, _specs(1, 1, 1))
    first, segments = t.costs.counts.snapshot(), t.costs.counts.segment_replays
    combined_report(t, _specs(1, 1, 1))  # the same layouts again: every body replayed, none walked
    walks, _, replays, recorded = t.costs.counts.snapshot()
    assert recorded == first[3] and walks == first[0] + 1
    # Each remat call is replayed, alone or in a repeated stretch of the backward's glue replayed whole.
    assert replays - first[2] + t.costs.counts.segment_replays - segments >= 6


def _same(a, b):
    ra, ca = a
    rb, cb = b
    assert ra.ops == rb.ops
    assert (ra.flops, ra.comm_bytes, ra.comm_count, ra.peak_bytes, ra.time_s) == (
        rb.flops,
        rb.comm_bytes,
        rb.comm_count,
        rb.peak_bytes,
        rb.time_s,
    )
    assert ra.phases == rb.phases and ra.unfollowed == rb.unfollowed
    assert ca == cb


_PROGRAMS: dict[str, object] = {}


def _traced(how: str):
    if how not in _PROGRAMS:
        fn, params, x = decoder(4, how)
        _PROGRAMS[how] = trace(fn, params, x, mesh=MESH)
    return _PROGRAMS[how]


@settings(max_examples=12, deadline=None)
@given(
    how=st.sampled_from(["remat", "jit", "scan"]),
    up=st.integers(0, len(UP) - 1),
    down=st.integers(0, len(DOWN) - 1),
    batch=st.integers(0, len(BATCH) - 1),
    grads_like_params=st.booleans(),
)
def test_the_memo_never_changes_a_cost(how, up, down, batch, grads_like_params):
    t = _traced(how)
    specs = _specs(up, down, batch)
    out_specs = None
    if grads_like_params:
        p = jax.sharding.PartitionSpec
        ups = [None, (None, None, "model"), (None, "data", None), (None, "model", "data")][up]
        downs = [None, (None, "model", None), (None, None, "data"), (None, ("data", "model"), None)][down]
        out_specs = [None, p(*downs) if downs else None, p(*ups) if ups else None]  # loss, d down, d up
    t.costs.memoise_blocks = False
    plain = combined_report(t, specs, out_specs)
    plain_report = t.report(specs, out_specs)
    t.costs.memoise_blocks = True
    memo = combined_report(t, specs, out_specs)
    assert t.report(specs, out_specs).ops == plain_report.ops
    _same(memo, plain)


@pytest.mark.parametrize("where", ["sizes", "explicit mesh, set_mesh"])
def test_plans_of_unrolled_blocks_are_the_same_with_and_without_the_memo(monkeypatch, where):
    from einshard._src.analysis.program import costing

    fn, params, x = decoder(4, "remat")
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    x = jnp.asarray(np.ones((B, D), np.float32))

    def run():
        if where == "sizes":
            return einshard.plan(fn, params, x, mesh=MESH, profile="h100", search=SearchOptions(max_evaluations=40))
        mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes: jax.make_mesh's default
        with jax.set_mesh(mesh):
            return einshard.plan(fn, params, x, profile="h100", search=SearchOptions(max_evaluations=40))

    memo = run()
    original = costing.OpCosts.__init__

    def no_memo(self, *a, **k):
        original(self, *a, **k)
        self.memoise_blocks = False

    monkeypatch.setattr(costing.OpCosts, "__init__", no_memo)
    plain = run()
    assert memo.rules == plain.rules and memo.data_rules == plain.data_rules
    assert (memo.time_s, memo.memory_bytes, memo.comm_bytes) == (plain.time_s, plain.memory_bytes, plain.comm_bytes)
    assert [a.time_s for a in memo.alternatives] == [a.time_s for a in plain.alternatives]


def test_explain_under_jit_on_placed_inputs_is_the_same_with_and_without_the_memo():
    """Inputs already placed on an Explicit mesh, explained inside jax.jit (layouts read from the types)."""
    fn, params, x = decoder(4, "remat")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        params = {
            "up": einshard.einshard(jnp.zeros(params["up"].shape), "l d f -> l d f@model"),
            "down": einshard.einshard(jnp.zeros(params["down"].shape), "l f d -> l f@model d"),
        }
        x = einshard.einshard(jnp.ones((B, D)), "b d -> b@data d")
        reports = {}
        for memoise in (True, False):

            @jax.jit
            def step(p, x, memoise=memoise):
                t = trace(fn, p, x)
                t.costs.memoise_blocks = memoise
                first, again = t.report(), t.report()  # the second replays every block (memoised)
                reports[memoise] = (first, again, t.costs.counts.snapshot())
                return x.sum()

            step(params, x)
    (m1, m2, counts), (p1, p2, _) = reports[True], reports[False]
    assert m1.ops == p1.ops == m2.ops == p2.ops and m1.peak_bytes == p1.peak_bytes == m2.peak_bytes
    assert m1.ops and m1.comm_bytes > 0 and counts[2] > 0  # it communicates, and blocks were replayed


def _calls_in(jaxpr) -> list:
    """The ``jit`` equations of ``jaxpr`` and of the bodies it calls."""
    found = []
    for e in jaxpr.eqns:
        if e.primitive.name in ("jit", "pjit"):
            found.append(e)
        for p in e.params.values():
            body = p if hasattr(p, "eqns") else getattr(p, "jaxpr", None)
            if body is not None and hasattr(body, "eqns"):
                found.extend(_calls_in(body))
    return found


def test_a_jit_block_at_the_top_level_is_inlined_and_its_copies_replayed():
    """A ``jax.jit`` per layer at the program's top level is inlined, as XLA inlines it (:mod:`.inline`): its
    equations are the program's own repeated stretches, which the segment memo replays."""
    fn, params, x = decoder(6, "jit")
    t = trace(fn, params, x, mesh=MESH)
    assert not [e for e in t.jaxpr.eqns if e.primitive.name in ("jit", "pjit")]
    combined_report(t, _specs(0, 0, 1))
    assert t.costs.counts.segment_replays > 0


def test_a_jit_block_traced_per_layer_is_one_structure():
    fn, params, x = decoder(3, "jit_in_remat")
    t = trace(fn, params, x, mesh=MESH)
    combined_report(t, _specs(1, 1, 1))
    calls = _calls_in(t.jaxpr)
    bodies = {id(e.params["jaxpr"].jaxpr) for e in calls}
    assert len(bodies) > 1  # distinct objects...
    assert t.costs.counts.replays > 0  # ...one structure: replayed
    assert len(t.costs.structures.ordinals) < len(bodies)


def test_walk_counts_are_exposed_per_traced_program():
    fn, params, x = decoder(2, "remat")
    t = trace(fn, params, x, mesh=MESH)
    assert t.costs.counts.snapshot() == (0, 0, 0, 0)
    t.report(_specs(0, 0, 1))
    assert t.costs.counts.walks >= 1 and t.costs.counts.equations >= len(t.jaxpr.eqns)


def test_a_block_with_an_op_without_a_rule_is_walked_each_time_and_named():
    """Its site is the caller's line (not the block's to repeat): walked at every call, named once."""

    def odd_block(x, w):
        return jax.lax.betainc(1.0 + x**2, 2.0 + x**2, jax.nn.sigmoid(x @ w))

    def loss(w, x):
        for _ in range(3):
            x = jax.checkpoint(odd_block)(x, w)  # (a call that stays one: a top-level jit is inlined)
        return jnp.mean(x)

    w = jax.ShapeDtypeStruct((D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    t = trace(loss, w, x, mesh=MESH)
    specs = ("d e -> d e@model", "b d -> b@data d")
    memo = t.report(specs)
    assert t.costs.counts.replays == 0 and t.costs.counts.recorded == 3
    assert memo.unfollowed == ("regularized_incomplete_beta",) and "test_block_memo.py:" in memo.unfollowed_at[0]
    t.costs.memoise_blocks = False
    plain = t.report(specs)
    assert plain.ops == memo.ops and plain.unfollowed_at == memo.unfollowed_at


def test_a_replayed_op_is_the_recorded_one_renumbered_and_placed():
    """The replay's fast copy of an op equals dataclasses.replace's (every field, equality and hash)."""
    import dataclasses

    from einshard._src.analysis.program.walker import _replaced

    fn, params, x = decoder(3, "remat")
    t = trace(fn, params, x, mesh=MESH)
    ops = t.report(_specs(1, 3, 1)).ops
    assert ops
    for op in ops:
        changes = {"index": op.index + 7, "where": "model.py:1 (f)", "inside": "", "reads": ("params.up",)}
        fast, slow = _replaced(op, changes), dataclasses.replace(op, **changes)
        assert fast == slow and hash(fast) == hash(slow) and type(fast) is type(slow)
        assert op.index == fast.index - 7  # the recorded op is untouched
