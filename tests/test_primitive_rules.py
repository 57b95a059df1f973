"""Per-primitive differential property tests: explain's rule against what XLA compiles for the one-op program.

For each primitive with a rule that moves data on a split axis, hypothesis draws shapes, dtypes, the
primitive's parameters (axes, split points, k, padding, windows, strides, dilations, offsets) and a layout
over a 1-, 2- or 3-axis mesh of the 8 CPU devices, Auto or Explicit; the one-op program and its
``jax.grad`` are compiled and explain must

* follow every primitive (nothing in ``report.unfollowed``);
* name XLA's collectives, kinds and counts (CPU reduce-scatter ≡ all-reduce + dynamic-slice, loops
  counted per trip: :mod:`einshard.testing.hlo`), and their bytes within 10%;
* give the result the layout XLA gives it (the forward program's);
* estimate peak memory per device within the bounds below of ``compiled.memory_analysis()``;
* where the report is approximate (its first line says where XLA's choice turns on a heuristic explain does
  not reproduce), XLA's collectives, bytes and peak may differ from explain's only within the bound it states
  (``report.approximate_bound``), by the rule the external corpus holds reports to
  (:mod:`einshard._src.testing.bounds`); the result's layout is held to XLA's all the same.

A small fixed budget per primitive runs by default (derandomized, so the default run is the same every
time); ``@pytest.mark.slow`` runs many more examples per primitive.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from explain_counts import explained_collectives
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import coverage, trace
from einshard._src.analysis.program.memory import SCRATCH
from einshard._src.analysis.program.trace import arg_layouts
from einshard._src.analysis.program.walker import Walker
from einshard._src.testing.bounds import Measured, gaps, within_bound
from einshard.testing import hlo

MESHES: dict[int, tuple[tuple[int, ...], tuple[str, ...]]] = {
    1: ((8,), ("a",)),
    2: ((4, 2), ("a", "b")),
    3: ((2, 2, 2), ("a", "b", "c")),
}
FAST = settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
# The deep run is derandomized too, so that CI's verdict is the code's, not the draw's: other seeds
# (--hypothesis-seed with derandomize off) still find draws where XLA's choice turns on a heuristic no rule
# reproduces yet (a conv's reduce-scatter vs all-reduce, top_k k=1's scratch memory): docs/analysis.md lists them.
DEEP = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)
# Peak memory: explain / XLA.  XLA:CPU's convolutions and sorts take scratch buffers explain does not model
# (a conv gradient's temporaries are several times its operands), so windowed and sorting ops are held to a
# looser bound; the others to the corpus's 25%.
#
# "unfused": explain's liveness walk does not fuse pad/slice/split chains into their consumers as XLA does
# (a pad's gradient is a slice of the padded cotangent: explain holds both, up to 1.55× XLA's peak). A
# known gap of the memory walk (einshard/analysis/program/memory.py), bounded here so it cannot grow.
# Both are gaps of the memory walk, not of the rules: bounded here (from the drawn cases' measured ratios)
# so that they cannot grow unnoticed.
#
# "windows": a pool's or conv's gradient is both (scratch, and pad + reduce_window chains the walk holds whole).
# "branches": the walk counts a cond through its inputs and outputs; XLA allocates every branch's temporaries
# (measured down to 0.46 of XLA's peak).
MEMORY_BOUNDS = {
    "default": (0.75, 1.25),
    # top_k / sort / cumulative ops and windows: the ranges the report's peak caveat states (memory.SCRATCH), one source.
    "scratch": SCRATCH["top_k"][1:],
    "unfused": (0.5, 1.75),  # dynamic_slice's gradient on a split axis: XLA holds more, down to 0.53×
    "windows": SCRATCH["conv_general_dilated"][1:],
    "branches": SCRATCH["cond"][1:],
    # An all-to-all between an elementwise op's operands: XLA holds the moved operand's send and receive
    # buffers and the product, explain's walk fewer (measured 0.27-0.68x on sum(a * b, 0) and its gradient,
    # a[rows@a], b[cols@a]): a known gap of the memory walk the report does not state yet, bounded here so it
    # cannot grow.
    "moved": (0.25, 1.25),
}
SLACK_BYTES = 1024


@dataclass(frozen=True)
class Case:
    """One drawn one-op program: what runs, on what arguments, laid out how."""

    primitive: str
    fn: Callable[..., Any]
    args: tuple[jax.ShapeDtypeStruct, ...]
    specs: tuple[P, ...]
    mesh_rank: int
    explicit: bool
    grad: bool
    memory: str = "default"

    def __post_init__(self) -> None:
        # On Explicit axes the arguments carry their layout in their types, as users place them: every step of
        # check() (the compiled program, explain's trace, the result's typed layout) then types the same program.
        # Unplaced, jax.eval_shape typed another one: a dynamic_update_slice's update over 'a', which JAX refuses.
        # (Here, not in check(): hypothesis derives its derandomized draws from check()'s source.)
        if self.explicit and not any(getattr(a, "sharding", None) for a in self.args):
            mesh = _mesh(self.mesh_rank, True)
            placed = tuple(
                jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
                for a, s in zip(self.args, self.specs)
            )
            object.__setattr__(self, "args", placed)


@st.composite
def specs_for(draw: Any, shape: tuple[int, ...], names: tuple[str, ...], sizes: tuple[int, ...]) -> P:
    """A PartitionSpec for ``shape``: each mesh axis used at most once, each split dividing its dimension."""
    size_of = dict(zip(names, sizes))
    free = list(names)
    entries: list[Any] = []
    for size in shape:
        chosen = [m for m in free if draw(st.booleans())]
        if size % math.prod(size_of[m] for m in chosen):
            chosen = []  # that split would not divide: the dimension stays whole
        free = [m for m in free if m not in chosen]
        entries.append(None if not chosen else chosen[0] if len(chosen) == 1 else tuple(chosen))
    return P(*entries)


def _mesh(rank: int, explicit: bool) -> jax.sharding.Mesh:
    shape, names = MESHES[rank]
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, names, axis_types=(kind,) * rank)


def _loss(fn: Callable[..., Any], n_float: int) -> Callable[..., Any]:
    def loss(*args: Any) -> Any:
        out = fn(*args)
        leaves = [x for x in jax.tree.leaves(out) if jnp.issubdtype(x.dtype, jnp.floating)]
        return sum(jnp.sum(x.astype(jnp.float32) ** 2) for x in leaves)

    return jax.grad(loss, argnums=tuple(range(n_float)))


def _xla(case: Case, mesh: Any, fn: Callable[..., Any]) -> tuple[Counter, int, list[Any], float]:
    shardings = tuple(NamedSharding(mesh, s) for s in case.specs)
    with jax.set_mesh(mesh):
        if case.explicit:  # the layout is in the arguments' types, as users place them
            placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(case.args, shardings)]
            compiled = jax.jit(fn).lower(*placed).compile()
        else:
            compiled = jax.jit(fn, in_shardings=shardings).lower(*case.args).compile()
    text = compiled.as_text()
    kinds, sent = hlo.collective_counts(text), hlo.collective_bytes(text)  # normalized drops one-device groups
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    outs = [getattr(s, "spec", P()) for s in jax.tree.leaves(compiled.output_shardings)]
    return kinds, sent, outs, float(peak)


def _explain(case: Case, mesh: Any, fn: Callable[..., Any]) -> tuple[Any, Counter, int, list[tuple[Any, ...]]]:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    if case.explicit:
        args = tuple(
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s))
            for a, s in zip(case.args, case.specs)
        )
        with jax.set_mesh(mesh):
            program = trace(fn, *args, mesh=sizes)
            report = program.report(None)
    else:
        program = trace(fn, *case.args, mesh=sizes)
        report = program.report(case.specs)
    kinds, sent = explained_collectives(report)
    # (the report's last walk: its open values moved where XLA's propagation leaves them)
    return report, kinds, sent, list(report.output_dims)


def _spec_dims(spec: Any, rank: int) -> tuple[tuple[str, ...], ...]:
    entries = list(spec) + [None] * (rank - len(spec))
    return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _params(fn: Callable[..., Any]) -> dict[str, Any]:
    """The drawn parameters a case's function closes over (for the failure message)."""
    cells = fn.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(fn.__code__.co_freevars, cells) if not callable(c.cell_contents)}


