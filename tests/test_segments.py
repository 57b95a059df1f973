"""Repeated runs of top-level equations (einshard._src.analysis.program.segments), and what their walks read.

An unrolled ``jax.checkpoint`` decoder's forward is inlined at the top level, one stretch of equations per
layer: the runs are found by structure.  The audit of what each stretch's walk reads outside itself is why
the stretches are not replayed by structure and entering layouts alone (issue 21): under tensor-parallel
layouts the look-ahead of sharding propagation follows their values into the backward pass.
"""

from __future__ import annotations

import itertools
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_memo import BATCH, DOWN, MESH, UP, _specs, decoder

from einshard._src.analysis.program import trace
from einshard._src.analysis.program.segment_audit import boundary_reads
from einshard._src.analysis.program.segments import (
    Run,
    equation_signatures,
    find_runs,
    repeated_runs,
)
from einshard._src.analysis.program.walker import Walker


@settings(max_examples=60, deadline=None)
@given(
    head=st.lists(st.integers(100, 120), max_size=6),
    unit=st.lists(st.integers(0, 9), min_size=1, max_size=7, unique=True),
    count=st.integers(2, 6),
    tail=st.lists(st.integers(200, 220), max_size=6),
)
def test_a_planted_run_is_found_whole(head, unit, count, tail):
    """A unit of distinct signatures repeated ``count`` times between unrelated equations is one run."""
    sigs = head + unit * count + tail
    runs = repeated_runs(sigs)
    assert Run(len(head), len(unit), count) in runs
    for r in runs:  # every run found is a true repetition, and runs never overlap
        assert r.count >= 2
        copies = [sigs[s.start : s.stop] for s in r.copies()]
        assert all(c == copies[0] for c in copies)
    spans = sorted((r.start, r.stop) for r in runs)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))


def test_nothing_repeats_in_distinct_equations():
    assert repeated_runs(list(range(40))) == ()
    assert repeated_runs([]) == ()


def _traced(layers: int, how: str):
    fn, params, x = decoder(layers, how)
    return trace(fn, params, x, mesh=MESH)


@pytest.mark.parametrize("layers", [1, 2, 3, 6])
@pytest.mark.parametrize("how", ["remat", "plain"])
def test_the_inlined_forward_of_unrolled_layers_is_one_run(layers, how):
    """Each layer after the first (the first reads the program's input, not a layer's output) is a copy."""
    fn, params, x = decoder(layers, "remat") if how == "remat" else _plain(layers)
    t = trace(fn, params, x, mesh=MESH)
    runs = find_runs(t.jaxpr, t.costs.structures, t.costs.phase_of)
    forward = [r for r in runs if t.costs.phase_of(t.jaxpr.eqns[r.start]) == "forward"]
    if layers < 3:
        assert not forward  # one layer after the first: nothing repeats
        return
    (run,) = forward
    assert run.count == layers - 1
    # The copies are the layers: each slices its weights and ends with the residual add.
    for span in run.copies():
        names = [t.jaxpr.eqns[p].primitive.name for p in span]
        assert names.count("slice") == 2 and names.count("dot_general") == 2 and "add" in names


def _plain(layers: int):
    """``decoder`` without remat: the backward is inlined too (its layers are runs of their own)."""

    def loss(params, x):
        for i in range(layers):
            h = jax.nn.silu(x @ params["up"][i])
            x = x + h @ params["down"][i]
        return jnp.mean(x**2)

    _, params, x = decoder(layers, "remat")
    return jax.value_and_grad(loss), params, x


def test_signatures_name_operands_by_distance_not_by_object():
    """The same program traced twice signs alike; the layers' slices differ only by their row."""
    a, b = _traced(4, "remat"), _traced(4, "remat")
    sa = equation_signatures(a.jaxpr, a.costs.structures, a.costs.phase_of)
    sb = equation_signatures(b.jaxpr, a.costs.structures, a.costs.phase_of)
    assert sa == sb
    strict = equation_signatures(a.jaxpr, a.costs.structures, a.costs.phase_of, varying={})
    assert len(set(strict)) > len(set(sa))  # with the row in the signature, each layer's slices are their own


def test_the_audit_does_not_change_the_report():
    t = _traced(4, "remat")
    run = _forward_run(t)
    specs = _specs(1, 3, 1)
    plain = t.report(specs)
    boundary_reads(t, specs, None, run)
    assert t.report(specs).ops == plain.ops


