"""plan(verify=k) compiles each distinct program once, lowered once, the distinct ones concurrently (issue 21: a
7B step's TPU compile is minutes of CPU; verify compiles k candidates and the best preset).

Counted and synchronised, never timed: a barrier that only opens when two compiles are in flight together
proves the overlap; call counts prove the dedupe.  XLA:CPU stands in for the TPU compiler (same code path).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest

import einshard
import einshard._src.planner.core as core
import einshard._src.planner.verify as verify
from einshard.planner import SearchOptions


def _loss(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return jnp.mean((jax.nn.relu(x @ p["w1"]) @ p["w2"]) ** 2)


PARAMS = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32), "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
X = jax.ShapeDtypeStruct((128, 64), jnp.float32)


def _plan(verify_count: int) -> Any:
    return einshard.plan(
        jax.value_and_grad(_loss),
        PARAMS,
        X,
        mesh={"data": 4, "model": 2},
        verify=verify_count,
        search=SearchOptions(max_evaluations=12),
    )


def test_candidates_with_equal_shardings_compile_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every candidate sent twice, under another label: the same shardings, so the same program.
    real_verify, real_lower, real_compile = core.verify_assignments, verify.lower_on_shapes, verify.compile_and_read
    lowered: list[Any] = []
    compiled: list[Any] = []

    def doubled(fn: Any, costs: Any, candidates: Any, *args: Any, **kwargs: Any) -> Any:
        twice = list(candidates) + [(f"again: {label}", assign) for label, assign in candidates]
        return real_verify(fn, costs, twice, *args, **kwargs)

    def lower(*args: Any, **kwargs: Any) -> Any:
        lowered.append(args[2])  # the in_specs
        return real_lower(*args, **kwargs)

    def compile_and_read(low: Any, profile: Any) -> Any:
        compiled.append(low)
        return real_compile(low, profile)

    monkeypatch.setattr(core, "verify_assignments", doubled)
    monkeypatch.setattr(verify, "lower_on_shapes", lower)
    monkeypatch.setattr(verify, "compile_and_read", compile_and_read)
    result = _plan(3)
    rows = result.verification
    originals = [r for r in rows if not r.label.startswith("again: ")]
    assert len(rows) == 2 * len(originals) >= 4  # 3 candidates and the best preset, each twice
    distinct = len(set(map(tuple, lowered)))
    assert len(lowered) == len(compiled) == distinct <= len(originals)  # lowered once, compiled once, per program
    by_label = {r.label: r for r in rows}
    for r in originals:  # a copy reads the very same compiled numbers
        again = by_label[f"again: {r.label}"]
        assert (again.compiled_memory, again.compiled_comm_bytes, again.compiled_kinds) == (
            r.compiled_memory,
            r.compiled_comm_bytes,
            r.compiled_kinds,
        )


def test_distinct_programs_compile_concurrently(monkeypatch: pytest.MonkeyPatch) -> None:
    # One CPU: still two compiles at once (the pool runs up to twice the CPUs).  The first two compiles wait at a
    # two-party barrier: it opens only if they are in flight together (a pool of one, or compiles in the
    # caller's thread, would break it).
    real_compile = verify.compile_and_read
    barrier = threading.Barrier(2, timeout=60)
    threads: Counter[str] = Counter()
    first_two: list[int] = []
    lock = threading.Lock()

    def compile_and_read(low: Any, profile: Any) -> Any:
        with lock:
            first_two.append(1)
            waits = len(first_two) <= 2
        threads[threading.current_thread().name] += 1
        if waits:
            barrier.wait()
        return real_compile(low, profile)

    monkeypatch.setattr(verify, "compile_workers", lambda: 1)
    monkeypatch.setattr(verify, "compile_and_read", compile_and_read)
    result = _plan(3)
    assert len(first_two) >= 2 and not barrier.broken
    assert threading.main_thread().name not in threads and len(threads) >= 2
    assert sum(r.chosen for r in result.verification) == 1


def test_compile_workers_is_the_cpus_this_process_may_use() -> None:
    import os

    assert verify.compile_workers() == len(os.sched_getaffinity(0)) >= 1