def check(case: Case) -> None:
    """Compile the case's one-op program (or its gradient) and hold explain's report against it."""
    mesh = _mesh(case.mesh_rank, case.explicit)
    n_float = sum(1 for a in case.args if jnp.issubdtype(a.dtype, jnp.floating))
    fn = _loss(case.fn, n_float) if case.grad else case.fn
    try:
        want_kinds, want_sent, want_outs, want_peak = _xla(case, mesh, fn)
    except Exception as err:  # JAX refuses the program (Explicit axes an op has no sharding rule for)
        if case.explicit and "shard" in f"{type(err).__name__} {err}".lower():
            reject()  # nothing to compare: hypothesis draws another case instead
        raise
    report, got_kinds, got_sent, got_outs = _explain(case, mesh, fn)
    where = f"{case.primitive}{_params(case.fn)} {case.args} {case.specs} mesh {case.mesh_rank} explicit={case.explicit} grad={case.grad}"
    assert not report.unfollowed, where
    # Collectives, bytes and peak: XLA within the report's stated bound (zero when nothing is approximate), by
    # the rule the external corpus uses (einshard._src.testing.bounds). Peak is held to the family's measured
    # range of the memory walk (MEMORY_BOUNDS) beyond which only an approximate op's peak bound may reach.
    got = Measured(got_kinds, got_sent, report.peak_bytes)
    want = Measured(want_kinds, want_sent, want_peak)
    gap = gaps(got, want, peak_range=MEMORY_BOUNDS[case.memory], peak_slack=SLACK_BYTES)
    bound = report.approximate_bound
    assert within_bound(gap, bound), (
        where,
        gap,
        bound,
        (got_kinds, got_sent, report.peak_bytes),
        (want_kinds, want_sent, want_peak),
        report.approximate_at,
    )
    if not case.grad:
        # The result's layout is not part of any bound: XLA's must be explain's, approximate or not.
        with jax.set_mesh(mesh):  # a case written for Explicit axes names its result's PartitionSpec
            shapes = jax.tree.leaves(jax.eval_shape(case.fn, *case.args))
        for got_dims, spec, v in zip(got_outs, want_outs, shapes):
            rank = len(v.shape)
            sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
            got_split = tuple(
                d if v.shape[i] % math.prod(sizes[m] for m in d) == 0 else () for i, d in enumerate(got_dims)
            )
            assert got_split == _spec_dims(spec, rank), (where, got_dims, spec)


# -- the programs, one strategy per primitive ---------------------------------------------------------------

DIM = st.sampled_from([16, 24, 32, 64])


@st.composite
def layout(draw: Any, shapes: list[tuple[int, ...]]) -> tuple[int, bool, tuple[P, ...]]:
    rank = draw(st.sampled_from([1, 2, 3]))
    explicit = draw(st.booleans())
    _, names = MESHES[rank]
    sizes = MESHES[rank][0]
    return rank, explicit, tuple(draw(specs_for(s, names, sizes)) for s in shapes)


def _case(
    draw: Any, primitive: str, fn: Any, args: tuple[Any, ...], memory: str = "default", grad: bool | None = None
) -> Case:
    rank, explicit, specs = draw(layout([a.shape for a in args]))
    has_float = any(jnp.issubdtype(a.dtype, jnp.floating) for a in args)
    g = draw(st.booleans()) if grad is None and has_float else bool(grad)
    return Case(primitive, fn, args, specs, rank, explicit, g, memory)


@st.composite
def split_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    axis = draw(st.integers(0, 1))
    at = draw(st.integers(1, shape[axis] - 1))
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),)
    return _case(draw, "split", lambda x: jnp.split(x, [at], axis=axis), args, "unfused")


@st.composite
def rev_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    dims = draw(st.sampled_from([(0,), (1,), (0, 1)]))
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),)  # XLA holds the permute's receive buffer
    return _case(draw, "rev", lambda x: lax.rev(x, dims), args, "unfused")


@st.composite
def sort_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    axis = draw(st.integers(0, 1))
    arg = draw(st.booleans())
    fn = (lambda x: jnp.argsort(x, axis=axis)) if arg else (lambda x: jnp.sort(x, axis=axis))
    # float32 and int32 keys: XLA:CPU sorts bfloat16 as float32 (its all-to-alls carry twice the bytes explain
    # prices in bfloat16, which is what a GPU or TPU sends).
    dtype = draw(st.sampled_from([jnp.float32, jnp.int32]))
    grad = False if arg or dtype == jnp.int32 else None
    return _case(draw, "sort", fn, (jax.ShapeDtypeStruct(shape, dtype),), "scratch", grad=grad)


@st.composite
def top_k_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    k = draw(st.integers(1, 4))
    return _case(draw, "top_k", lambda x: lax.top_k(x, k), (jax.ShapeDtypeStruct(shape, jnp.float32),), "scratch")


@st.composite
def cumulative_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    axis = draw(st.integers(0, 1))
    reverse = draw(st.booleans())
    op = draw(st.sampled_from([lax.cumsum, lax.cummax, lax.cumprod, lax.cumlogsumexp]))
    return _case(
        draw,
        op.__name__,
        lambda x: op(x, axis=axis, reverse=reverse),
        (jax.ShapeDtypeStruct(shape, jnp.float32),),
        "scratch",
    )


@st.composite
def argmax_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    axis = draw(st.integers(0, 1))
    op = draw(st.sampled_from([jnp.argmax, jnp.argmin]))
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),)  # XLA:CPU holds the gathered candidates as scratch
    return _case(draw, "argmax", lambda x: op(x, axis=axis), args, "scratch", grad=False)


@st.composite
def pad_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    config = [(draw(st.integers(-2, 3)), draw(st.integers(-2, 3)), 0) for _ in shape]
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),)
    return _case(draw, "pad", lambda x: lax.pad(x, jnp.float32(0), config), args, "unfused")


@st.composite
def slice_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    start = [draw(st.integers(0, s - 1)) for s in shape]
    stop = [draw(st.integers(a + 1, s)) for a, s in zip(start, shape)]
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),)
    return _case(draw, "slice", lambda x: lax.slice(x, start, stop), args, "unfused")


