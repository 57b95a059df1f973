"""Peak memory folded from per-stretch summaries (einshard._src.analysis.program.peak_summary): never a different
peak, and work per costing that does not grow with the layers laid out alike.

A costing with a PeakCache walks the flattened program stretch by stretch (the copies of its repeated runs and
the glue between them), each stretch's walk kept by its structure and the bytes it reads; without a cache the
whole program is walked step by step, as before.  Drawn models (unrolled with and without remat, scanned, of
1 to 5 layers) under drawn layouts give the same peak both ways, on both tilings; summaries are counted, never
timed.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard._src.analysis.program.memory import PeakCache, peak_bytes
from einshard._src.analysis.program.peak_summary import Steps, Summary, SummaryMemo, fold, fold_runs, stretches
from einshard._src.analysis.program.trace import arg_layouts
from einshard._src.analysis.program.walker import Walker

D, F, B, V = 16, 32, 8, 24
UP = ["l d f -> l d f", "l d f -> l d f@model", "l d f -> l d@data f", "l d f -> l d@model f@data"]
DOWN = ["l f d -> l f d", "l f d -> l f@model d", "l f d -> l f d@data", "l f d -> l f@(data,model) d"]
OUT = ["d v -> d v", "d v -> d v@model", "d v -> d@data v"]
BATCH = ["b d -> b d", "b d -> b@data d", "b d -> b@(data,model) d", "b d -> b d@model"]
GRADS = [None, P(None, None, "model"), P(None, "data", None)]


def _block(x, w):
    h = jnp.tanh(x @ w["up"])
    return x + (h * jax.nn.sigmoid(h)) @ w["down"]


def _loss(params, x, labels, *, how: str, layers: int, axes: str):
    if how == "scan":
        x, _ = jax.lax.scan(lambda c, w: (jax.checkpoint(_block)(c, w), None), x, params["stack"])
    else:
        block = jax.checkpoint(_block) if how == "remat" else _block
        for i in range(layers):
            x = block(x, jax.tree.map(lambda a, i=i: a[i], params["stack"]))
    # A placement: kept or copied by the layouts (on Auto axes, a sharding constraint).
    place = jax.sharding.reshard if axes == "explicit" else jax.lax.with_sharding_constraint
    x = place(x, P("data", None))
    logp = jax.nn.log_softmax(x @ params["out"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


@functools.cache
def _traced(how: str, layers: int, axes: str = "explicit"):
    stack = {
        "up": jax.ShapeDtypeStruct((layers, D, F), jnp.float32),
        "down": jax.ShapeDtypeStruct((layers, F, D), jnp.float32),
    }
    params = {"stack": stack, "out": jax.ShapeDtypeStruct((D, V), jnp.float32)}
    x, labels = jax.ShapeDtypeStruct((B, D), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32)
    fn = jax.value_and_grad(functools.partial(_loss, how=how, layers=layers, axes=axes))
    kind = AxisType.Explicit if axes == "explicit" else AxisType.Auto  # Explicit: jax.make_mesh's default
    with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))):
        return trace(fn, params, x, labels)


def _specs(up: int, down: int, out: int, batch: int):
    return ({"stack": {"up": UP[up], "down": DOWN[down]}, "out": OUT[out]}, BATCH[batch], "b -> b")


def _walked(t, specs, out_specs=None):
    """The layouts a costing walks to: the top-level environment and the nested calls' (as TracedProgram.report)."""
    walker = Walker(t.costs)
    env: dict = {}
    walker.walk(t.jaxpr, arg_layouts(t.args, specs, t.mesh), 1, None, env=env)
    return env, walker.sub_envs


