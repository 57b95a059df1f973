"""The segment memo (einshard._src.analysis.program.segment_memo) never changes a result.

An unrolled decoder's inlined forward is one run of identical stretches of top-level equations; with
``OpCosts.memoise_segments`` a stretch is walked once per entering state and replayed at the others, where
its walk read nothing outside itself.  The guard: reports (every op, in order, with its source line and
reads), peak memory, the planner's combined costs and its plan choices are equal with and without it, on
unrolled models of 1-6 layers with remat and without, under several layouts, on Auto and Explicit meshes.
"""

from __future__ import annotations

import itertools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from test_block_memo import BATCH, DOWN, LAYOUTS, MESH, UP, B, D, _same, _specs, decoder

import einshard
from einshard._src.analysis.program import trace
from einshard._src.analysis.program.walker import Walker
from einshard._src.planner.combining import combined_report
from einshard.planner import SearchOptions


def _plain(layers: int):
    """``decoder`` without remat: forward and backward both inlined at the top level."""

    def loss(params, x):
        for i in range(layers):
            h = jax.nn.silu(jnp.einsum("bd,df->bf", x, params["up"][i]))
            x = x + jnp.einsum("bf,fd->bd", h, params["down"][i])
        return jnp.mean(x**2)

    _, params, x = decoder(layers, "remat")
    return jax.value_and_grad(loss), params, x


_PROGRAMS: dict[tuple[int, str, str], object] = {}


def _traced(layers: int, how: str, mesh: str):
    key = (layers, how, mesh)
    if key not in _PROGRAMS:
        fn, params, x = decoder(layers, how) if how != "plain" else _plain(layers)
        axes = MESH if mesh == "auto" else jax.make_mesh((4, 2), ("data", "model"))  # Explicit: make_mesh's default
        _PROGRAMS[key] = trace(fn, params, x, mesh=axes)
    return _PROGRAMS[key]


def _out_specs(up: int, down: int):
    p = jax.sharding.PartitionSpec
    ups = [None, (None, None, "model"), (None, "data", None), (None, "model", "data")][up]
    downs = [None, (None, "model", None), (None, None, "data"), (None, ("data", "model"), None)][down]
    return [None, p(*downs) if downs else None, p(*ups) if ups else None]  # loss, d down, d up


def _both(t, specs, out_specs):
    t.costs.memoise_segments = False
    plain = combined_report(t, specs, out_specs), t.report(specs, out_specs)
    t.costs.memoise_segments = True
    memo = combined_report(t, specs, out_specs), t.report(specs, out_specs)
    return plain, memo


def _costings(most: int) -> st.SearchStrategy[list[tuple[int, int, int]]]:
    """1 to ``most`` costings, each an (up, down, batch) layout's indices into UP, DOWN and BATCH."""
    one = st.tuples(st.integers(0, len(UP) - 1), st.integers(0, len(DOWN) - 1), st.integers(0, len(BATCH) - 1))
    return st.lists(one, min_size=1, max_size=most)


@settings(max_examples=25, deadline=None)
# A walk stopped at an open value's reader took every split the stretch being recorded found, where a walk without
# the memo stops right after the first reader: another fixed point (the peak 30724 B against 30980 B).
@example(layers=3, how="plain", mesh="explicit", layouts=[(2, 0, 3)], grads_like_params=True)
@given(
    layers=st.integers(1, 6),
    how=st.sampled_from(["remat", "plain", "jit"]),
    mesh=st.sampled_from(["auto", "explicit"]),
    layouts=_costings(3),
    grads_like_params=st.booleans(),
)
def test_the_segment_memo_never_changes_a_report_or_a_cost(layers, how, mesh, layouts, grads_like_params):
    """Several layouts in a row on one traced program: later ones replay what earlier ones recorded."""
    t = _traced(layers, how, mesh)
    for up, down, batch in layouts:
        out_specs = _out_specs(up, down) if grads_like_params else None
        (plain, plain_report), (memo, memo_report) = _both(t, _specs(up, down, batch), out_specs)
        _same(memo, plain)
        assert memo_report.ops == plain_report.ops and memo_report.peak_bytes == plain_report.peak_bytes
        assert memo_report.phases == plain_report.phases


def test_every_layout_of_a_six_layer_decoder_is_the_same_and_some_replay():
    """Exhaustive over the small decoder's layouts (no hypothesis draw can skip one), with the counts."""
    t = _traced(6, "remat", "auto")
    for up, down, batch in itertools.product(range(len(UP)), range(len(DOWN)), range(len(BATCH))):
        (plain, plain_report), (memo, memo_report) = _both(t, _specs(up, down, batch), None)
        _same(memo, plain)
        assert memo_report.ops == plain_report.ops
    # Every layout replays copies (the look-ahead of tensor-parallel layouts reads the structure of the backward
    # consumers, which is in the key, and finds their values not bound yet, as in every copy).
    assert t.costs.counts.segment_replays >= 4 * len(UP) * len(DOWN) * len(BATCH)


