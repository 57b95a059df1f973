"""A report's per-phase totals (trace._phase_totals) are the sums the per-op dict loop made, to the bit."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from einshard._src.analysis.program.oplog import cost_terms
from einshard._src.analysis.program.report import OpReport
from einshard._src.analysis.program.trace import _phase_totals

_floats = st.floats(min_value=0.0, max_value=1e15, allow_nan=False, allow_infinity=False)
_collective = st.builds(SimpleNamespace, bytes=st.one_of(_floats, st.integers(0, 10**12)))
_op = st.builds(
    SimpleNamespace,
    phase=st.sampled_from(["forward", "backward", "optimizer"]),
    flops=_floats,
    repeat=st.integers(1, 64),
    collectives=st.lists(_collective, max_size=4).map(tuple),
    time_s=_floats,
)


def _reference(ops: list[SimpleNamespace]) -> dict[str, dict[str, float]]:
    """The loop TracedProgram.report ran before: a dict per phase, OpReport.comm_bytes per op."""
    phases: dict[str, dict[str, float]] = {}
    for op in ops:
        tot = phases.setdefault(op.phase, {"flops": 0.0, "bytes": 0.0, "count": 0.0, "time_s": 0.0})
        tot["flops"] += op.flops * op.repeat
        tot["bytes"] += OpReport.comm_bytes.fget(op)  # type: ignore[attr-defined]
        tot["count"] += len(op.collectives) * op.repeat
        tot["time_s"] += op.time_s * op.repeat
    return phases


@settings(max_examples=200, deadline=None)
@given(st.lists(_op, max_size=40))
def test_phase_totals_are_the_per_op_sums_to_the_bit(ops: list[SimpleNamespace]) -> None:
    got, want = _phase_totals(map(cost_terms, ops)), _reference(ops)  # type: ignore[arg-type]
    assert list(got) == list(want)  # (the phases in the order first met)
    for phase, tot in want.items():
        assert list(got[phase]) == list(tot)
        for name, value in tot.items():
            assert got[phase][name] == value and type(got[phase][name]) is type(value), (phase, name)