@st.composite
def dynamic_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    size = [draw(st.integers(1, s)) for s in shape]
    update = draw(st.booleans())
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    i = jax.ShapeDtypeStruct((), jnp.int32)
    if update:
        fn = lambda x, i: lax.dynamic_update_slice(x, jnp.ones(size, x.dtype), (i, i))  # noqa: E731
        return _case(draw, "dynamic_update_slice", fn, (x, i), "unfused")
    return _case(draw, "dynamic_slice", lambda x, i: lax.dynamic_slice(x, (i, i), size), (x, i), "unfused")


@st.composite
def stack_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    axis = draw(st.integers(0, 2))
    if draw(st.booleans()):
        fn = lambda x: jnp.stack([x, 2 * x], axis=axis)  # noqa: E731
        return _case(draw, "stack", fn, (jax.ShapeDtypeStruct(shape, jnp.float32),), "unfused")
    at = draw(st.integers(0, shape[min(axis, 1)] - 1))
    fn = lambda x: jnp.unstack(x, axis=min(axis, 1))[at]  # noqa: E731
    return _case(draw, "unstack", fn, (jax.ShapeDtypeStruct(shape, jnp.float32),), "unfused")


@st.composite
def conv_case(draw: Any) -> Case:
    n, h, c, o = draw(st.sampled_from([4, 8])), draw(st.sampled_from([8, 16])), draw(st.sampled_from([4, 8])), 8
    k = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dil = draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["SAME", "VALID"]))

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(
            x, w, (stride, stride), padding, rhs_dilation=(dil, dil), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    args = (jax.ShapeDtypeStruct((n, h, h, c), jnp.float32), jax.ShapeDtypeStruct((k, k, c, o), jnp.float32))
    return _case(draw, "conv_general_dilated", conv, args, "windows")


@st.composite
def pool_case(draw: Any) -> Case:
    n, h, c = draw(st.sampled_from([4, 8])), draw(st.sampled_from([8, 16])), draw(st.sampled_from([4, 8]))
    win = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 3))
    padding = draw(st.sampled_from(["SAME", "VALID"]))
    kind = draw(st.sampled_from(["max", "sum"]))
    init, op = (-jnp.inf, lax.max) if kind == "max" else (0.0, lax.add)

    def pool(x: Any) -> Any:
        return lax.reduce_window(x, init, op, (1, win, win, 1), (1, stride, stride, 1), padding)

    return _case(draw, f"reduce_window_{kind}", pool, (jax.ShapeDtypeStruct((n, h, h, c), jnp.float32),), "windows")


@st.composite
def control_case(draw: Any) -> Case:
    shape = (draw(DIM), draw(DIM))
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    if draw(st.booleans()):
        axis = draw(st.integers(0, 1))

        def branch(x: Any) -> Any:
            return lax.cond(x.sum() > 0, lambda a: jnp.tanh(a).sum(axis), lambda a: a.max(axis), x)

        return _case(draw, "cond", branch, (x,), "branches")

    trips = draw(st.integers(1, 3))
    axis = draw(st.integers(0, 1))

    def loop(x: Any) -> Any:
        # A counted loop whose body sums its carry along a (maybe split) axis: an all-reduce per trip.
        def body(c: Any) -> Any:
            return c[0] + 1, c[1] + 0.1 * jnp.tanh(c[1]).sum(axis, keepdims=True)

        return lax.while_loop(lambda c: c[0] < trips, body, (0, x))[1]

    return _case(draw, "while", loop, (x,), "unfused", grad=False)


STRATEGIES: dict[str, Any] = {
    "split": split_case(),
    "rev": rev_case(),
    "sort": sort_case(),
    "top_k": top_k_case(),
    "cumulative": cumulative_case(),
    "argmax": argmax_case(),
    "pad": pad_case(),
    "slice": slice_case(),
    "dynamic_slice": dynamic_case(),
    "stack": stack_case(),
    "conv_general_dilated": conv_case(),
    "reduce_window": pool_case(),
    "control": control_case(),
}


@pytest.mark.parametrize("family", sorted(STRATEGIES))
def test_rule_matches_xla(family: str) -> None:
    FAST(given(STRATEGIES[family])(check))()


# The deep draws a rule does not yet hold to XLA (docs/analysis.md names them).  Not strict: the derandomized
# draws follow the code's own paths (a draw hypothesis rejects changes the sequence), so a change elsewhere can
# move a family's first failing draw past the budget; the misses are listed, not hidden.
DEEP_MISSES = {
    "conv_general_dilated": (
        "draws no rule reproduces yet (the CI draws of issue 20 fixed so far have tests in tests/test_conv_rules.py, "
        "session 14's 2x2 SAME conv with its window split like the rows among them): a 2x2 SAME conv, x (4, 8, 8, 4) "
        "cols@a against a kernel (2, 2, 4, 8) rows@c, cols@b on (2, 2, 2) (the derandomized deep run's first failing "
        "draw once the rows@c one was fixed; the same on main): XLA keeps the cols@a split, 3 permutes, an "
        "all-gather and an all-reduce, 12160 B, the result cols@a, where explain gathers all three splits (4864 B, "
        "the result whole), its bytes gap (7296 B) beyond its bound's 4.8 KiB; a dilation-2 1x1 conv (the dilation a "
        "no-op on a 1-wide window), x cols@b against kernel inputs@b on (4, 2): XLA moves the input (2 permutes, an "
        "all-to-all, an all-reduce, 11 KiB) where explain gathers the 128 B kernel through the idle 'a' as XLA does "
        "for the same conv undilated (a cost-model choice of XLA's that turns on the dilation)"
    ),
    # Peak only, both first seen in session 13's merged .ci/run: the collectives and bytes are XLA's; explain's peak
    # is above XLA's since the memory walk holds a gathered copy beside its argument's shard (session 13: exact
    # on FSDP programs, tests/test_fsdp_memory.py), where XLA reuses the dying copy for these ops' results.
    "dynamic_slice": (
        "lax.dynamic_slice(x, (i, i), (1, 1)), x (16, 24) on mesh 2, derandomized: one all-gather, 1536 B, as "
        "XLA's; explain's peak 3460 B against XLA's 1928 B (the gathered copy held beside x's shard and the slice)"
    ),
    "top_k": (
        "lax.top_k(x, 1), x (16, 32) P('a', 'b') on mesh 2, derandomized: two all-gathers, 2560 B, as XLA's; "
        "explain's peak 4608 B against XLA's 2944 B (the gathered copy held beside x's shard)"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=pytest.mark.xfail(reason=DEEP_MISSES[f], strict=False)) if f in DEEP_MISSES else f
        for f in sorted(STRATEGIES)
    ],
)
def test_rule_matches_xla_deep(family: str) -> None:
    DEEP(given(STRATEGIES[family])(check))()


# -- coverage: the traced primitive list, the registry and docs/coverage.md agree ---------------------------