def test_a_stretch_holding_an_op_without_a_rule_is_walked_each_time():
    """The report names such an op at its site (the innermost user line): such a stretch is never replayed."""

    def odd_block(x, w):
        return jax.lax.betainc(1.0 + x**2, 2.0 + x**2, jax.nn.sigmoid(x @ w))

    def loss(w, x):
        x = jax.jit(odd_block)(x, w)
        x = jax.jit(odd_block)(x, w)
        x = jax.jit(odd_block)(x, w)
        return jnp.mean(x)

    w = jax.ShapeDtypeStruct((D, D), jnp.float32)
    x = jax.ShapeDtypeStruct((B, D), jnp.float32)
    t = trace(loss, w, x, mesh=MESH)
    specs = ("d e -> d e@model", "b d -> b@data d")
    memo = t.report(specs)
    assert t.costs.counts.segment_replays == 0
    t.costs.memoise_segments = False
    plain = t.report(specs)
    assert plain.ops == memo.ops and plain.unfollowed_at == memo.unfollowed_at
    assert memo.unfollowed == ("regularized_incomplete_beta",) and "test_segment_memo.py:" in memo.unfollowed_at[0]


def test_replayed_copies_step_fewer_equations():
    t = _traced(6, "remat", "auto")
    specs = _specs(0, 0, 1)  # data parallel: every layer's walk stays closed
    # forks=0: counted per costing (a report also walks XLA's alternative at an offered approximate op, a walk
    # that steps every copy: alternatives force ops the tapes do not know of)
    t.costs.memoise_segments = False
    # A first costing records the calls' tapes (the block memo, kept whatever memoise_segments says): counted
    # from the second, both walks replay those alike, and the difference is the segments' alone (run alone, the
    # first costing also stepped the calls' bodies: 123 - 34 against the copies' 61).
    t.report(specs, forks=0)
    before = t.costs.counts.equations
    t.report(specs, forks=0)
    plain = t.costs.counts.equations - before
    t.costs.memoise_segments = True
    t.report(specs, forks=0)  # records (and replays what it can)
    before, replays = t.costs.counts.equations, t.costs.counts.segment_replays
    t.report(specs, forks=0)
    memo = t.costs.counts.equations - before
    (plan,) = t.costs.segment_plans.values()
    # Two runs: the inlined forward's layers, and the backward's glue between the remat calls (each layer's
    # cotangent padded into the stack at its row and summed).
    assert len({c.template for c in plan.copies.values()}) == 2
    assert t.costs.counts.segment_replays - replays == len(plan.copies)  # every copy replayed
    assert plain - memo == sum(c.stop - c.start for c in plan.copies.values())


def test_a_look_ahead_past_the_copy_is_kept_with_its_answer_and_checked_at_each_replay():
    """Under tensor-parallel layouts the look-ahead from a layer's partial sum runs along the residual stream past
    the layer's horizon (segment_memo.past_copy): the tape keeps that search's answer from there, and a copy
    replays the tape only where its own search answers alike (a tape whose kept answer is made wrong is never
    replayed: the copies are walked again, to the same report)."""
    import dataclasses

    fn, params, x = decoder(6, "remat")
    t = trace(fn, params, x, mesh=MESH)
    specs = _specs(1, 1, 0)
    first = t.report(specs, forks=0)
    assert t.costs.counts.segments_open == 0 and t.costs.counts.segment_replays >= 3
    tapes = t.costs.segment_tapes
    searched = [k for k, kept in tapes.items() if any(tape.searches for tape in kept)]
    assert searched
    for k in searched:
        tapes[k] = [
            dataclasses.replace(tape, searches=tuple((*s[:-1], ("a wrong answer",)) for s in tape.searches))
            for tape in tapes[k]
        ]
    again = t.report(specs, forks=0)
    assert again.ops == first.ops
    assert all(len(tapes[k]) == 2 for k in searched)  # walked and recorded again, its new tape replayed after
    t.costs.memoise_segments = False
    assert t.report(specs, forks=0).ops == first.ops


@pytest.mark.parametrize("layout", [(1, 1, 0), (2, 2, 0), (3, 3, 1)])
def test_the_layouts_asked_of_the_gradients_split_no_key_where_the_walk_reads_none(layout):
    """The last copies' horizons reach the gradients the caller asks layouts of; their walks read none of them,
    so they replay the tape of the copies before (segment_memo.asked_hold: a tape keeps only the asked layouts its
    walk read), as when nothing is asked, to the report the walk without the memo makes."""
    up, down, batch = layout
    specs = _specs(up, down, batch)
    counts = []
    for out_specs in (None, _out_specs(up, down)):
        fn, params, x = decoder(6, "remat")
        t = trace(fn, params, x, mesh=MESH)
        memo = t.report(specs, out_specs, forks=0)
        tapes = [tape for kept in t.costs.segment_tapes.values() for tape in kept]
        counts.append((t.costs.counts.segment_replays, t.costs.counts.segments_open, len(tapes)))
        t.costs.memoise_segments = False
        plain = t.report(specs, out_specs, forks=0)
        assert memo.ops == plain.ops and memo.peak_bytes == plain.peak_bytes
    assert counts[0] == counts[1]
    assert counts[1][0] >= 5  # of the 6 layers' forward copies and the backward's glue


