"""Peak memory reused between costings (einshard.analysis.program.memory.PeakCache): never a different result.

The planner costs one traced program under hundreds of layouts; each costing's peak memory reuses the
flattening (calls inlined, placements that keep their layout aliased) and the liveness of the earlier
costings whose layout-dependent answers were the same.  Drawn layouts cost the same peak with the cache
as without it, through every structure the reuse depends on: remat calls the walk enters, a scan (one
iteration's bytes are the layouts'), a placement that keeps or changes its value's layout, a scatter-add
into zeros (an integer-label cross-entropy's gradient) and gradients returned laid out like the weights.
Flattenings are counted, never timed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard._src.analysis.program.memory import PeakCache, peak_bytes
from einshard._src.analysis.program.trace import arg_layouts
from einshard._src.analysis.program.walker import Walker
from einshard._src.planner.combining import combined_report

D, F, B, V, L = 16, 32, 8, 24, 3
UP = ["l d f -> l d f", "l d f -> l d f@model", "l d f -> l d@data f", "l d f -> l d@model f@data"]
DOWN = ["l f d -> l f d", "l f d -> l f@model d", "l f d -> l f d@data", "l f d -> l f@(data,model) d"]
OUT = ["d v -> d v", "d v -> d v@model", "d v -> d@data v"]
BATCH = ["b d -> b d", "b d -> b@data d", "b d -> b@(data,model) d", "b d -> b d@model"]
GRADS = [None, P(None, None, "model"), P(None, "data", None)]


def _block(x, w):
    return x + jnp.tanh(x @ w["up"]) @ w["down"]


def _loss(params, x, labels, *, how: str):
    if how == "scan":
        x, _ = jax.lax.scan(lambda c, w: (jax.checkpoint(_block)(c, w), None), x, params["stack"])
    else:
        for i in range(L):
            x = jax.checkpoint(_block)(x, jax.tree.map(lambda a, i=i: a[i], params["stack"]))
    # A placement: the same buffer where the batch is already split so, a copy where it is not.
    x = jax.sharding.reshard(x, P("data", None))
    logp = jax.nn.log_softmax(x @ params["out"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def _shapes():
    stack = {"up": jax.ShapeDtypeStruct((L, D, F), jnp.float32), "down": jax.ShapeDtypeStruct((L, F, D), jnp.float32)}
    params = {"stack": stack, "out": jax.ShapeDtypeStruct((D, V), jnp.float32)}
    return params, jax.ShapeDtypeStruct((B, D), jnp.float32), jax.ShapeDtypeStruct((B,), jnp.int32)


_TRACED: dict[str, object] = {}


def _traced(how: str):
    if how not in _TRACED:
        params, x, labels = _shapes()
        mesh = jax.make_mesh((4, 2), ("data", "model"))  # Explicit axes, jax.make_mesh's default
        fn = jax.value_and_grad(lambda p, x, y: _loss(p, x, y, how=how))
        with jax.set_mesh(mesh):
            _TRACED[how] = trace(fn, params, x, labels)
    return _TRACED[how]


def _specs(up: int, down: int, out: int, batch: int):
    return ({"stack": {"up": UP[up], "down": DOWN[down]}, "out": OUT[out]}, BATCH[batch], "b -> b")


def _out_specs(grads: int):
    g = GRADS[grads]
    down = None if g is None else P(*(None if e is None else e for e in (None, g[2], g[1])))
    # (loss, ({'out': ..., 'stack': {'down': ..., 'up': ...}},)): the outputs' leaves in order
    return [None, None, down, g]


@settings(max_examples=16, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    how=st.sampled_from(["unrolled", "scan"]),
    up=st.integers(0, len(UP) - 1),
    down=st.integers(0, len(DOWN) - 1),
    out=st.integers(0, len(OUT) - 1),
    batch=st.integers(0, len(BATCH) - 1),
    grads=st.integers(0, len(GRADS) - 1),
)
def test_reusing_peak_memory_never_changes_it(how, up, down, out, batch, grads):
    t = _traced(how)
    specs, out_specs = _specs(up, down, out, batch), _out_specs(grads)
    cache = t.peak_cache  # kept across the drawn examples: reuse is what is under test
    try:
        t.peak_cache = None
        plain, (plain_combined, plain_report) = t.report(specs, out_specs), combined_report(t, specs, out_specs)
    finally:
        t.peak_cache = cache
    cached, (cached_combined, cached_report) = t.report(specs, out_specs), combined_report(t, specs, out_specs)
    assert cached.peak_bytes == plain.peak_bytes
    assert cached_combined.peak_bytes == plain_combined.peak_bytes == plain.peak_bytes
    assert cached_report == plain_report


def test_a_flattening_is_reused_while_its_layout_answers_hold():
    t = _traced("unrolled")
    t.peak_cache = cache = PeakCache()
    # forks=0: counted per costing (a report also walks XLA's alternative at an approximate op, a costing more)
    for up, down in [(0, 0), (1, 1), (2, 2), (3, 3)]:  # the batch split over data: the placement keeps it
        t.report(_specs(up, down, 0, 1), forks=0)
    assert (cache.flattened, cache.reused) == (1, 3)
    t.report(_specs(0, 0, 0, 0), forks=0)  # a whole batch: the placement now copies it, another flattening
    t.report(_specs(1, 2, 1, 0), forks=0)
    t.report(_specs(2, 1, 2, 1), forks=0)
    assert (cache.flattened, cache.reused) == (2, 5)


def test_scanned_loops_size_their_iteration_under_each_costing():
    t = _traced("scan")
    cache = PeakCache()
    peaks = set()
    # forks=0: counted per costing (a split weight's backward carry has two fixed points: a report also walks
    # XLA's other one, a costing more; rules_control.scan)
    for up in range(len(UP)):
        t.peak_cache = None
        plain = t.report(_specs(up, 0, 0, 1), forks=0).peak_bytes
        t.peak_cache = cache
        assert t.report(_specs(up, 0, 0, 1), forks=0).peak_bytes == plain
        peaks.add(plain)
    assert cache.flattened == 1 and cache.reused == len(UP) - 1
    assert len(peaks) > 1  # the layouts change the loop's bytes: a reuse that kept the first ones would fail


@pytest.mark.parametrize("tiling", ["dense", "tpu"])
def test_peak_bytes_with_and_without_a_cache_on_both_tilings(tiling):
    t = _traced("unrolled")
    cache = PeakCache()
    # The second layout's batch is split over (data, model): the placement to data copies it, a second flattening.
    for specs in [_specs(1, 1, 1, 1), _specs(2, 3, 2, 2), _specs(3, 2, 0, 1)]:
        walker = Walker(t.costs)
        env: dict = {}
        walker.walk(t.jaxpr, arg_layouts(t.args, specs, t.mesh), 1, None, env=env)
        plain = peak_bytes(t.jaxpr, env, walker.sub_envs, tiling=tiling)
        assert peak_bytes(t.jaxpr, env, walker.sub_envs, tiling=tiling, cache=cache) == plain
    assert (cache.flattened, cache.reused) == (2, 1)


def test_plans_are_the_same_with_and_without_the_cache(monkeypatch):
    """The planner's choice, its figures and every alternative's, on an Explicit mesh from jax.set_mesh."""
    import einshard
    from einshard._src.analysis.program.trace import TracedProgram
    from einshard.planner import SearchOptions

    params, x, labels = _shapes()
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    x, labels = jnp.ones(x.shape, x.dtype), jnp.zeros(labels.shape, labels.dtype)
    fn = jax.value_and_grad(lambda p, x, y: _loss(p, x, y, how="unrolled"))

    def run():
        with jax.set_mesh(jax.make_mesh((4, 2), ("data", "model"))):
            return einshard.plan(fn, params, x, labels, profile="h100", search=SearchOptions(max_evaluations=30))

    cached = run()
    original = TracedProgram.__init__

    def no_cache(self, *a, **k):
        original(self, *a, **k)
        self.peak_cache = None

    monkeypatch.setattr(TracedProgram, "__init__", no_cache)
    plain = run()
    assert cached.rules == plain.rules and cached.data_rules == plain.data_rules
    assert (cached.time_s, cached.memory_bytes) == (plain.time_s, plain.memory_bytes)
    assert [(a.time_s, a.memory_bytes) for a in cached.alternatives] == [
        (a.time_s, a.memory_bytes) for a in plain.alternatives
    ]


def test_a_max_pools_gradient_scratch_is_sized_under_each_costings_layouts():
    """The max pool gradient's expansion scratch (memory.window_scratch) depends on the layouts: a reused
    flattening sizes it again, as a fresh one would."""

    def loss(x):
        pooled = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.sum(pooled**2)

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        t = trace(jax.grad(loss), jax.ShapeDtypeStruct((8, 8, 8, 16), jnp.float32))
    cache = PeakCache()
    peaks = set()
    for spec in ["n h w c -> n h w c", "n h w c -> n@data h w c", "n h w c -> n@data h w c@model"]:
        t.peak_cache = None
        plain = t.report((spec,)).peak_bytes
        t.peak_cache = cache
        assert t.report((spec,)).peak_bytes == plain
        peaks.add(plain)
    assert cache.reused >= 1 and len(peaks) == 3


# -- dot operands copied transposed: one flattening for every answer of the gathered tests ------------------------


def _expert_mlp(x, wg, wu, wd):
    """A SwiGLU expert MLP (tests/test_memory_rules.py's): its gradient's cotangents are read by two dots in two
    orders, and its weights transposed by the backward's dots (memory._Program._copy_transposed)."""
    g = jnp.einsum("th,ehm->etm", x, wg)
    u = jnp.einsum("th,ehm->etm", x, wu)
    return jnp.einsum("etm,emh->eth", jax.nn.silu(g) * u, wd)


_TOKENS = ["t h -> t h", "t h -> t@a h", "t h -> t h@b", "t h -> t@b h@a"]
_IN_WEIGHTS = ["e h m -> e h m", "e h m -> e@a h m", "e h m -> e h@b m", "e h m -> e h m@b", "e h m -> e@a h m@b"]
_OUT_WEIGHTS = ["e m h -> e m h", "e m h -> e@a m h", "e m h -> e m@b h"]
_EXPERTS: dict[str, object] = {}


def _experts(profile: str | None = None):
    if profile not in _EXPERTS:
        sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)  # noqa: E731
        fn = jax.grad(lambda *a: jnp.sum(_expert_mlp(*a) ** 2), argnums=(0, 1, 2, 3))
        mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
        with jax.set_mesh(mesh):
            _EXPERTS[profile] = trace(fn, sds(64, 32), sds(4, 32, 64), sds(4, 32, 64), sds(4, 64, 32), profile=profile)
    return _EXPERTS[profile]