def test_every_traced_primitive_has_a_rule_and_a_test() -> None:
    rows = coverage.rows()
    assert len(rows) > 100  # the traced list, not a hand-picked one
    missing = [r.primitive for r in rows if not r.rule]
    untested = [(r.primitive, r.rule) for r in rows if not r.test]
    assert not missing, f"primitives with no rule: {missing}"
    assert not untested, f"rules with no test: {untested}"
    for name in ("split", "top_k", "conv_general_dilated", "reduce_window_max", "select_and_scatter_add", "rev",
                 "sort", "cumsum", "argmax", "dynamic_slice", "dynamic_update_slice", "pad", "while", "cond"):  # fmt: skip
        assert name in coverage.primitives(), name
        assert coverage.rule_name(name) not in ("", "registry.call_rule"), name


def test_coverage_table_is_current() -> None:
    assert coverage.DOCS.read_text() == coverage.render(), (
        "docs/coverage.md is stale: run `python -m einshard.analysis.program.coverage`"
    )


def test_coverage_rules_run() -> None:
    """The small rules (bitcasts, tokens) follow their operand and move nothing, as XLA compiles them."""
    mesh = _mesh(2, False)
    x = jax.ShapeDtypeStruct((16, 8), jnp.float32)

    def f(a: Any) -> Any:
        same = lax.bitcast_convert_type(a, jnp.int32)
        halves = lax.bitcast_convert_type(a, jnp.uint16)  # (16, 8, 2): a minor axis appears
        return same, halves

    spec = P("a", "b")
    program = trace(f, x, mesh={"a": 4, "b": 2})
    report = program.report((spec,))
    outs = Walker(program.costs, quiet=True).walk(
        program.jaxpr, arg_layouts(program.args, (spec,), program.mesh), 1, None
    )
    with jax.set_mesh(mesh):
        compiled = jax.jit(f, in_shardings=(NamedSharding(mesh, spec),)).lower(x).compile()
    assert not report.unfollowed and report.comm_count == 0 == len(hlo.normalized(compiled.as_text()))
    assert [lay.dims for lay in outs] == [(("a",), ("b",)), (("a",), ("b",), ())]
    assert [s.spec for s in compiled.output_shardings] == [P("a", "b"), P("a", "b")]


@pytest.mark.slow
def test_primitive_list_is_what_tracing_finds() -> None:
    """primitives.json is tools/list_primitives.py's output for the installed libraries (regenerate on upgrades)."""
    import importlib.util
    import json
    import pathlib

    from einshard._src.analysis.program.registry import RULES

    path = pathlib.Path(__file__).resolve().parent.parent / "tools" / "list_primitives.py"
    spec = importlib.util.spec_from_file_location("list_primitives", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    found = set(module.collect())
    listed_on = json.loads(coverage.DATA.read_text())["jax"]
    if jax.__version__ != listed_on:
        # Another jax (CI's Python 3.12 run: jax 0.12) emits primitives the list's jax does not (one_minus_square,
        # log2, polynomial, reduce...): each must still have a rule, else explain says it is incomplete there.
        ruled = set(RULES) | coverage.CALLS
        assert found - ruled <= JAX_NEWER_UNRULED, sorted(found - ruled)
        return
    assert found == set(coverage.primitives()), found ^ set(coverage.primitives())


# -- conv: channel splits (the kernel's outputs split like the input's features) -----------------------------


@st.composite
def conv_channels_case(draw: Any) -> Case:
    """A conv whose input features are split like the kernel's outputs (a channel-split net's second conv):
    XLA gathers the input, or, with idle mesh axes holding more devices, moves it onto them and sums there."""
    rank = draw(st.sampled_from([1, 2, 3]))
    shape, names = MESHES[rank]
    axis = draw(st.sampled_from(names))
    if rank == 3 and draw(st.booleans()):
        split: Any = tuple(names[:2])  # over two axes of three: one idle axis of 2, fewer devices than the split
    else:
        split = axis
    n, h, c = draw(st.sampled_from([2, 8])), draw(st.sampled_from([4, 8])), draw(st.sampled_from([16, 32]))
    o = draw(st.sampled_from([c, 4 * c]))
    k, stride = draw(st.integers(1, 3)), draw(st.integers(1, 2))

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    args = (jax.ShapeDtypeStruct((n, h, h, c), jnp.float32), jax.ShapeDtypeStruct((k, k, c, o), jnp.float32))
    specs = (P(None, None, None, split), P(None, None, None, split))
    return Case("conv_general_dilated", conv, args, specs, rank, draw(st.booleans()), False, "windows")


def test_conv_channel_split_matches_xla() -> None:
    FAST(given(conv_channels_case())(check))()


@pytest.mark.slow
def test_conv_channel_split_matches_xla_deep() -> None:
    DEEP(given(conv_channels_case())(check))()


# -- conv: transposed (lhs_dilation, a strided conv's input gradient) on a split spatial axis ----------------


@st.composite
def transposed_conv_case(draw: Any) -> Case:
    n, h, c = draw(st.sampled_from([2, 4])), draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8]))
    k, dil = draw(st.integers(1, 3)), draw(st.integers(2, 3))
    pad = [(draw(st.integers(0, k)), draw(st.integers(0, k)))] * 2

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(
            x, w, (1, 1), pad, lhs_dilation=(dil, dil), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    args = (jax.ShapeDtypeStruct((n, h, h, c), jnp.float32), jax.ShapeDtypeStruct((k, k, c, 8), jnp.float32))
    return _case(draw, "conv_general_dilated", conv, args, "windows")


def test_transposed_conv_matches_xla() -> None:
    FAST(given(transposed_conv_case())(check))()


@pytest.mark.slow
def test_transposed_conv_matches_xla_deep() -> None:
    DEEP(given(transposed_conv_case())(check))()


# -- conv: the batch and the kernel's outputs split over the same mesh axes (FSDP kernels) -------------------


@st.composite
def conv_fsdp_case(draw: Any) -> Case:
    """A conv whose input batch and kernel outputs are split over the same mesh axis (an FSDP kernel split on
    its outputs against a data-parallel batch): XLA's propagation gives the result one of the two splits
    (the larger side of the result seen as batch·rows × features) and gathers the other operand."""
    rank = draw(st.sampled_from([1, 2, 3]))
    _, names = MESHES[rank]
    axis = draw(st.sampled_from(names))
    n, h = draw(st.sampled_from([8, 16])), draw(st.sampled_from([2, 3, 4, 8]))
    c, o = draw(st.sampled_from([4, 16, 64])), draw(st.sampled_from([8, 16, 64, 256]))
    k, stride = draw(st.sampled_from([1, 3])), draw(st.integers(1, 2))
    padding = draw(st.sampled_from(["SAME", "VALID"]))
    if padding == "VALID" and k > h:
        reject()

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(x, w, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))

    args = (jax.ShapeDtypeStruct((n, h, h, c), jnp.float32), jax.ShapeDtypeStruct((k, k, c, o), jnp.float32))
    specs = (P(axis), P(None, None, None, axis))
    # Forward only: a lone conv's gradient (no out_shardings asking for the kernel's split) lets XLA reuse the
    # forward's gathered kernel in the input gradient, which the rule marks approximate.
    return Case("conv_general_dilated", conv, args, specs, rank, draw(st.booleans()), False, "windows")


def test_conv_batch_against_kernel_outputs_matches_xla() -> None:
    FAST(given(conv_fsdp_case())(check))()