def test_a_tape_whose_walk_read_an_asked_layout_replays_only_where_it_is_asked_alike():
    """A tape keeps the asked layouts its walk read (past the copy, by visit index: Recorder.asked); a copy where
    another layout is asked of those values never replays it (made wrong here: walked and recorded again, to the
    same report)."""
    import dataclasses

    fn, params, x = _plain(6)
    t = trace(fn, params, x, mesh=MESH)  # its own: its tapes are made wrong
    # (up's rows over 'data', asked so: a copy's look-ahead reads the asked layout of up's gradient)
    specs, out_specs = _specs(2, 0, 0), _out_specs(2, 0)
    first = t.report(specs, out_specs, forks=0)
    tapes = t.costs.segment_tapes
    read = [k for k, kept in tapes.items() if any(tape.asked for tape in kept)]
    assert read
    for k in read:
        tapes[k] = [
            dataclasses.replace(tape, asked=tuple((at, ("a wrong layout",)) for at, _ in tape.asked))
            for tape in tapes[k]
        ]
    again = t.report(specs, out_specs, forks=0)
    assert again.ops == first.ops
    assert all(len(tapes[k]) == 2 for k in read)  # walked and recorded again, its new tape replayed after
    t.costs.memoise_segments = False
    assert t.report(specs, out_specs, forks=0).ops == first.ops


def test_a_copy_whose_walk_was_open_is_walked_plainly_again_alike(monkeypatch):
    """A copy entering in the state of one whose walk read outside itself reads the same, up to the same read:
    it is walked without the logging (the same walk), never recorded again.  (Opened here by a look-ahead past
    the copy read as the walk reads it, without segment_memo.past_copy.)"""
    from einshard._src.analysis.program import rules_indexing

    monkeypatch.setattr(rules_indexing, "past_copy", lambda w, reach, at: False)
    fn, params, x = decoder(6, "remat")
    t = trace(fn, params, x, mesh=MESH)
    specs = _specs(1, 1, 0)  # tensor parallel: the look-ahead follows the early layers' partial sums past them
    first = t.report(specs, forks=0)
    opened = {key: len(guards) for key, guards in t.costs.segment_open.items()}
    walked_open = t.costs.counts.segments_open
    # Each distinct open state recorded once; the copies entering in it after that walked plainly.
    assert opened and walked_open > sum(opened.values())
    again = t.report(specs, forks=0)
    assert {key: len(guards) for key, guards in t.costs.segment_open.items()} == opened  # none recorded again
    assert t.costs.counts.segments_open == 2 * walked_open  # each walked again, plainly
    t.costs.memoise_segments = False
    assert t.report(specs, forks=0).ops == first.ops == again.ops


@pytest.mark.parametrize("where", ["sizes", "explicit mesh, set_mesh"])
@pytest.mark.parametrize("how", ["remat", "plain"])
def test_plans_are_the_same_with_and_without_the_segment_memo(monkeypatch, where, how):
    from einshard._src.analysis.program import costing

    fn, params, x = decoder(4, "remat") if how == "remat" else _plain(4)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    x = jnp.asarray(np.ones((B, D), np.float32))

    def run():
        if where == "sizes":
            return einshard.plan(fn, params, x, mesh=MESH, profile="h100", search=SearchOptions(max_evaluations=40))
        mesh = jax.make_mesh((4, 2), ("data", "model"))
        with jax.set_mesh(mesh):
            return einshard.plan(fn, params, x, profile="h100", search=SearchOptions(max_evaluations=40))

    memo = run()
    original = costing.OpCosts.__init__

    def no_memo(self, *a, **k):
        original(self, *a, **k)
        self.memoise_segments = False

    monkeypatch.setattr(costing.OpCosts, "__init__", no_memo)
    plain = run()
    assert memo.rules == plain.rules and memo.data_rules == plain.data_rules
    assert (memo.time_s, memo.memory_bytes, memo.comm_bytes) == (plain.time_s, plain.memory_bytes, plain.comm_bytes)
    assert [a.time_s for a in memo.alternatives] == [a.time_s for a in plain.alternatives]


