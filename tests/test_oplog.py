"""The walk's op log (einshard._src.analysis.program.oplog): a replayed stretch's ops made only when read.

The planner's costings (``forks=0``) keep each replay of a repeated stretch as a run; what the report sums (its
phases' flops, bytes, counts and times) is read from the tape's ops, and the ops themselves are made when someone
reads them.  The guard: the made ops, the totals and the offered alternatives equal a full walk's (the segment memo
off: every op made by its own rule), and the log reads, assigns and slices like the list it replaces.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_block_memo import BATCH, DOWN, UP, _specs
from test_segment_memo import _traced

from einshard._src.analysis.program.oplog import OpLog, ReplayRun, cost_terms
from einshard._src.analysis.program.report import OpReport
from einshard._src.planner.combining import combined_report


def _op(i: int, note: str = "", alternative: int = 0) -> OpReport:
    return OpReport(
        i, "dot_general", "forward", f"op{i}", None, (), float(i), i * 1e-6, note=note, alternative=alternative
    )


def _log(pieces: list[int | tuple[int, int]]) -> tuple[OpLog, list[OpReport]]:
    """A log from ``pieces`` (an int: one op appended; (n, offset): a run of n tape ops at a copy), and the list
    the walker's replay made before (each run's ops expanded one by one)."""
    log, flat, counter = OpLog(), [], 0
    eqns = tuple(object() for _ in range(8))
    words = tuple((f"f.py:{k}", "", (f"w{k}",)) for k in range(8))
    for piece in pieces:
        if isinstance(piece, int):
            op = _op(counter)
            log.append(op)
            flat.append(op)
            counter += 1
            continue
        n, at = piece
        tape_ops = tuple(
            (_op(100 + k, "approximate: x" if k % 2 else "", alternative=7 * (k % 2)), None if k == 0 else at + k, None)
            for k in range(n)
        )
        log.add_run(ReplayRun(tape_ops, words, eqns, counter))
        for k, (op, off, _) in enumerate(tape_ops):
            made = dataclasses.replace(op, index=counter + k)
            if off is not None:
                where, inside, reads = words[off]
                made = dataclasses.replace(made, where=where, inside=inside, reads=reads)
                if op.alternative:
                    made = dataclasses.replace(made, alternative=id(eqns[off]))
            flat.append(made)
        counter += n
    return log, flat


_PIECES = st.lists(st.one_of(st.integers(0, 0), st.tuples(st.integers(0, 4), st.integers(0, 3))), max_size=8)


@settings(max_examples=60, deadline=None)
@given(pieces=_PIECES, data=st.data())
def test_the_log_reads_as_the_list_the_replay_made(pieces, data):
    log, flat = _log(pieces)
    assert len(log) == len(flat)
    assert [op.alternative for op in flat if op.alternative and op.approximate] == list(log.alternatives())
    assert [cost_terms(op) for op in flat] == list(log.costs())
    if flat:
        i = data.draw(st.integers(-len(flat), len(flat) - 1))
        assert log[i] == flat[i]
        log[i] = flat[i] = dataclasses.replace(flat[i], note="approximate: marked")
        a, b = sorted(data.draw(st.tuples(st.integers(0, len(flat)), st.integers(0, len(flat)))))
        assert log[a:b] == flat[a:b]
    assert list(log) == flat and log == tuple(flat)
    assert all(x is y for x, y in zip(log, log))  # a run is made once: every read sees the same ops
    with pytest.raises(IndexError):
        log[len(flat)]


@settings(max_examples=10, deadline=None)
@given(
    layers=st.integers(4, 6),
    how=st.sampled_from(["remat", "plain"]),
    layout=st.tuples(st.integers(0, len(UP) - 1), st.integers(0, len(DOWN) - 1), st.integers(0, len(BATCH) - 1)),
)
def test_a_ranking_costing_makes_no_replayed_op_and_lists_a_full_walks_ops(layers, how, layout):
    t = _traced(layers, how, "auto")
    specs, out_specs = _specs(*layout), None  # (gradients asked for a layout end the look-ahead: walked plainly)
    t.costs.memoise_segments = False
    full = t.report(specs, out_specs, forks=0)
    t.costs.memoise_segments = True
    combined_report(t, specs, out_specs)  # records the tapes
    lazy, _ = combined_report(t, specs, out_specs)
    assert isinstance(lazy.ops, OpLog)
    runs = sum(isinstance(c, ReplayRun) for c in lazy.ops._chunks)
    # One run per copy the reported walk replayed, none made yet (a walk before it stopped where it met an open
    # value's reader: open_values.py).
    counts = t.costs.counts
    assert runs == counts.segment_replays - counts.segment_replays_before
    assert runs >= 1 or how == "plain"  # remat: every layout replays (plain: some layouts walk open copies)
    assert lazy.phases == full.phases and lazy.time_s == full.time_s and lazy.comm_count == full.comm_count
    assert lazy.alternatives_unwalked == full.alternatives_unwalked
    assert lazy.ops == full.ops  # made when read: every op with its index, words and equation