def _forward_run(t):
    """The inlined forward's run (the backward's glue between the remat calls is another, from 5 layers)."""
    (run,) = [r for r in find_runs(t.jaxpr, t.costs.structures, t.costs.phase_of) if r.start < len(t.jaxpr.eqns) // 2]
    return run


def _reads(layers: int, layout: tuple[int, int, int]) -> Counter[tuple[str, str]]:
    t = _traced(layers, "remat")
    run = _forward_run(t)
    return Counter((r.channel, r.where) for r in boundary_reads(t, _specs(*layout), None, run))


def test_under_data_parallel_layouts_a_layer_reads_only_what_enters_it():
    reads = _reads(4, (0, 0, 1))
    assert reads and {where for _, where in reads} == {"entering"}


def test_under_tensor_parallel_layouts_the_look_ahead_leaves_the_layer():
    """The down projection's partial sum asks its consumers for a split (consumer_split, leaves_program): its
    uses reach the backward pass, after the layer.  A replay keyed by structure and entering layouts alone
    would not see what those reads found."""
    reads = _reads(4, (1, 1, 0))
    assert reads[("uses", "after")] > 0
    assert {where for _, where in reads} <= {"entering", "after"}


def _per_copy(t, specs, run):
    """Per copy: the state entering it (layouts and pending-sum tags of what it reads from before it, by
    distance) and the ops its equations recorded (renumbering and source lines left out)."""
    eqns = t.jaxpr.eqns
    at = {id(e): i for i, e in enumerate(eqns)}
    made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    keys: dict[int, tuple] = {}

    class Entering(Walker):
        def step(self, eqn, ins, repeat, phase):
            p = None if self._stepping else at.get(id(eqn))
            if p is not None and run.start <= p < run.stop and (p - run.start) % run.period == 0:
                entering = []
                for q in range(p, p + run.period):
                    for v in eqns[q].invars:
                        if hasattr(v, "val") or made.get(v, -1) >= p:
                            continue
                        lay = self.env.get(v)
                        state = None if lay is None else (type(lay).__name__, lay.dims, lay.unreduced)
                        # A forward residual read by the backward's glue: by its state (its distance grows per layer).
                        across = v in made and t.costs.phase_of(eqns[made[v]]) != t.costs.phase_of(eqns[q])
                        where = "input" if v not in made else "across" if across else made[v] - p
                        entering.append((q - p, where, state, self.summed.get(id(v))))
                # The splits the walk moves the copy's own open values to where they are made, which their readers
                # past the copy hand them (open_values: in the memo's key too, Walker.open_copies).
                moved = tuple(
                    (q - p, k, self.open_splits[id(o)])
                    for q in range(p, p + run.period)
                    for k, o in enumerate(eqns[q].outvars)
                    if id(o) in self.open_splits
                )
                keys[(p - run.start) // run.period] = (tuple(entering), moved)
            return super().step(eqn, ins, repeat, phase)

    w = Entering(t.costs)
    t.costs.memoise_segments = False  # every copy stepped, none replayed
    t.report(specs, walker=w)
    ops: dict[int, list] = {c: [] for c in range(run.count)}
    for op, e in zip(w.ops, w.op_eqns):
        p = at.get(id(e)) if e is not None else None
        if p is not None and run.start <= p < run.stop:
            c = (p - run.start) // run.period
            ops[c].append((p - run.start - c * run.period, op.primitive, op.expression, op.collectives, op.time_s))
    return keys, ops


@pytest.mark.parametrize("layers", [3, 5])
def test_copies_entering_alike_record_alike(layers):
    """The evidence a segment memo would rest on, over every layout of the small decoder: two layers that
    enter in the same state record the same ops (here; the look-ahead reads above are what a memo's key
    must still cover before it may replay)."""
    t = _traced(layers, "remat")
    runs = find_runs(t.jaxpr, t.costs.structures, t.costs.phase_of)
    assert len(runs) == (2 if layers >= 5 else 1)  # from 5 layers, the backward's glue repeats too
    for run in runs:
        compared = 0
        for up, down, batch in itertools.product(range(len(UP)), range(len(DOWN)), range(len(BATCH))):
            keys, ops = _per_copy(t, _specs(up, down, batch), run)
            for a, b in itertools.combinations(range(run.count), 2):
                if keys[a] == keys[b]:
                    compared += 1
                    assert ops[a] == ops[b], (up, down, batch, a, b)
        assert compared > 0