def test_under_jit_on_placed_inputs_the_segment_memo_changes_nothing():
    fn, params, x = decoder(4, "remat")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        params = {
            "up": einshard.einshard(jnp.zeros(params["up"].shape), "l d f -> l d@data f"),
            "down": einshard.einshard(jnp.zeros(params["down"].shape), "l f d -> l f d@data"),
        }
        x = einshard.einshard(jnp.ones((B, D)), "b d -> b@data d")
        reports = {}
        for memoise in (True, False):

            @jax.jit
            def step(p, x, memoise=memoise):
                t = trace(fn, p, x)
                t.costs.memoise_segments = memoise
                reports[memoise] = (t.report(), t.report(), t.costs.counts.segment_replays)
                return x.sum()

            step(params, x)
    (m1, m2, replays), (p1, p2, _) = reports[True], reports[False]
    assert m1.ops == p1.ops == m2.ops == p2.ops and m1.peak_bytes == p1.peak_bytes == m2.peak_bytes
    assert m1.ops and replays > 0


def test_layouts_in_any_order_give_the_same_reports():
    """A tape recorded under one layout never leaks into another's (keys by entering state)."""
    t = _traced(5, "remat", "auto")
    t.costs.memoise_segments = False
    plain = {lay: t.report(_specs(*lay)).ops for lay in LAYOUTS}
    t.costs.memoise_segments = True
    for lay in reversed(LAYOUTS + LAYOUTS):
        assert t.report(_specs(*lay)).ops == plain[lay]


@pytest.mark.parametrize(
    "stack",
    [
        ("l d f -> l@data d f", "l f d -> l@data f d"),
        ("l d f -> l d f@model", "l f d -> l@model f@data d"),
        ("l d f -> l@(data,model) d f", "l f d -> l f@model d"),
    ],
)
def test_the_backward_glue_replays_with_its_pads(stack):
    """The backward's glue pads each layer's weight gradient into the stack at the layer's row: a run whose
    copies differ by their padding.  A copy's tape holds the padding its walk read (along the axes split at
    each pad): equal results, and the glue replays."""
    fn, params, x = decoder(8, "remat")
    t = trace(fn, params, x, mesh=MESH)
    specs = ({"up": stack[0], "down": stack[1]}, "b d -> b@data d")
    (plain, plain_report), (memo, memo_report) = _both(t, specs, None)
    _same(memo, plain)
    assert memo_report.ops == plain_report.ops and memo_report.peak_bytes == plain_report.peak_bytes
    (plan,) = t.costs.segment_plans.values()
    glue = [c for c in plan.copies.values() if c.pads]
    assert len(glue) >= 5 and len({c.pads for c in glue}) == len(glue)  # each copy pads at its own rows
    assert t.costs.counts.segment_replays >= len(glue) - 1


def _padded_rows(layers: int):
    """Each layer's result padded into its own rows of an accumulator, rows split: a pad along a split axis
    at an offset that differs per copy (which devices a row lands on depends on it)."""

    def f(w, x):
        acc = jnp.zeros((B * layers + 8, D), x.dtype)
        for i in range(layers):
            x = jnp.tanh(x @ w)
            acc = acc + jax.lax.pad(x, 0.0, ((B * i + 4, B * (layers - 1 - i) + 4, 0), (0, 0, 0)))
        return acc.sum()

    return f, jax.ShapeDtypeStruct((D, D), jnp.float32), jax.ShapeDtypeStruct((B, D), jnp.float32)


@pytest.mark.parametrize("rows", ["b d -> b@data d", "b d -> b@(data,model) d", "b d -> b d@model"])
def test_a_copy_padding_at_other_rows_of_a_split_axis_never_replays_another(rows):
    """A copy's tape holds the padding its walk read: where the pad's operand is split along the padded axis,
    each copy pads at its own rows and walks (no other copy's tape holds); costed again, each replays its own."""
    f, w, x = _padded_rows(5)
    t = trace(f, w, x, mesh=MESH)
    specs = ("d e -> d e", rows)
    (plain, plain_report), (memo, memo_report) = _both(t, specs, None)
    _same(memo, plain)
    assert memo_report.ops == plain_report.ops and memo_report.peak_bytes == plain_report.peak_bytes
    (plan,) = t.costs.segment_plans.values()
    copies = [c for c in plan.copies.values() if c.pads]
    assert len(copies) >= 3
    tapes = [tape for kept in t.costs.segment_tapes.values() for tape in kept]
    split = "@" in rows.split("->")[1].split()[0]
    read_rows = [seen for tape in tapes for _, axes, seen in tape.pads if 0 in axes]
    assert bool(read_rows) == split  # the rows are read where the operand's rows are split, only there
    before = t.costs.counts.segment_replays
    again = t.report(specs)
    assert again.ops == plain_report.ops
    assert t.costs.counts.segment_replays - before >= len(copies)  # each copy replays its own tape