_SHARED: dict[str, PeakCache] = {}


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    how=st.sampled_from(["unrolled", "remat", "scan"]),
    layers=st.sampled_from([1, 2, 3, 5]),
    axes=st.sampled_from(["explicit", "auto"]),
    up=st.integers(0, len(UP) - 1),
    down=st.integers(0, len(DOWN) - 1),
    out=st.integers(0, len(OUT) - 1),
    batch=st.integers(0, len(BATCH) - 1),
    grads=st.integers(0, len(GRADS) - 1),
    tiling=st.sampled_from(["dense", "tpu"]),
)
def test_the_folded_peak_is_the_whole_program_walks(how, layers, axes, up, down, out, batch, grads, tiling):
    t = _traced(how, layers, axes)
    env, inner = _walked(t, _specs(up, down, out, batch))
    whole = peak_bytes(t.jaxpr, env, inner, tiling=tiling)  # no cache: every step walked, as before summaries
    assert peak_bytes(t.jaxpr, env, inner, tiling=tiling, cache=PeakCache()) == whole  # summaries made afresh
    # ... and reused from the earlier drawn costings of this program, whatever their layouts were
    shared = _SHARED.setdefault(f"{how}{layers}{axes}", PeakCache())
    assert peak_bytes(t.jaxpr, env, inner, tiling=tiling, cache=shared) == whole
    # The report's peak (outputs laid out as asked, gradients like their weights) is the same through both.
    g = GRADS[grads]
    down_grad = None if g is None else P(None, g[2], g[1])
    out_specs = [None, None, down_grad, g]
    cache = t.peak_cache
    try:
        t.peak_cache = None
        plain = t.report(_specs(up, down, out, batch), out_specs, forks=0).peak_bytes
    finally:
        t.peak_cache = cache
    assert t.report(_specs(up, down, out, batch), out_specs, forks=0).peak_bytes == plain


def _summaries_walked(layers: int, specs) -> tuple[int, int]:
    t = _traced("remat", layers)
    cache = PeakCache()
    env, inner = _walked(t, specs)
    peak_bytes(t.jaxpr, env, inner, cache=cache)
    return cache.summaries.walked, cache.summaries.reused


@pytest.mark.parametrize("spec", [(1, 1, 1, 1), (3, 2, 0, 2)])
def test_twice_the_layers_walk_no_more_stretches(spec):
    """Layers laid out alike share their stretches' summaries: 2L layers walk as many as L (a constant more at
    most: the first and last layers' stretches differ from the middle ones')."""
    specs = _specs(*spec)
    (w4, r4), (w8, r8), (w16, r16) = (_summaries_walked(n, specs) for n in (4, 8, 16))
    assert w8 <= w4 + 2 and w16 <= w8 + 2
    assert w16 == w8  # past a few layers, none more
    assert r16 > r8 > r4  # the extra layers are reused summaries


def test_a_second_costing_under_the_same_layouts_walks_no_stretch():
    t = _traced("remat", 5)
    cache = PeakCache()
    env, inner = _walked(t, _specs(1, 1, 1, 1))
    first = peak_bytes(t.jaxpr, env, inner, cache=cache)
    walked = cache.summaries.walked
    env, inner = _walked(t, _specs(1, 1, 1, 1))  # a new walk: new environments, equal layouts
    assert peak_bytes(t.jaxpr, env, inner, cache=cache) == first
    assert cache.summaries.walked == walked
    # Another layout of the weights changes the layers' numbers: their stretches are walked again.
    env, inner = _walked(t, _specs(2, 3, 1, 1))
    peak_bytes(t.jaxpr, env, inner, cache=cache)
    assert cache.summaries.walked > walked


def test_stretches_cover_each_step_once_and_repeats_share_a_form():
    t = _traced("remat", 8)
    cache = PeakCache()
    env, inner = _walked(t, _specs(1, 1, 1, 1))
    peak_bytes(t.jaxpr, env, inner, cache=cache)
    (prog,) = [p for ps in cache.programs.values() for p in ps]
    (plan,) = prog.stretches.values()
    assert [s.start for s in plan[1:]] == [s.stop for s in plan[:-1]]
    assert plan[0].start == 0 and plan[-1].stop == len(prog.steps)
    # Each layer's forward and its backward recur: two forms at least cover most of the steps.
    counts: dict[int, int] = {}
    for s in plan:
        counts[s.form] = counts.get(s.form, 0) + s.stop - s.start
    top = sorted(counts.values(), reverse=True)[:2]
    assert sum(top) > len(prog.steps) / 2