@pytest.mark.slow
def test_conv_batch_against_kernel_outputs_matches_xla_deep() -> None:
    DEEP(given(conv_fsdp_case())(check))()


# -- a partial sum whose gradient's consumer asks it split (reduce-scatter, not all-reduce) ------------------


def _sum_of_products(a: Any, b: Any) -> Any:
    return jnp.sum(a * b, 0)


def _squared_sum_grad(a: Any, b: Any) -> Any:
    # The issue's program, as written: the sum's square is differentiated with respect to ``a`` only.
    return jax.grad(lambda a, b: jnp.sum(jnp.sum(a * b, 0) ** 2))(a, b)


@st.composite
def partial_sum_case(draw: Any) -> Case:
    """``sum(a * b, 0)`` with ``a`` split on its rows and ``b`` on its columns over one mesh axis: the product
    is an all-to-all, the sum a partial sum whose gradient multiplies ``b`` again (broadcast along the rows
    through ``x ** 2``'s derivative): XLA reduce-scatters the sum to ``b``'s column split."""
    rank = draw(st.sampled_from([1, 2, 3]))
    axis = draw(st.sampled_from(MESHES[rank][1]))
    shape = (draw(DIM), draw(DIM))
    args = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2
    fn = draw(st.sampled_from([_sum_of_products, _squared_sum_grad]))
    return Case("reduce_sum", fn, args, (P(axis, None), P(None, axis)), rank, False, fn is _sum_of_products, "moved")


_ISSUE_CASE = Case(
    "reduce_sum",
    _squared_sum_grad,
    (jax.ShapeDtypeStruct((16, 32), jnp.float32),) * 2,
    (P("a", None), P(None, "a")),
    1,
    False,
    False,
    "moved",
)


def test_partial_sum_scattered_to_its_gradients_split() -> None:
    FAST(example(_ISSUE_CASE)(given(partial_sum_case())(check)))()
    # The issue's numbers, named: one all-to-all and one reduce-scatter (explain gave an all-reduce).
    mesh = _mesh(1, False)
    _, got_kinds, _, _ = _explain(_ISSUE_CASE, mesh, _squared_sum_grad)
    want_kinds, _, _, _ = _xla(_ISSUE_CASE, mesh, _squared_sum_grad)
    assert got_kinds == want_kinds == Counter({"all-to-all": 1, "reduce-scatter": 1}), (got_kinds, want_kinds)


@pytest.mark.slow
def test_partial_sum_scattered_to_its_gradients_split_deep() -> None:
    DEEP(given(partial_sum_case())(check))()


# -- deep draws that missed their bound, fixed by their rule (issue 20) --------------------------------------


def _slice_case(shape: tuple[int, int], start: tuple[int, int], stop: tuple[int, int], spec: P, rank: int) -> Case:
    fn = lambda x: lax.slice(x, start, stop)  # noqa: E731 -- _params reads the closure, as a drawn case's
    return Case("slice", fn, (jax.ShapeDtypeStruct(shape, jnp.float32),), (spec,), rank, False, False, "unfused")


# A result the whole split does not divide stays split over the longest leading part of the split's mesh axes
# that divides it (x[0, :4] of columns split over (a, b) of 4 x 2 keeps a; 12 of 16 rows too; over (a, b, c)
# of 2 x 2 x 2, 4 columns keep (a, b)); a row slice whose result blocks are smaller than the operand's, where XLA
# permutes whole operand blocks and holds their buffers (x[:22, :1] of 64 rows over b: XLA's peak 2.3x).
SLICE_DRAWS = [
    _slice_case((16, 16), (0, 0), (1, 4), P(None, ("a", "b")), 2),
    _slice_case((16, 16), (0, 0), (12, 1), P(("a", "b"), None), 2),
    _slice_case((16, 16), (0, 0), (1, 4), P(None, ("a", "b", "c")), 3),
    _slice_case((32, 16), (0, 0), (10, 16), P(("a", "b", "c"), None), 3),
    _slice_case((16, 16), (0, 0), (1, 2), P(None, ("b", "a")), 2),
    _slice_case((64, 16), (0, 0), (22, 1), P("b", None), 2),
]


@pytest.mark.parametrize("case", SLICE_DRAWS)
def test_slice_deep_draws(case: Case) -> None:
    check(case)


def _split_case(shape: tuple[int, int], at: int, axis: int, spec: P, rank: int, grad: bool) -> Case:
    fn = lambda x: jnp.split(x, [at], axis=axis)  # noqa: E731 -- _params reads the closure, as a drawn case's
    return Case("split", fn, (jax.ShapeDtypeStruct(shape, jnp.float32),), (spec,), rank, False, grad, "unfused")


# Every uneven piece of a split is moved on its own by XLA (explain's one gather serves them all); blocks smaller
# than the operand's: XLA holds the permutes' send and receive buffers.
SPLIT_DRAWS = [
    _split_case((16, 32), 17, 1, P(None, "a"), 1, True),
    _split_case((16, 64), 40, 1, P(None, "a"), 1, False),
    _split_case((16, 16), 3, 0, P("b", None), 2, False),
    _split_case((16, 16), 1, 1, P("a", "b"), 2, True),
]


@pytest.mark.parametrize("case", SPLIT_DRAWS)
def test_split_deep_draws(case: Case) -> None:
    check(case)


# A cumulative op's gradient is an associative scan (strided slices, interior pads): explain gathers the axis at
# the first strided slice, XLA keeps it split and moves pieces at every later level (22 permutes and 9
# all-to-alls for 16 rows over 8); the mark's bound counts those later positional ops and the values explain
# holds whole.
CUMULATIVE_DRAWS = [
    Case(
        "cummax",
        lambda x: lax.cummax(x, axis=0, reverse=False),
        (jax.ShapeDtypeStruct((16, 16), jnp.float32),),
        (P("a", None),),
        1,
        False,
        True,
        "scratch",
    ),
]


@pytest.mark.parametrize("case", CUMULATIVE_DRAWS)
def test_cumulative_deep_draws(case: Case) -> None:
    check(case)


def _strided_pool(stride: int) -> Callable[..., Any]:
    def pool(x: Any) -> Any:
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 1, 1), (1, stride, stride, 1), "SAME")

    return pool


@pytest.mark.parametrize("stride", [2, 3])
def test_strided_pool_on_uneven_rows_within_its_peak_bound(stride: int) -> None:
    """The deep run's draw: a window-1 max pool of rows@a over 8 devices, stride 2 or 3 (8 rows to 4 or 3, which do
    not divide): explain gathers the rows and pools them whole, XLA pools padded blocks and all-reduces the result;
    explain's peak (the gathered operand) is ~3x XLA's, within the bound the op's mark states."""
    x = jax.ShapeDtypeStruct((4, 8, 8, 4), jnp.float32)
    check(
        Case("reduce_window_max", _strided_pool(stride), (x,), (P(None, "a", None, None),), 1, False, False, "windows")
    )