def test_a_replay_binds_private_layouts_only_for_the_values_read_after_the_copy():
    """A replayed copy's values that nothing after it reads take the tape's layout objects, where a walk binds a
    private copy of each (the value-keyed memo of Walker.change tells values apart by them): counted by the
    private layouts each walker keeps; the reports are equal."""
    from einshard._src.analysis.program.walker import Walker

    fn, params, x = decoder(6, "remat")
    t = trace(fn, params, x, mesh=MESH)
    specs = _specs(0, 0, 1)
    t.report(specs, forks=0)  # records each copy's tape
    replays = t.costs.counts.segment_replays
    replayed = Walker(t.costs)
    again = t.report(specs, walker=replayed, forks=0)
    assert t.costs.counts.segment_replays - replays >= 6
    plan = next(iter(t.costs.segment_plans.values()))
    kept_alone = sum(len(c.inside) - len(c.escaping) for c in plan.copies.values())
    assert kept_alone > 0
    t.costs.memoise_segments = False
    walked = Walker(t.costs)
    assert t.report(specs, walker=walked, forks=0).ops == again.ops
    assert len(replayed._keep) < len(walked._keep)


# -- the walk per costing against depth (counted, never timed: benchmarks/bench_target.py times it) -----------------


def _stepped(layers: int) -> tuple[int, int, int]:
    """(equations stepped, copies replayed, the period of the forward's copies) over every layout of the small
    decoder, tensor-parallel ones included, costed by the planner's combining walker."""
    fn, params, x = decoder(layers, "remat")
    t = trace(fn, params, x, mesh=MESH)
    for up, down, batch in itertools.product(range(len(UP)), range(len(DOWN)), range(len(BATCH))):
        combined_report(t, _specs(up, down, batch))
    (plan,) = t.costs.segment_plans.values()
    period = max(c.stop - c.start for c in plan.copies.values())
    return t.costs.counts.equations, t.costs.counts.segment_replays, period


def test_twice_the_layers_step_no_more_equations_than_a_few_copies_more():
    """The equations a costing steps do not grow with depth once the layers' entering layouts have settled (the
    first copies, the last and the backward's glue meet their own layouts, some layouts settle a copy or two
    later): from 6 to 12 layers, over all 64 layouts together, a few copies' equations more (a walk that stepped
    each further layer would step 64 x 6 more copies); every further copy is replayed.  (What a replay applies is
    one copy's writes, ops and collectives: that still grows with depth, see docs/targets.md.)"""
    stepped_l, replays_l, period = _stepped(6)
    stepped_2l, replays_2l, _ = _stepped(12)
    assert stepped_2l - stepped_l <= 4 * period
    assert replays_2l - replays_l >= 64 * 2 * 6 - 16  # the six further layers' forward and glue copies


def _reference_combined(walker, profile, sizes):
    from einshard._src.planner.combining import greedy_groups

    return greedy_groups(walker.colls, profile, sizes)


@settings(max_examples=15, deadline=None)
@given(
    layers=st.integers(1, 6),
    how=st.sampled_from(["remat", "plain"]),
    layout=st.tuples(st.integers(0, len(UP) - 1), st.integers(0, len(DOWN) - 1), st.integers(0, len(BATCH) - 1)),
)
def test_the_combiner_groups_as_the_plain_greedy_does(layers, how, layout):
    """DependencyWalker.combined skips the groups before the one holding the latest upstream collective of the
    key; the plain greedy (every open group tried in order) groups the same collectives alike."""
    from einshard._src.planner.combining import DependencyWalker

    t = _traced(layers, how, "auto")
    walker = DependencyWalker(t.costs)
    t.report(_specs(*layout), walker=walker, forks=0)
    sizes = {m.name: m.size for m in t.mesh}
    assert walker.combined(t.costs.profile, sizes) == _reference_combined(walker, t.costs.profile, sizes)


class _Profile:
    """A latency per kind and group size, distinct enough that a wrong group shows in the saved sum."""

    def collective_time(self, kind, n, sent, array, axis_sizes=None):
        return {"all-reduce": 1.0, "all-gather": 0.001}[kind] * n


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["all-reduce", "all-gather"]),
            st.sampled_from([("data",), ("model",)]),
            st.lists(st.integers(0, 40), max_size=3),  # direct dependences, as distances back
        ),
        max_size=40,
    )
)
def test_the_combiner_groups_any_dependence_graph_as_the_plain_greedy(drawn):
    """Any dependence graph whose upstream masks hold their collectives' upstream masks (as the walk's do: a
    value's mask is its operands' and its own collectives')."""
    from einshard._src.planner.combining import _Coll, _combine

    colls: list = []
    for i, (kind, axes, back) in enumerate(drawn):
        upstream = 0
        for d in back:
            if d < i:
                j = i - 1 - d
                upstream |= (1 << j) | colls[j].upstream
        colls.append(_Coll(kind, axes, 4, 1, upstream, i))
    sizes = {"data": 4, "model": 4}
    assert _combine(colls, _Profile(), sizes, skip_upstream=True) == _combine(
        colls, _Profile(), sizes, skip_upstream=False
    )