def test_a_stacks_rows_sliced_first_are_cut_a_layer_at_a_time():
    """On XLA:CPU a loop over stacked weights slices every layer's rows first (memory._slices_of_arguments_first): a
    run of one op, repeating each step.  Cut by the types it makes, it repeats at the layer's length: one stretch
    per layer's rows (up's and down's), not one per row, so a costing reads a stretch per layer there; 2L layers
    make as many forms and walk as many summaries as L.  Every step is still in one stretch, and the peak is the
    whole-program walk's."""

    def sliced(layers: int) -> tuple[Any, Any]:
        t = _traced("remat", layers)
        cache = PeakCache()
        env, inner = _walked(t, _specs(1, 1, 1, 1))
        peak = peak_bytes(t.jaxpr, env, inner, cache=cache)
        assert peak == peak_bytes(t.jaxpr, env, inner)
        (prog,) = [p for ps in cache.programs.values() for p in ps]
        (plan,) = prog.stretches.values()
        rows = [s for s in plan if all(prog.steps[i].name == "slice" for i in range(s.start, s.stop))]
        return rows, cache.summaries.walked

    (rows8, walked8), (rows16, walked16) = sliced(8), sliced(16)
    assert len(rows16) - len(rows8) == 8  # a stretch a layer
    assert sum(s.stop - s.start == 2 for s in rows16) >= 16 - 2  # each the layer's two rows (the ends aside)
    assert len({s.form for s in rows16}) == len({s.form for s in rows8}) and walked16 == walked8


def test_fold_is_the_running_peak():
    from einshard._src.analysis.program.peak_summary import Summary

    # Entering at 10 live bytes: +5 (top 7 above), then -3 with 2 held (top 4), then an empty stretch.
    parts = [Summary(5, 0, 0, 7), Summary(-5, 2, 0, 4), Summary(0, 0, 0, None)]
    assert fold(0, parts, 10) == 19
    assert fold(30, parts, 10) == 30
    assert fold(0, [Summary(0, 0, 4, 1), Summary(0, 0, 0, 1)], 10) == 11  # gathered bytes ended: 10 - 4 + 1


_SUMMARIES = st.builds(
    Summary,
    st.integers(-50, 50),
    st.integers(0, 20),
    st.integers(0, 20),
    st.one_of(st.none(), st.integers(0, 80)),
)


@settings(max_examples=200, deadline=None, database=None)
@given(
    runs=st.lists(st.tuples(_SUMMARIES, st.integers(0, 40)), max_size=8),
    peak=st.integers(0, 200),
    level=st.integers(0, 200),
)
def test_a_run_of_identical_summaries_folds_in_closed_form(runs, peak, level):
    """A run of k identical summaries (k layers laid out alike) folds in one step: base + the larger of its first
    and its last copy's top, the level moved by k times what one copy adds; the same as folding them one by one."""
    expanded = [s for s, k in runs for _ in range(k)]
    assert fold_runs(peak, runs, level) == fold(peak, expanded, level)


def _sizings(layers: int, specs) -> tuple[int, int, int]:
    """One costing of a ``layers``-layer remat model: (buffer sizings, stretches walked, stretches reused)."""
    t = _traced("remat", layers)
    cache = PeakCache()
    env, inner = _walked(t, specs)
    peak_bytes(t.jaxpr, env, inner, cache=cache)
    memo = cache.summaries
    return memo.sized, memo.walked, memo.reused