def test_strided_pool_keeps_the_dividing_major_split() -> None:
    """The deep run's draw: 16 rows over (a, b) pooled with stride 3 to 6 rows, which divide over 'a' but not over
    (a, b): XLA keeps the result split over 'a' (it pools padded blocks, permutes them and gathers over 'b'); explain
    gathers over 'b' only and keeps 'a', the layout XLA gives."""
    x = jax.ShapeDtypeStruct((4, 16, 16, 4), jnp.float32)
    spec = P("c", ("a", "b"), None, None)
    check(Case("reduce_window_max", _strided_pool(3), (x,), (spec,), 3, False, False, "windows"))


def _padded(low: int, high: int, interior: int) -> Callable[..., Any]:
    def pad(x: Any) -> Any:
        return lax.pad(x, 0.0, [(0, 0, 0), (low, high, interior), (0, 0, 0)])

    return pad


def _strided(start: int, stride: int) -> Callable[..., Any]:
    def cut(x: Any) -> Any:
        return lax.slice(x, (0, start, 0), (x.shape[0], x.shape[1], x.shape[2]), (1, stride, 1))

    return cut


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize(
    ("primitive", "fn", "rows"),
    [
        ("pad", _padded(0, 1, 1), 16),
        ("pad", _padded(1, 0, 1), 16),
        ("pad", _padded(1, 1, 2), 16),
        ("slice", _strided(0, 2), 32),
        ("slice", _strided(1, 2), 32),
        ("slice", _strided(2, 4), 32),
    ],
)
def test_block_aligned_strides_stay_on_their_device(
    primitive: str, fn: Callable[..., Any], rows: int, rank: int
) -> None:
    """A stride or interior padding that maps each device's block onto the result's block on the same device (a
    pool's gradient pads its cotangent so: the deep run's draw, a sum pool of stride 2): XLA moves nothing and keeps
    the split; explain gathered the axis."""
    x = jax.ShapeDtypeStruct((4, rows, 4), jnp.float32)
    spec = P(None, "a", None) if rank == 1 else P("b", "a", None)
    check(Case(primitive, fn, (x,), (spec,), rank, False, False))
    _, kinds, _, outs = _explain(Case(primitive, fn, (x,), (spec,), rank, False, False), _mesh(rank, False), fn)
    assert not kinds and outs[0][1] == ("a",), (kinds, outs)


def _nhwc_conv(stride: int) -> Callable[..., Any]:
    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    return conv


@pytest.mark.parametrize(
    ("rank", "x_spec", "w_spec", "k", "stride", "grad", "h"),
    [
        # The deep run's draws: the kernel's outputs split like the input's rows (XLA keeps the kernel's split,
        # gathers the rows), forward and gradient; and a gradient whose kernel inputs are split like the rows.
        (1, P(None, "a", None, None), P(None, None, None, "a"), 1, 1, False, 8),
        (1, P(None, "a", None, None), P(None, None, None, "a"), 1, 1, True, 8),
        (1, P(None, "a", None, None), P(None, None, "a", None), 1, 1, True, 8),
        # The measured cases the rule is built on: columns, two-axis splits, strided 3x3 windows, idle axes.
        (1, P(None, None, "a", None), P(None, None, None, "a"), 1, 1, False, 16),
        (2, P("b", "a", None, None), P(None, None, None, "a"), 1, 1, False, 16),
        (2, P(None, ("a", "b"), None, None), P(None, None, None, "a"), 1, 1, False, 16),
        (2, P(None, "a", None, None), P(None, None, None, ("a", "b")), 1, 1, False, 16),
        (2, P(None, "a", "b", None), P(None, None, None, "a"), 1, 1, False, 16),
        (1, P(None, "a", None, None), P(None, None, None, "a"), 3, 2, False, 16),
        (3, P(None, "a", None, None), P(None, None, None, "a"), 3, 1, False, 16),
    ],
)
def test_conv_rows_against_kernel_outputs_on_one_axis(
    rank: int, x_spec: P, w_spec: P, k: int, stride: int, grad: bool, h: int
) -> None:
    c = 8 if w_spec[2] else 4
    args = (jax.ShapeDtypeStruct((4, h, h, c), jnp.float32), jax.ShapeDtypeStruct((k, k, c, 8), jnp.float32))
    check(Case("conv_general_dilated", _nhwc_conv(stride), args, (x_spec, w_spec), rank, False, grad, "windows"))


def _transposed(pad: list[tuple[int, int]], dil: int) -> Callable[..., Any]:
    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(
            x, w, (1, 1), pad, lhs_dilation=(dil, dil), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    return conv


def test_transposed_conv_keeps_the_kernels_free_major_split() -> None:
    """The deep run's draw: batch@c, rows@(a, b) dilated 4 -> 7 (gathered: uneven blocks), kernel outputs@(b, c):
    'c' clashes with the batch, 'b' is freed by the gathered rows; XLA keeps the result's features split over 'b'."""
    args = (jax.ShapeDtypeStruct((2, 4, 4, 4), jnp.float32), jax.ShapeDtypeStruct((1, 1, 4, 8), jnp.float32))
    specs = (P("c", ("a", "b"), None, None), P(None, None, None, ("b", "c")))
    check(Case("conv_general_dilated", _transposed([(0, 0), (0, 0)], 2), args, specs, 3, False, False, "windows"))


@pytest.mark.parametrize(
    ("pad", "w_spec"),
    [([(0, 1), (0, 1)], P(None, None, None, ("b", "c"))), ([(0, 1), (0, 1)], P(None, None, None, "b"))],
)
def test_transposed_conv_rows_give_the_kernel_its_axes(pad: list[tuple[int, int]], w_spec: P) -> None:
    """The deep run's draws: batch@c, rows@(a, b) dilated 4 -> 8 (even blocks) against kernel outputs@(b, c) or @b:
    XLA keeps the rows' 'a', the result's features@b (the kernel's axes not held by the batch)."""
    args = (jax.ShapeDtypeStruct((2, 4, 4, 4), jnp.float32), jax.ShapeDtypeStruct((1, 1, 4, 8), jnp.float32))
    specs = (P("c", ("a", "b"), None, None), w_spec)
    check(Case("conv_general_dilated", _transposed(pad, 2), args, specs, 3, False, False, "windows"))


def test_transposed_conv_gradient_within_its_bound() -> None:
    """The deep run's draw: the gradient of a transposed conv, batch@a, rows@b, kernel inputs@b, dilation 2: XLA
    keeps the rows split (halo permutes, an all-to-all, a reduce-scatter, a third all-gather) where explain gathers
    them; the marks' bound counts the all-to-all and reduce-scatter XLA's split rows bring."""
    args = (jax.ShapeDtypeStruct((4, 4, 4, 4), jnp.float32), jax.ShapeDtypeStruct((2, 2, 4, 8), jnp.float32))
    specs = (P("a", "b", None, None), P(None, None, "b", None))
    check(Case("conv_general_dilated", _transposed([(0, 1), (0, 1)], 2), args, specs, 2, False, True, "windows"))


# -- a max pool's gradient: XLA's select-and-scatter halos by its partitioner's formulas (issue 20) -----------


def _max_pool(win: int, stride: int, padding: str) -> Callable[..., Any]:
    def pool(x: Any) -> Any:
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, win, win, 1), (1, stride, stride, 1), padding)

    return pool