def _tailed(layers: int, tail: str):
    """An unrolled stack of dots (per-layer weights, no residual) whose last copy's values flow into ``tail``: the
    run's copies align with the layers (a first op before them), so the last copy's horizon (Copy.horizon: the
    structure its values flow into, past it) is the tail's while the others' is the next layer's."""

    def f(params, x):
        x = x * 2.0
        for i in range(layers):
            h = jax.nn.silu(jnp.einsum("bd,df->bf", x, params["up"][i]))
            x = jnp.einsum("bf,fd->bd", h, params["down"][i])
        if tail == "convert":  # the last dot's sum leaves the program through a carrier (leaves_program)
            return x.astype(jnp.bfloat16)
        if tail == "head":  # a consumer dot with a laid-out partner (consumer_split)
            return jnp.einsum("bd,de->be", x, params["head"])
        return jnp.mean(x)

    params = {
        "up": [jax.ShapeDtypeStruct((D, 32), jnp.float32)] * layers,
        "down": [jax.ShapeDtypeStruct((32, D), jnp.float32)] * layers,
        "head": jax.ShapeDtypeStruct((D, D), jnp.float32),
    }
    return f, params, jax.ShapeDtypeStruct((B, D), jnp.float32)


@pytest.mark.parametrize("tail", ["convert", "head", "mean"])
def test_a_last_copy_whose_values_flow_elsewhere_reports_as_its_walk(tail, monkeypatch):
    """Copy.horizon is not in the segment key: the last copy of a run keys like the others though its values flow
    into the tail, not into another layer.  What its walk reads past itself either leaves the recording (a laid-out
    value outside it: the copy is open), is answered again at each replay (a search past the horizon:
    searches_hold), or is a value not bound yet in any copy's walk; so it reports as walked, under layouts whose
    look-ahead decides a sum's split (tensor parallel: the down projection's contraction split)."""
    layers = 4
    fn, params, x = _tailed(layers, tail)
    t = trace(fn, params, x, mesh=MESH)
    replayed: set[int] = set()
    start = Walker._segment_start

    def noting(self, plan, copy, *a):
        got = start(self, plan, copy, *a)
        if got == "replayed":
            replayed.add(copy.start)
        return got

    monkeypatch.setattr(Walker, "_segment_start", noting)
    for up, down, head, batch in [
        ("d f -> d f@model", "f d -> f@model d", "d e -> d@model e", "b d -> b d"),
        ("d f -> d f@model", "f d -> f@model d", "d e -> d e@model", "b d -> b@data d"),
        ("d f -> d@model f", "f d -> f@(data,model) d", "d e -> d@data e", "b d -> b d"),
        ("d f -> d f", "f d -> f d", "d e -> d e", "b d -> b@data d"),
    ]:
        specs = ({"up": [up] * layers, "down": [down] * layers, "head": head}, batch)
        t.costs.memoise_segments = False
        plain = t.report(specs)
        t.costs.memoise_segments = True
        memo = t.report(specs)
        assert memo.ops == plain.ops and memo.peak_bytes == plain.peak_bytes
    (plan,) = t.costs.segment_plans.values()
    *_, before, last = sorted(plan.copies.values(), key=lambda c: c.start)
    # The last copy keys like the others (one structure) though its horizon is its own, and it was replayed.
    assert len({c.structure for c in plan.copies.values()}) == 1 and last.horizon != before.horizon
    assert last.start in replayed


def test_recordings_copy_no_table_of_the_walk(monkeypatch):
    """Recording a copy swaps the classes of the walker's tables (segment_memo.record_table), the uses table
    included (it holds every walked value's consumers: copying it in and out of each recording grew with depth):
    each table is one object through every recording of a costing, and the reports are the same."""
    fn, params, x = decoder(6, "remat")
    t = trace(fn, params, x, mesh=MESH)
    seen: dict[int, list[tuple[int, ...]]] = {}  # per walker, its tables' ids after each recording
    finish = Walker._segment_finish

    def noting(self, recording, env):
        finish(self, recording, env)
        seen.setdefault(id(self), []).append((id(self.uses), id(self.summed), id(self._made), id(self.requested)))

    monkeypatch.setattr(Walker, "_segment_finish", noting)
    specs, out_specs = _specs(1, 1, 0), _out_specs(1, 1)
    memo = t.report(specs, out_specs, forks=0)
    assert max(map(len, seen.values())) >= 2  # several recordings in one costing
    assert all(len(set(tables)) == 1 for tables in seen.values())
    t.costs.memoise_segments = False
    assert t.report(specs, out_specs, forks=0).ops == memo.ops


@settings(max_examples=12, deadline=None)
@given(
    layers=st.integers(1, 8),
    how=st.sampled_from(["remat", "plain"]),
    layouts=_costings(2),
)
def test_a_key_carried_from_the_copy_before_is_the_key_read_afresh(layers, how, layouts):
    """A copy replayed right after another of its run takes the state of the values entering both from that copy's
    key (Walker._carried): at every copy of every costing that key equals the one read afresh, value by value, and
    the carried copies read only the values they do not share (WalkCounts.segment_key_reads)."""
    t = _traced(layers, how, "auto")
    key_of = Walker._segment_key
    carried_at: list[int] = []

    def both(self, copy, env, repeat, phase_hint, carried=None):
        key = key_of(self, copy, env, repeat, phase_hint, carried)
        if carried is not None:
            reads = self.costs.counts.segment_key_reads
            assert key == key_of(self, copy, env, repeat, phase_hint)
            self.costs.counts.segment_key_reads = reads  # the check's own reads not counted
            carried_at.append(copy.start)
        return key

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Walker, "_segment_key", both)
        for up, down, batch in layouts:
            specs, out_specs = _specs(up, down, batch), _out_specs(up, down)
            reads = t.costs.counts.segment_key_reads
            combined_report(t, specs, out_specs)
            assert t.costs.counts.segment_key_reads >= reads