@pytest.mark.parametrize("spec", [(1, 1, 1, 1), (3, 2, 0, 2)])
def test_twice_the_layers_size_no_more_buffers_per_costing(spec):
    """A costing computes each distinct buffer size once (shape, split, type, tiling): the layers laid out alike
    add none, so 2L layers size as many buffers as L (a constant more at most: the first and last layers')."""
    specs = _specs(*spec)
    (s4, _, _), (s8, w8, _), (s16, w16, r16) = (_sizings(n, specs) for n in (4, 8, 16))
    assert s8 <= s4 + 4  # (the first and last layers' stretches differ from the middle ones')
    assert s16 == s8
    assert w16 == w8 and r16 > 0


def test_stretches_of_a_program_without_repeats_are_its_glue():
    names = ["mul", "add", "exp"]
    ins = [("a",), ("x", "a"), ("y",)]
    outs = [("x",), ("y",), ("z",)]
    producer = {"x": 0, "y": 1, "z": 2}
    memo = SummaryMemo()
    steps = Steps(
        names,
        ins,
        outs,
        producer,
        frozenset({"a"}),
        frozenset(),
        frozenset(),
        {},
        {1: ["x"], 2: ["y"]},
        frozenset(),
        frozenset(),
    )
    plan = stretches(steps, memo.forms)
    assert [(s.start, s.stop) for s in plan] == [(0, 3)]
    assert plan[0].made == ("x", "y", "z") and plan[0].entering == () and plan[0].kept == ()


@pytest.mark.parametrize("axes", ["explicit", "auto"])
def test_explain_on_placed_inputs_under_jit_reads_the_whole_program_peak(axes, monkeypatch):
    """Where users are: arrays already placed on a mesh from jax.set_mesh, a jitted value_and_grad; explain's
    peak (summaries folded) is the one the whole-program walk gives."""
    import einshard
    from einshard._src.analysis.program.trace import TracedProgram

    kind = AxisType.Explicit if axes == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(kind, kind))
    layers = 4
    with jax.set_mesh(mesh):
        stack = {
            "up": jax.device_put(jnp.ones((layers, D, F)), jax.NamedSharding(mesh, P(None, None, "model"))),
            "down": jax.device_put(jnp.ones((layers, F, D)), jax.NamedSharding(mesh, P(None, "model", None))),
        }
        params = {"stack": stack, "out": jax.device_put(jnp.ones((D, V)), jax.NamedSharding(mesh, P()))}
        x = jax.device_put(jnp.ones((B, D)), jax.NamedSharding(mesh, P("data", None)))
        labels = jax.device_put(jnp.zeros((B,), jnp.int32), jax.NamedSharding(mesh, P("data")))
        fn = jax.jit(jax.value_and_grad(functools.partial(_loss, how="remat", layers=layers, axes=axes)))
        folded = einshard.explain(fn, params, x, labels)
        original = TracedProgram.__init__

        def whole(self, *a, **k):
            original(self, *a, **k)
            self.peak_cache = None  # every step walked, as without summaries

        monkeypatch.setattr(TracedProgram, "__init__", whole)
        plain = einshard.explain(fn, params, x, labels)
    assert folded.peak_bytes == plain.peak_bytes > 0
    assert folded.comm_bytes == plain.comm_bytes


def test_a_scans_body_is_flattened_once_across_costings():
    """A loop's one iteration is sized under each costing's layouts, from one flattening of its body (kept by
    the program's flattening) and its stretches' summaries: counted, and the same peak as a fresh walk."""
    t = _traced("scan", 3)
    cache = PeakCache()
    for up in range(len(UP)):
        env, inner = _walked(t, _specs(up, 1, 0, 1))
        assert peak_bytes(t.jaxpr, env, inner, cache=cache) == peak_bytes(t.jaxpr, env, inner)
    (prog,) = [p for ps in cache.programs.values() for p in ps]
    assert prog.loops  # the scan (forward and backward) are loop steps of the top-level program
    assert prog.loop_cache is not None
    assert prog.loop_cache.flattened == len({id(eqn) for _, eqn, _, _ in prog.loops})
    assert prog.loop_cache.reused >= (len(UP) - 1) * len(prog.loops)