# XLA's select-and-scatter sends every shard the largest halo any shard needs, by linear formulas of the shard's
# first and limit windows, not each shard's own need; JAX's CPU / GPU lowering pads the operand before it and
# slices the result after it (their reshards permute across the padded length's uneven blocks, compactly where a
# halo is longer than twice the block); where no halo exchange fits, XLA replicates the padded operand.
POOL_GRADIENT_DRAWS = [
    # The deep run's draw: 16 rows over 2 pooled by 3 (blocks not a multiple of the stride), window 1 and 2:
    # three and two permutes where each shard's own windows need none.
    (16, 1, 3, "SAME", P(None, "b", None, None), 2),
    (16, 2, 3, "SAME", P(None, "b", None, None), 2),
    # Stride-1 padded windows: the pad's and the slice's compact exchanges (2 rows per device over 8).
    (16, 2, 1, "SAME", P(None, "a", None, None), 1),
    (16, 3, 1, "SAME", P(None, "a", None, None), 1),
    (16, 3, 2, "SAME", P(None, "a", None, None), 1),
    # One row per device: the select-and-scatter's halo reaches too far, XLA replicates the padded operand.
    (8, 2, 1, "SAME", P(None, "a", None, None), 1),
    (8, 3, 1, "SAME", P(None, "a", None, None), 1),
    # Two split axes, and a two-axis split of the rows (4 rows per device, 2 pooled rows).
    (16, 3, 1, "SAME", P(None, "a", "b", None), 2),
    (16, 2, 2, "SAME", P("c", ("a", "b"), None, None), 3),
    (16, 3, 2, "SAME", P(None, "b", None, None), 2),
]
# Pooled rows that do not divide over the split (XLA pools padded blocks): marked approximate, within the bound.
POOL_GRADIENT_UNEVEN_DRAWS = [
    (16, 2, 3, "VALID", P(None, None, "b", None), 2),
    (16, 3, 3, "VALID", P(None, "a", None, None), 3),
    (16, 2, 3, "SAME", P("c", ("a", "b"), None, None), 3),
    (8, 3, 1, "VALID", P("c", ("a", "b"), None, None), 3),
    # Explain gathers the uneven pool's rows; XLA keeps them split through the gradient's select-and-scatter
    # (7-11 permutes): the pool's bound counts those exchanges.
    (8, 3, 2, "VALID", P(None, "a", None, None), 1),
    (8, 3, 3, "SAME", P(None, "a", "b", None), 2),
    (16, 2, 3, "SAME", P(None, "a", None, None), 1),
]


@pytest.mark.parametrize(("h", "win", "stride", "padding", "spec", "rank"), POOL_GRADIENT_DRAWS)
def test_max_pool_gradient_halos_match_xla(h: int, win: int, stride: int, padding: str, spec: P, rank: int) -> None:
    x = jax.ShapeDtypeStruct((4, h, h, 4), jnp.float32)
    case = Case("reduce_window_max", _max_pool(win, stride, padding), (x,), (spec,), rank, False, True, "windows")
    check(case)
    mesh, fn = _mesh(rank, False), _loss(case.fn, 1)
    report, got, got_sent, _ = _explain(case, mesh, fn)
    assert not report.approximate_at, report.approximate_at  # exact: XLA's partitioner, modelled
    # Every permute, one-way ones included, and its bytes (the pad's carry the unpadded whole axes).
    want, want_sent, _, _ = _xla(case, mesh, fn)
    assert (got, got_sent) == (want, want_sent), (got, got_sent, want, want_sent)


@pytest.mark.parametrize(("h", "win", "stride", "padding", "spec", "rank"), POOL_GRADIENT_UNEVEN_DRAWS)
def test_max_pool_gradient_on_uneven_blocks_within_its_bound(
    h: int, win: int, stride: int, padding: str, spec: P, rank: int
) -> None:
    x = jax.ShapeDtypeStruct((4, h, h, 4), jnp.float32)
    check(Case("reduce_window_max", _max_pool(win, stride, padding), (x,), (spec,), rank, False, True, "windows"))


def test_max_pool_gradient_names_xlas_permutes() -> None:
    """The deep run's silent miss, named: 16 rows over 2 pooled by 3 with a 1-row window: XLA permutes one
    cotangent row and two plus one operand rows although every window lies in one block."""
    x = jax.ShapeDtypeStruct((4, 16, 16, 4), jnp.float32)
    case = Case("reduce_window_max", _max_pool(1, 3, "SAME"), (x,), (P(None, "b", None, None),), 2, False, True)
    fn = _loss(case.fn, 1)
    _, got, got_sent, _ = _explain(case, _mesh(2, False), fn)
    want, want_sent, _, _ = _xla(case, _mesh(2, False), fn)
    assert got == want == Counter({"collective-permute": 3}), (got, want)
    assert got_sent == want_sent, (got_sent, want_sent)


def test_transposed_conv_with_split_features_is_marked() -> None:
    """The deep run's silent draw: a dilation-2 transposed conv, padding (0, 1), cols@b, features@a, kernel inputs
    @(a, b): XLA replicates both operands (three all-gathers) where explain gathers the kernel over 'b' and
    all-reduces over 'a'; the op says so, its bound counting a gather per split axis."""
    args = (jax.ShapeDtypeStruct((2, 4, 4, 8), jnp.float32), jax.ShapeDtypeStruct((1, 1, 8, 8), jnp.float32))
    specs = (P(None, None, "b", "a"), P(None, None, ("a", "b"), None))
    case = Case("conv_general_dilated", _transposed([(0, 1), (0, 1)], 2), args, specs, 2, False, False, "windows")
    check(case)
    report, _, _, _ = _explain(case, _mesh(2, False), case.fn)
    assert report.approximate_at and report.approximate_bound.collectives >= 3, report.approximate_bound