def test_copies_replayed_one_after_another_read_only_what_they_do_not_share():
    """At 8 layers under a data-parallel layout, the copies replayed one after another take the state of the
    values entering both (the stacked weights) from the key before, and that of the values the copy before made
    (the residual stream) from its tape's once read: each reads at most what it does not share with the copy
    before, and the run's later copies read nothing (counted in WalkCounts.segment_key_reads)."""
    t = _traced(8, "remat", "auto")
    specs = _specs(0, 0, 1)
    combined_report(t, specs)  # records the tapes of this layout
    (plan,) = t.costs.segment_plans.values()
    reads = t.costs.counts.segment_key_reads
    combined_report(t, specs)
    read = t.costs.counts.segment_key_reads - reads
    copies = sorted(plan.copies.values(), key=lambda c: c.start)
    entering = sum(len(c.entering) for c in copies if not c.leaves)
    # Every copy is replayed in this second costing of the layout (the last, whose values leave, is walked): each
    # copy after a replayed one reads only what it does not share with it.
    shared = sum(
        len(set(a.entering_ids) & set(b.entering_ids))
        for a, b in zip(copies, copies[1:])
        if a.stop == b.start and not a.leaves and not b.leaves
    )
    assert shared >= 12  # the forward's later copies share the two stacks with the copy before
    # The values a replayed copy made are read at the first copy after a replay of its tape, then kept (the
    # residual stream: one per copy of the run otherwise).
    made = sum(
        len(set(b.entering_ids) & {id(v) for v in a.inside})
        for a, b in zip(copies, copies[1:])
        if a.stop == b.start and not a.leaves and not b.leaves
    )
    assert made >= 3
    # What is neither shared nor made by the copy before is read; of the rest, some is taken.
    assert entering - shared - made <= read < entering - shared


def _keys_against_fresh_reads(t, layouts) -> tuple[int, int]:
    """Cost ``layouts`` on ``t`` twice each (the second costing of a layout replays what the first recorded), with
    each key Walker._segment_key takes from the copy replayed before (:meth:`Walker._carried`) checked against the
    key read from the walk's tables at that moment; how many were checked, and how many kept the state of the
    copy before as it was (one object: the run's next state found from it)."""
    taken = Walker._segment_key
    counts = [0, 0]

    def both(self, copy, env, repeat, phase_hint, carried=None):
        key, state = taken(self, copy, env, repeat, phase_hint, carried)
        if carried is not None:
            assert (key, state) == taken(self, copy, env, repeat, phase_hint, None)
            counts[0] += 1
            counts[1] += state is carried[0]
        return key, state

    with mock.patch.object(Walker, "_segment_key", both):
        for up, down, batch in layouts:
            for _ in range(2):
                combined_report(t, _specs(up, down, batch), _out_specs(up, down))
    return counts[0], counts[1]


@settings(max_examples=6, deadline=None)
@given(
    layers=st.integers(2, 6),
    how=st.sampled_from(["remat", "plain"]),
    layouts=_costings(3),
)
def test_a_key_taken_from_the_copy_before_is_the_key_read_afresh(layers, how, layouts):
    """Walker._segment_key takes what it can from the copy replayed just before (the state of the values entering
    both, the state that replay's tape leaves the values it made in, the whole state from the one before where
    everything was taken so): each such key equals the key read from the walk's tables at that moment."""
    _keys_against_fresh_reads(_traced(layers, how, "auto"), layouts)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(2, 8),
    how=st.sampled_from(["remat", "plain", "jit"]),
    mesh=st.sampled_from(["auto", "explicit"]),
    layouts=_costings(4),
)
def test_a_key_taken_from_the_copy_before_is_the_key_read_afresh_more(layers, how, mesh, layouts):
    """As above, more draws (slow)."""
    _keys_against_fresh_reads(_traced(layers, how, mesh), layouts)


def test_a_run_of_eight_copies_takes_its_keys_from_the_copy_before():
    """At 8 layers the run's later copies take their keys from the copy before, and most of them whole."""
    checked, whole = _keys_against_fresh_reads(_traced(8, "remat", "auto"), [(0, 0, 1), (1, 1, 0), (3, 2, 2)])
    assert checked >= 12 and whole >= 6


