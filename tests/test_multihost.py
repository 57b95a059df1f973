"""Real multi-process einshard: 2 processes x 4 CPU devices under ``jax.distributed`` (gloo).

``tests/multihost_worker.py`` runs as each process; this test launches both,
checks they succeed and that each reports, for every scenario, the jitted
reductions numpy computes here from the same global data.  The in-process
tests below cover the pieces of process-local placement that one process can
check on its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from einshard import EinshardError, einshard

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "multihost_worker.py"
N_PROCESSES = 2
LOCAL_DEVICES = 4
TIMEOUT_S = 120  # a generous ceiling; the run takes a few seconds

SCENARIOS = {
    "global/counts",
    "global/rules/auto",
    "global/rules/auto/set_mesh",
    "global/rules/explicit",
    "global/rules/explicit/set_mesh",
    "global/own-shards-only",
    "global/local-jax-arrays",
    "global/relayout",
    "process_local/auto",
    "process_local/explicit",
    "process_local/counts",
    "process_local/replicated-across-processes",
    "jit/constraint/auto",
    "jit/constraint/explicit",
}


def _worker_module():
    spec = importlib.util.spec_from_file_location("multihost_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_processes(
    tmp_path: Path, extra: tuple[str, ...] = (), grace_s: float = 5, quick: bool = False
) -> list[tuple[int, str, str]]:
    """Launch every worker, wait for all of them (killing them all on timeout): (returncode, stdout, stderr) each."""
    port = _free_port()
    env = dict(os.environ)
    # The worker sets its own device count; import this checkout's einshard, not an installed one.
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    procs = []
    files = []
    try:
        for pid in range(N_PROCESSES):
            out = open(tmp_path / f"worker{pid}.out", "w+")  # files, not pipes: no pipe can fill and block
            err = open(tmp_path / f"worker{pid}.err", "w+")
            files.append((out, err))
            cmd = [sys.executable, str(WORKER), "--port", str(port), "--process-id", str(pid)]
            cmd += ["--num-processes", str(N_PROCESSES), "--local-devices", str(LOCAL_DEVICES), *extra]
            cmd += ["--quick"] if quick else []
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=ROOT))
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                # One failed: the others may wait for it in a collective; give them a moment, not minutes.
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, files, strict=True):
        out.seek(0)
        err.seek(0)
        results.append((p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


def _report(results: list[tuple[int, str, str]]) -> str:
    parts = []
    for pid, (rc, out, err) in enumerate(results):
        killed = " (killed: timed out, or another process failed first)" if rc is not None and rc < 0 else ""
        noisy = [line for line in out.splitlines() if not line.startswith("[Gloo]")]
        parts.append(
            f"--- process {pid}: exit {rc}{killed}\nstdout:\n" + "\n".join(noisy[-20:]) + f"\nstderr:\n{err[-4000:]}"
        )
    return "\n".join(parts)


# The scenarios a --quick run checks (the first ones): the default test run's real 2-process jax.distributed run.
QUICK_SCENARIOS = {
    "global/counts",
    "global/rules/auto",
    "global/rules/auto/set_mesh",
    "global/rules/explicit",
    "global/rules/explicit/set_mesh",
    "global/own-shards-only",
    "process_local/auto",
    "process_local/explicit",
}


def test_two_processes_shard_and_reduce_quick(tmp_path: Path) -> None:
    """A real 2-process jax.distributed run in the default suite (README: the test command includes one): global
    and process-local placement across processes, reduced with real cross-process collectives."""
    _check_two_processes(tmp_path, quick=True, scenarios=QUICK_SCENARIOS)


@pytest.mark.slow
def test_two_processes_shard_and_reduce(tmp_path: Path) -> None:
    _check_two_processes(tmp_path, quick=False, scenarios=SCENARIOS)


def _check_two_processes(tmp_path: Path, *, quick: bool, scenarios: set[str]) -> None:
    worker = _worker_module()
    results = _run_processes(tmp_path, quick=quick)
    assert all(rc == 0 for rc, _, _ in results), "a worker failed:\n" + _report(results)

    reports = []
    for _, out, _ in results:
        lines = [line for line in out.splitlines() if line.startswith(worker.RESULT_PREFIX)]
        assert len(lines) == 1, "a worker printed no result line:\n" + _report(results)
        reports.append(json.loads(lines[0][len(worker.RESULT_PREFIX) :]))
    assert sorted(r["process"] for r in reports) == list(range(N_PROCESSES))

    expected = {k: float(v) for k, v in worker.reduce_tree(np, worker.global_data()).items()}
    for report in reports:
        assert set(report["results"]) == scenarios, f"process {report['process']} ran {sorted(report['results'])}"
        for scenario, values in report["results"].items():
            assert values.keys() == expected.keys(), scenario
            for name, want in expected.items():
                assert values[name] == pytest.approx(want, rel=1e-6), (report["process"], scenario, name)
    # Every process sees the same (global) values.
    assert reports[0]["results"] == reports[1]["results"]


# ---------------------------------------------------------------------------
# Processes that disagree, or a peer that died: an EinshardError on every live process, in bounded time

DISAGREEMENTS = {
    "local-shape": r"disagree on the process-local data to place: process 0 and process 1 differ: "
    r"the array: shape \(4, 16\) float32 'b d -> b@data d' against the array: shape \(5, 16\)",
    "global-shape": r"disagree on the global data to place: .*shape \(8, 16\) .* against .*shape \(8, 17\)",
    "expression": r"disagree on the global data to place: .*'b d -> b@data d' against .*'b d -> b d@model'",
    "save-tree": r"disagree on the checkpoint to save at '.*ckpt': .*3 entries against 4|disagree on the checkpoint.*extra",
    "save-layout": r"disagree on the checkpoint to save at '.*ckpt': process 0 and process 1 differ: "
    r"\['w1'\] \[16, 8\] float32 '[^']*@model' against \['w1'\] \[16, 8\] float32 '[^']*@data[^']*'",
}


def _fault_reports(tmp_path: Path, fault: str) -> tuple[list[dict | None], list[tuple[int, str, str]]]:
    worker = _worker_module()
    start = time.monotonic()
    # A process killed on purpose: the survivor needs its peer timeout (5 s), or gloo's own 30 s, and a little more.
    results = _run_processes(tmp_path, ("--fault", fault, "--path", str(tmp_path / "ckpt")), grace_s=60)
    assert time.monotonic() - start < TIMEOUT_S, "a worker had to be killed:\n" + _report(results)
    reports: list[dict | None] = []
    for _, out, _ in results:
        lines = [line for line in out.splitlines() if line.startswith(worker.RESULT_PREFIX)]
        reports.append(json.loads(lines[-1][len(worker.RESULT_PREFIX) :]) if lines else None)
    return reports, results


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(DISAGREEMENTS))
def test_processes_that_disagree_are_refused_on_every_process(tmp_path: Path, fault: str) -> None:
    reports, results = _fault_reports(tmp_path, fault)
    for pid, report in enumerate(reports):
        assert report is not None, f"process {pid} printed no result:\n" + _report(results)
        assert report["error"] is not None, f"process {pid} accepted {fault}"
        assert re.search(DISAGREEMENTS[fault], report["error"]), (pid, report["error"])
        assert report["seconds"] < 10, report
    if fault.startswith("save"):
        assert not (tmp_path / "ckpt").exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == []


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["dead-peer-placement", "dead-peer-save"])
def test_a_dead_peer_is_named_within_the_peer_timeout(tmp_path: Path, fault: str) -> None:
    worker = _worker_module()
    (survivor, dead), results = _fault_reports(tmp_path, fault)
    assert dead is None  # killed itself (SIGKILL) before the call
    assert survivor is not None, "the surviving process printed no result:\n" + _report(results)
    assert survivor["error"] is not None
    assert re.search(r"process 0 waited 5 s for process 1 to reach", survivor["error"]), survivor["error"]
    assert worker.PEER_TIMEOUT_S <= survivor["seconds"] < worker.PEER_TIMEOUT_S + 5, survivor
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.slow
def test_a_peer_dying_inside_the_save_is_named_and_nothing_is_left(tmp_path: Path) -> None:
    """Killed after the agreement, as the save's collectives start: JAX's gloo gives up after its own 30 s."""
    (survivor, dead), results = _fault_reports(tmp_path, "dead-peer-mid-save")
    assert dead is None
    assert survivor is not None, "the surviving process printed no result:\n" + _report(results)
    assert re.search(r"cannot save the checkpoint at '.*ckpt': process 1 stopped taking part", survivor["error"])
    assert survivor["seconds"] < 60, survivor
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == []


# ---------------------------------------------------------------------------
# Process-local placement, checked in this single process (where local == global).


def test_process_local_stars_settle_on_the_global_layout() -> None:
    # On an unknown shape 'b* d*' would split the devices as evenly as possible;
    # on the real (8n, 3) the 3 cannot split, so every device goes to b.  The
    # data must land with that final layout, once.
    n = jax.device_count()
    x = np.arange(8 * n * 3, dtype=np.float32).reshape(8 * n, 3)
    placed = einshard(x, "b d -> b* d*", process_local=True)
    assert placed.sharding == einshard(x, "b d -> b* d*").sharding
    assert placed.sharding.shard_shape(placed.shape) == (8, 3)
    np.testing.assert_array_equal(np.asarray(placed), x)


def test_process_local_pytree_and_scalar() -> None:
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    batch = {"x": np.ones((2 * jax.device_count(), 5), np.float32), "step": np.int32(7)}
    placed = einshard(batch, {"x": "b d -> b@data d", "step": "->"}, mesh=mesh, process_local=True)
    assert placed["x"].sharding.spec == jax.sharding.PartitionSpec("data", None)
    assert int(placed["step"]) == 7


def test_process_local_under_jit_is_an_error() -> None:
    with pytest.raises(EinshardError, match="under jax.jit values are already global"):
        jax.jit(lambda v: einshard(v, "a b -> a b*", process_local=True))(np.ones((8, 8)))


def test_process_local_indivisible_is_an_einshard_error() -> None:
    with pytest.raises(EinshardError, match="does not split"):
        einshard(np.ones((8, 3)), "a b -> a b2", process_local=True)


# ---------------------------------------------------------------------------
# The agreement check's pieces, in this single process (the 2-process tests above run them for real)


def test_peer_timeout_is_checked_and_unchecked_switches_the_placement_check_off() -> None:
    from einshard import multihost
    from einshard._src._placement import agreement

    for bad in (0, -1, float("nan"), float("inf"), "5", True, None):
        with pytest.raises(EinshardError, match="seconds must be a finite number > 0"):
            multihost.set_peer_timeout(bad)  # type: ignore[arg-type]
    before = multihost.peer_timeout()
    multihost.set_peer_timeout(2.5)
    assert multihost.peer_timeout() == 2.5
    multihost.set_peer_timeout(before)
    assert agreement.checking() is False  # one process: nothing to agree on
    assert agreement._checked.get() is True
    with multihost.unchecked():
        assert agreement._checked.get() is False
    assert agreement._checked.get() is True
    assert agreement.exchange("test", "mine", "a test") == ["mine"]


def test_a_disagreement_names_both_processes_and_the_first_differing_leaf(monkeypatch) -> None:
    from einshard._src._placement import agreement

    sent: list[str] = []

    def two_processes(kind: str, value: str, what: str) -> list[str]:
        sent.append(value)
        theirs = json.loads(value)
        theirs["leaves"][1]["shape"] = [5, 16]
        return [value, json.dumps(theirs, sort_keys=True)]

    monkeypatch.setattr(agreement, "exchange", two_processes)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    tree = {"a": np.ones((8, 3), np.float32), "x": np.ones((4, 16), np.float32)}
    with pytest.raises(EinshardError) as err:
        agreement.check_placement(tree, "b ... -> b@data ...", mesh, True)
    assert str(err.value).startswith(
        "the processes disagree on the process-local data to place: process 0 and process 1 differ: "
        "['x']: shape (4, 16) float32 'b ... -> b@data ...' against ['x']: shape (5, 16) float32"
    )
    record = json.loads(sent[0])
    assert record["mesh"] == [["data", jax.device_count(), "Explicit"]] and record["process_local"] is True
    assert [e["path"] for e in record["leaves"]] == ["['a']", "['x']"]