def _dilated_conv(x: Any, w: Any) -> Any:
    return lax.conv_general_dilated(
        x, w, (1, 1), "VALID", rhs_dilation=(2, 2), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def test_dilated_conv_on_uneven_rows_against_kernel_outputs_within_its_bound() -> None:
    """The deep run's draw: rows@a over 8 of 16, a dilation-2 VALID 2x2 conv to 14 rows (uneven: explain gathers),
    kernel outputs@a: XLA keeps the rows split, 6 halo permutes, an all-to-all and a reduce-scatter (8 collectives
    where explain's one all-gather's bound allowed 7)."""
    args = (jax.ShapeDtypeStruct((4, 16, 16, 4), jnp.float32), jax.ShapeDtypeStruct((2, 2, 4, 8), jnp.float32))
    specs = (P(None, "a", None, None), P(None, None, None, "a"))
    check(Case("conv_general_dilated", _dilated_conv, args, specs, 1, False, False, "windows"))


def test_dilated_strided_conv_gradient_rows_against_kernel_outputs_within_its_bound() -> None:
    """The deep run's draw: the gradient of a dilation-2 SAME stride-2 2x2 conv, rows@a over 8 against kernel
    outputs@a: XLA gathers the rows by 7 permutes and moves kernel and result in the forward conv and again in its
    gradient (2 all-to-alls, 2 reduce-scatters): 11 collectives from explain's, which the mark's bound counts."""

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(
            x, w, (2, 2), "SAME", rhs_dilation=(2, 2), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    args = (jax.ShapeDtypeStruct((4, 16, 16, 4), jnp.float32), jax.ShapeDtypeStruct((2, 2, 4, 8), jnp.float32))
    specs = (P(None, "a", None, None), P(None, None, None, "a"))
    check(Case("conv_general_dilated", conv, args, specs, 1, False, True, "windows"))


def test_dilated_conv_gradient_on_uneven_rows_within_its_bound() -> None:
    """The deep run's next draw: the gradient of a dilation-2 VALID stride-2 2x2 conv, 16 rows@a over 8 to 7 (uneven:
    explain gathers), kernel outputs@a: XLA keeps the rows split through the forward conv and its gradient (11
    collectives from explain's), which the mark's bound counts."""

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(
            x, w, (2, 2), "VALID", rhs_dilation=(2, 2), dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    args = (jax.ShapeDtypeStruct((4, 16, 16, 4), jnp.float32), jax.ShapeDtypeStruct((2, 2, 4, 8), jnp.float32))
    specs = (P(None, "a", None, None), P(None, None, None, "a"))
    check(Case("conv_general_dilated", conv, args, specs, 1, False, True, "windows"))


# -- primitives newer jax emits (jax 0.12): a rule each, held against XLA on both jax releases -----------------

# Primitives jax 0.12's sweep finds that have no rule yet (explain leaves them unfollowed and says its report is
# incomplete: never silent). None today.
JAX_NEWER_UNRULED: frozenset[str] = frozenset()


def _primitive_names(jaxpr: Any) -> set[str]:
    """Every primitive a jaxpr runs, nested bodies included."""
    names, todo = set(), [jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr]
    while todo:
        for eqn in todo.pop().eqns:
            names.add(eqn.primitive.name)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = sub.jaxpr if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns") else sub
                    if hasattr(inner, "eqns"):
                        todo.append(inner)
    return names


@st.composite
def variadic_reduce_case(draw: Any) -> Case:
    """``lax.reduce`` over a tuple computation (jnp.minmax's on jax 0.12; any two-operand reducer on both): XLA
    all-gathers each result's per-device partials over a split reduced axis."""
    rank, explicit, (spec,) = draw(layout([(16, 32)]))
    dims = draw(st.sampled_from([(0,), (1,), (0, 1)]))

    def minmax(x: Any) -> Any:
        return lax.reduce((x, x), (jnp.inf, -jnp.inf), lambda a, b: (lax.min(a[0], b[0]), lax.max(a[1], b[1])), dims)

    args = (jax.ShapeDtypeStruct((16, 32), jnp.float32),)
    return Case("reduce", minmax, args, (spec,), rank, explicit, False, "scratch")


@example(
    Case(
        "reduce",
        lambda x: lax.reduce((x, x), (0.0, 0.0), lambda a, b: (a[0] + b[0], lax.max(a[1], b[1])), (1,)),
        (jax.ShapeDtypeStruct((16, 32), jnp.float32),),
        (P(None, "a"),),
        2,
        False,
        False,
    )
)
@example(
    Case(
        "reduce",
        lambda x: lax.reduce((x, x), (0.0, 0.0), lambda a, b: (a[0] + b[0], lax.max(a[1], b[1])), (1,)),
        (jax.ShapeDtypeStruct((16, 32), jnp.float32),),
        (P("a", "b"),),
        2,
        False,
        False,
    )
)
@given(variadic_reduce_case())
@FAST
def test_variadic_reduce_matches_xla(case: Case) -> None:
    check(case)


NEWER_ELEMENTWISE = [
    ("polynomial", lax.erf),  # jax 0.12 evaluates erf's polynomial as one primitive
    ("polynomial", lambda x: jnp.polyval(jnp.arange(1.0, 4.0), x)),
    ("log2", jnp.log2),
    ("one_minus_square", jnp.tanh),  # its gradient
    ("polynomial", lambda x: jax.nn.gelu(x, approximate=False)),
    # jax 0.12's "hijax" calls: walked through their expansion (rules_control.hi_primitive)
    # (frexp's gradient is held by its collectives only in test_hi_primitive_gradient_moves_nothing: the memory
    # walk does not fuse an expansion, explain's peak reads 3.5x XLA's on a one-op program)
    ("call_hi_primitive", lambda x: jnp.frexp(x)[0] + 1.0),
    ("call_hi_primitive", lambda x: jnp.ldexp(x, 3)),
]


@pytest.mark.parametrize("name, fn", NEWER_ELEMENTWISE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(NEWER_ELEMENTWISE)])
@pytest.mark.parametrize("spec", [P("a", "b"), P(None, ("a", "b"))], ids=["rows-cols", "cols"])
def test_newer_jax_elementwise_primitives_match_xla(name: str, fn: Any, spec: P) -> None:
    """Elementwise on any jax: nothing moves, forward and gradient, on the jax that runs (these primitives appear
    on jax 0.12; on jax 0.10 the same functions trace to older elementwise ones)."""
    args = (jax.ShapeDtypeStruct((16, 32), jnp.float32),)

    def op(x: Any) -> Any:
        return fn(x)

    if name not in _primitive_names(jax.make_jaxpr(jax.grad(lambda x: jnp.sum(op(x))))(*args)):
        # jax 0.10 traces these functions to older primitives, held by their own tests (a lone lax.erf on a split
        # array is a known jax 0.10 miss: its XLA gathers it whole, docs/analysis.md).
        pytest.skip(f"{name} is not emitted by jax {jax.__version__}")

    for grad in (False, True):
        check(Case(name, op, args, (spec,), 2, False, grad))


def test_hi_primitive_gradient_moves_nothing() -> None:
    """frexp's gradient through its expansion on a split array: no collective, like XLA's."""

    def loss(x: Any) -> Any:
        mantissa, exponent = jnp.frexp(x)
        return jnp.sum(mantissa * exponent)

    mesh = _mesh(2, False)
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss), in_shardings=NamedSharding(mesh, P("a", "b"))).lower(x).compile()
    report = trace(jax.grad(loss), x, mesh={"a": 4, "b": 2}).report((P("a", "b"),))
    assert report.complete and not report.unfollowed
    assert report.comm_count == 0 == len(hlo.normalized(compiled.as_text()))


# -- conv: feature-grouped (depthwise: feature_group_count = channels, or two groups) -------------------------


@st.composite
def grouped_conv_case(draw: Any) -> Case:
    """A grouped conv on any layout (session 16's probe: an Equinox depthwise block under FSDP was silent).
    Features and kernel outputs split alike into whole groups stay split; other splits are gathered and the op
    says XLA may move them instead (all-to-alls), within its bound."""
    n, h, c = draw(st.sampled_from([4, 8])), draw(st.sampled_from([4, 8])), draw(st.sampled_from([8, 16]))
    groups = draw(st.sampled_from([c, 2]))
    k = draw(st.integers(1, 3))

    def conv(x: Any, w: Any) -> Any:
        return lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups
        )

    args = (jax.ShapeDtypeStruct((n, h, h, c), jnp.float32), jax.ShapeDtypeStruct((k, k, c // groups, c), jnp.float32))
    return _case(draw, "conv_general_dilated", conv, args, "windows")


def test_grouped_conv_matches_xla_or_says_so() -> None:
    FAST(given(grouped_conv_case())(check))()