def _origins(layers: int, tail: str):
    """A stack of ``tanh(y @ w[i])`` after a first value ``x0``, then ``y + x0``: the last copy's result flows into an
    elementwise op whose other operand was made before the copies, the other copies' into the next layer's dot.
    ``tail``: 'settled' (x0 = x * 2, split by Shardy's elementwise-first pass: a dot whose free and contracted
    splits clash takes its split, rules_indexing._elementwise_reader_split) or 'dot' (x0 = x @ proj: not split in
    that pass, so no layout of it is read)."""

    def f(params, x):
        x0 = x * 2.0 if tail == "settled" else x @ params["proj"]
        y = x0
        for i in range(layers):
            y = jnp.tanh(y @ params["w"][i])
        return y + x0

    params = {
        "w": [jax.ShapeDtypeStruct((D, D), jnp.float32)] * layers,
        "proj": jax.ShapeDtypeStruct((D, D), jnp.float32),
    }
    return f, params, jax.ShapeDtypeStruct((B, D), jnp.float32)


def _splits(a: str, b: str) -> list[str]:
    """Every layout of a 2-d array over the test mesh (each axis whole, on data, model or both; none twice)."""
    ways = ["", "@data", "@model", "@(data,model)"]
    return [
        f"{a} {b} -> {a}{p} {b}{q}"
        for p, q in itertools.product(ways, ways)
        if not (p and q and set(p[1:].strip("()").split(",")) & set(q[1:].strip("()").split(",")))
    ]


@pytest.mark.parametrize("tail", ["settled", "dot"])
def test_a_copy_whose_values_meet_a_partner_from_before_it_keys_apart(tail):
    """The elementwise readers' look-ahead of a dot (rules_indexing._elementwise_reader_split) reads, of each reader's
    other operand, whether Shardy's elementwise-first pass splits it (where the value comes from, not its layout)
    and then its layout.  The last copy here meets x0 past itself, the others do not, and Copy.horizon is not in the
    key: it replayed the copy before's tape (a batch-split stack of f-split weights: one all-gather per layer where
    its walk all-to-alls y to x0's split, then gathers the weight: 10 of these 98 layouts differed).  Such partners,
    and each entering value's answer where a pass-through op reads it, are in the copy's structure now: reports are
    the walk's under every layout, and with x0 not settled the last copy is replayed again from its own tape."""
    layers = 4
    fn, params, x = _origins(layers, tail)
    t = trace(fn, params, x, mesh=MESH)
    for w, batch, proj in itertools.product(_splits("d", "f"), _splits("b", "d"), ["d e -> d e", "d e -> d@data e"]):
        if tail == "settled" and proj != "d e -> d e":
            continue  # proj is unread there
        specs = ({"w": [w] * layers, "proj": proj}, batch)
        t.costs.memoise_segments = False
        plain = t.report(specs)
        t.costs.memoise_segments = True
        memo = t.report(specs)
        assert memo.ops == plain.ops and memo.peak_bytes == plain.peak_bytes, specs
    (plan,) = t.costs.segment_plans.values()
    *others, last = sorted(plan.copies.values(), key=lambda c: c.start)
    assert len({c.structure for c in others}) == 1 and last.structure != others[0].structure
    assert t.costs.counts.segment_replays > 0


def test_an_entering_value_keys_by_its_origin_only_where_a_pass_through_op_reads_it():
    """``x + bias`` enters the first layer of ``(x @ up[i] * x) @ down[i]`` (split in Shardy's elementwise-first pass),
    each later layer a dot's result (not split in it), and the multiply reads it as the partner of the up
    projection's result: the first copy keys apart from the others.  In a layer that reads its input with dots only
    (``(x @ up[i]) @ down[i]``) no walk reads that, and every copy keys alike."""

    def stack(multiply: bool):
        def f(params, x):
            x = x + params["bias"]
            for i in range(3):
                h = x @ params["up"][i]
                x = (h * x if multiply else h) @ params["down"][i]
            return jnp.mean(x**2)

        params = {
            "bias": jax.ShapeDtypeStruct((D,), jnp.float32),
            "up": jax.ShapeDtypeStruct((3, D, D), jnp.float32),
            "down": jax.ShapeDtypeStruct((3, D, D), jnp.float32),
        }
        return trace(jax.value_and_grad(f), params, jax.ShapeDtypeStruct((B, D), jnp.float32), mesh=MESH)

    for multiply in (True, False):
        t = stack(multiply)
        specs = ({"bias": "d -> d", "up": "l d f -> l d@data f", "down": "l f d -> l f d@data"}, "b d -> b@data d")
        t.costs.memoise_segments = False
        plain = t.report(specs)
        t.costs.memoise_segments = True
        assert t.report(specs).ops == plain.ops
        (plan,) = t.costs.segment_plans.values()
        first, *rest = sorted((c for c in plan.copies.values() if c.template == 0), key=lambda c: c.start)
        assert len(rest) >= 2 and len({c.structure for c in rest}) == 1  # (without the multiply: half a layer each)
        assert (first.structure != rest[0].structure) == multiply