def _cost_every_split(t) -> PeakCache:
    """Cost tokens and experts split every way (60 costings) through a new cache, each equal to a fresh flattening's
    peak; the cache they filled."""
    t.peak_cache = cache = PeakCache()
    for x in _TOKENS:
        for w in _IN_WEIGHTS:
            for d in _OUT_WEIGHTS:
                fresh, cached = _fresh_and_cached(t, (x, w, w, d))
                assert cached == fresh, (x, w, d)
    return cache


def _fresh_and_cached(t, specs) -> tuple[int, int]:
    cache = t.peak_cache
    try:
        t.peak_cache = None
        fresh = t.report(specs, forks=0).peak_bytes
    finally:
        t.peak_cache = cache
    return fresh, t.report(specs, forks=0).peak_bytes


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    x=st.sampled_from(_TOKENS),
    up=st.sampled_from(_IN_WEIGHTS),
    gate=st.sampled_from(_IN_WEIGHTS),
    down=st.sampled_from(_OUT_WEIGHTS),
)
def test_an_absorbed_flattening_peaks_as_a_fresh_one(x, up, gate, down):
    """Drawn layouts (tokens, each weight) cost the same peak through the cache (kept across the draws: a variant
    absorbed into a flattening another costing made) as through a fresh flattening."""
    t = _experts()
    if t.peak_cache is None or not isinstance(t.peak_cache, PeakCache):
        t.peak_cache = PeakCache()
    fresh, cached = _fresh_and_cached(t, (x, gate, up, down))
    assert cached == fresh


