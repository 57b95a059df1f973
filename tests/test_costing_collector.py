"""The planner's costing and Python's cyclic collector (planner/combining.py's ``_collector_paused``).

A costing holds the collector off, and on its way out moves what it kept to the oldest generation without a pass
over it: counted here (the collector's passes, through ``gc.callbacks``), never timed.  The collector's state is the
caller's again after it, a process's own frozen objects stay frozen, and the result is the same either way.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from test_block_memo import MESH, _specs, decoder

from einshard._src.analysis.program import trace
from einshard._src.planner.combining import DependencyWalker, combined_report


@contextmanager
def _passes() -> Iterator[list[int]]:
    """The generations of the collector's passes made while the block runs."""
    seen: list[int] = []

    def note(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    try:
        yield seen
    finally:
        gc.callbacks.remove(note)


@pytest.fixture(scope="module")
def traced():
    fn, params, x = decoder(3, "remat")
    return trace(fn, params, x, mesh=MESH)


def _costing(traced, layout=(1, 1, 1)):
    report, combined = combined_report(traced, _specs(*layout))
    return report.time_s, report.peak_bytes, report.comm_bytes, combined


def test_a_costing_makes_no_collector_pass_and_leaves_it_on(traced):
    assert gc.isenabled()
    _costing(traced, (0, 0, 1))  # the first costing records the tapes; the next ones replay them
    gc.collect()
    with _passes() as seen:
        _costing(traced)
        _costing(traced, (2, 3, 2))
    # No middle or full pass (those walk the traced program's caches, the cost this is about).  On Python 3.11 the
    # young pass the costing's allocations were overdue for is not made either; 3.12's collector still makes two
    # young passes there (measured on CI's Python 3.12: they walk only the newest objects).
    assert not [g for g in seen if g > 0], seen
    if sys.version_info < (3, 12):
        assert seen == []
    assert gc.isenabled()
    assert gc.get_count()[0] < gc.get_threshold()[0]  # the count of new allocations starts over


def test_a_costing_keeps_the_collector_off_where_it_was_off(traced):
    gc.disable()
    try:
        with _passes() as seen:
            _costing(traced)
        assert seen == [] and not gc.isenabled()
    finally:
        gc.enable()


def test_frozen_objects_stay_frozen(traced):
    gc.freeze()  # a process that froze its objects before forking: a costing must not thaw them
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        _costing(traced)
        assert gc.get_freeze_count() == frozen
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_the_result_is_the_same_whatever_the_collector(traced):
    layout = (3, 2, 1)
    promoted = _costing(traced, layout)
    gc.disable()  # the costing then leaves the generations as they are
    try:
        kept = _costing(traced, layout)
    finally:
        gc.enable()
    assert promoted == kept


def test_a_costing_frees_its_walker_without_the_collector(traced, monkeypatch):
    """No reference cycle holds a costing's walker (and every table of it): it is freed when the costing ends, by
    reference counting alone, where a route was carried upstream too (upstream.py's mutually calling closures)."""
    from einshard._src.analysis.program import rules_structural

    walkers: list[weakref.ref[DependencyWalker]] = []
    routes: list[object] = []
    made, planned = DependencyWalker.__init__, rules_structural.plan_upstream

    def init(self, *args, **kwargs):
        made(self, *args, **kwargs)
        walkers.append(weakref.ref(self))

    def plan_upstream(*args, **kwargs):
        routes.append(planned(*args, **kwargs))
        return routes[-1]

    monkeypatch.setattr(DependencyWalker, "__init__", init)
    monkeypatch.setattr(rules_structural, "plan_upstream", plan_upstream)
    gc.disable()
    try:
        for up in range(4):
            for down in range(4):
                _costing(traced, (up, down, (up + down) % 4))
        assert walkers and all(w() is None for w in walkers)
    finally:
        gc.enable()
    assert routes  # the layouts above carry some value's split upstream