def test_each_answer_of_the_gathered_tests_absorbs_the_one_flattening():
    """Tokens and experts split every way (60 costings): the transposed copies' gathered tests answer four ways
    (the cotangents and the weights each gathered for their dots or not), each a program of its own steps, all
    absorbed from one flattening of the jaxpr; each costing's peak equals a fresh flattening's."""
    cache = _cost_every_split(_experts())
    variants = [p for ps in cache.programs.values() for p in ps]
    answers = {tuple(g for _, _, g in p.gather_tested) for p in variants}
    assert cache.flattened == 1
    assert cache.absorbed == len(variants) == len(answers) >= 3
    assert len({len(p.steps) for p in variants}) >= 3  # the answers made other steps: the copies moved


def test_on_a_tpu_target_every_answer_of_the_gathered_tests_is_one_program():
    """The transposed copies are XLA:CPU's (memory.peak_bytes: the TPU compiler lays a dot's operand out for it), so
    on a TPU profile no dot operand is tested for its gathering: the same 60 costings as above reuse one flattening
    and one liveness (each costing's peak equal to a fresh flattening's), where XLA:CPU's make one per answer."""
    cache = _cost_every_split(_experts("tpu-v5p"))
    (variants,) = cache.programs.values()
    assert cache.flattened == cache.absorbed == len(variants) == 1
    assert variants[0].gather_tested == [] and not variants[0].copied_args
    # Nor does a dot hold a piece of an operand it slices (read in place there): no dot is sized again per costing.
    dots = [i for i, eqn, _ in variants[0].windows if eqn.primitive.name == "dot_general"]
    assert dots and set(dots) <= variants[0].fixed_scratch
    assert cache.reused == 60 - 1  # every costing after the first reuses it (a fresh twin runs without the cache)


# -- the window steps' scratch, shared between equations alike -----------------------------------------------------


def _programs_walked(monkeypatch) -> list:
    """The flattened programs peak memory walks from now on (memory._peak's, at the top level), in order."""
    from einshard._src.analysis.program import memory

    walked: list = []
    original = memory._peak

    def peak(prog, layouts, *a, **k):
        walked.append(prog)
        return original(prog, layouts, *a, **k)

    monkeypatch.setattr(memory, "_peak", peak)
    return walked


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    up=st.integers(0, len(UP) - 1),
    down=st.integers(0, len(DOWN) - 1),
    out=st.integers(0, len(OUT) - 1),
    batch=st.integers(0, len(BATCH) - 1),
)
def test_each_window_steps_scratch_is_window_scratch_under_its_costings_layouts(monkeypatch, up, down, out, batch):
    """Each dot's scratch through the memo (kept across the draws, shared by the unrolled layers' dots alike) is
    :func:`memory.window_scratch` of that dot read under the costing's own environment; and the layers' dots,
    equations alike on values of their own, are sized once per form and layouts, not once per dot."""
    from einshard._src.analysis.program import memory

    t = _traced("unrolled")
    if t.peak_cache is None:
        t.peak_cache = PeakCache()
    costed = _programs_walked(monkeypatch)
    sized: list = []  # the scratch sizings made (each logs its reads through a _Reads of its own)

    class Counted(memory._Reads):
        def __init__(self, env) -> None:
            super().__init__(env)
            sized.append(self)

    monkeypatch.setattr(memory, "_Reads", Counted)
    t.report(_specs(up, down, out, batch), forks=0)
    (prog,) = costed
    made = len(sized)
    dots = [(i, eqn, path) for i, eqn, path in prog.windows if eqn.primitive.name == "dot_general"]
    assert len(dots) >= 4 * L  # each layer's forward and backward dots
    # Each sizing's form, operands written transposed and the layouts it reads, in the order it reads them: a dot
    # whose operand is written transposed was sized before that too (when flattened), with none so.
    alike = set()
    for i, eqn, path in dots:
        absorbed = prog.absorbed.get(i, frozenset())
        expected = memory.window_scratch(eqn, prog.env(path), absorbed)
        assert prog.steps[i].inside == expected, (i, eqn)
        for asked in {absorbed, frozenset()}:
            log = memory._Reads(prog.env(path))
            memory.window_scratch(eqn, log, asked)  # type: ignore[arg-type]
            alike.add((memory._scratch_form(eqn), asked, tuple((type(k), type(lay), lay) for k, lay in log.read)))
    # The layers' dots are alike: sized once per form and layouts read (in a first costing too), not once per dot
    # (where the layers read other layouts, as the walk's settle over the first few, each is sized on its own).
    assert made <= len(alike)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    up=st.integers(0, len(UP) - 1),
    down=st.integers(0, len(DOWN) - 1),
    batch=st.integers(0, len(BATCH) - 1),
    width=st.sampled_from([16, 64, 256]),
    rows=st.sampled_from([8, 64]),
)
def test_the_ynn_reductions_settled_once_per_flattening_are_each_costings(monkeypatch, up, down, batch, width, rows):
    """Which reductions XLA:CPU runs as YNNPACK fusions (at least 4096 elements per device, operand or result) is
    settled once per flattening where no layout can change it: under drawn layouts and widths around the threshold
    (reductions over [rows, width] and [rows, width, 32], split up to 8 ways), the steps it names are those each
    costing's blocks name."""
    from einshard._src.analysis.program import memory

    def loss(w, x):
        h = jnp.tanh(x @ w["up"][0]) @ w["down"][0]
        return jnp.mean(h**2) + jnp.sum(jnp.max(h, axis=1)) + jnp.sum(jnp.einsum("bd,bf->bdf", x, h[:, :32]))

    stack = {
        "up": jax.ShapeDtypeStruct((1, width, F), jnp.float32),
        "down": jax.ShapeDtypeStruct((1, F, width), jnp.float32),
    }
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    with jax.set_mesh(mesh):
        t = trace(jax.value_and_grad(loss), stack, jax.ShapeDtypeStruct((rows, width), jnp.float32))
    costed = _programs_walked(monkeypatch)
    t.report(({"up": UP[up], "down": DOWN[down]}, BATCH[batch]), forks=0)
    (prog,) = costed
    each = frozenset(
        i
        for i, step in enumerate(prog.steps)
        if step.name in memory._YNN_REDUCTIONS
        and step.ins
        and step.outs
        and memory._floating(memory._aval(step.ins[0]))
        and max(memory._shard_elements(prog, step.ins[0]), memory._shard_elements(prog, step.outs[0]))
        >= memory._YNN_MIN_ELEMENTS
    )
    assert memory._ynn_reductions(prog) == each
    settled, asked = prog.step_facts["reductions"]
    assert settled | {i for i, _, _ in asked} >= each


def test_the_least_block_is_over_every_split_of_the_mesh_axes():
    from einshard._src.analysis.program.memory import _least_block

    assert _least_block((64, 2048), (4, 2)) == 64 * 2048 // 8
    # Floor division: both axes on one dimension of 5 leave 1 row of 5, one on each leave 2 x 2: the least is 4.
    assert _least_block((5, 5), (2, 2)) == 4
    assert _least_block((3, 7), (4,)) == 0  # 3 rows split 4 ways: a block of none
    assert _least_block((), (2, 2)) == 1  # a scalar is whole on every device
