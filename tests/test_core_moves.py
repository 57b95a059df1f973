"""The one layout algebra (einshard._src.core.moves), its pricing (einshard.analysis.cost.price) and the trusted
constructors (Layout/MeshAxis/Collective._derive), which validate what they build under EINSHARD_CHECKS=1."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import einshard
from einshard._src._checks import invariant_checks
from einshard._src.analysis.cost import PROFILES, RING_BYTES, Collective, price, transition
from einshard._src.core import moves
from einshard._src.core.layout import Layout, MeshAxis

MESH = (MeshAxis("data", 4), MeshAxis("model", 2))


@st.composite
def layout_pairs(draw: st.DrawFn) -> tuple[Layout, Layout]:
    """Two layouts of one tensor on one mesh (mesh axes of size 1 included); the target's pending sums are
    some of the source's, so a transition exists."""
    names = draw(st.sampled_from([("x",), ("x", "y"), ("x", "y", "z")]))
    mesh = tuple(MeshAxis(n, draw(st.sampled_from([1, 2, 4]))) for n in names)
    rank = draw(st.integers(1, 3))
    axes = tuple("abc"[:rank])

    def layout(within: frozenset[str] | None = None) -> Layout:
        dims: list[list[str]] = [[] for _ in axes]
        unreduced = set()
        for m in draw(st.permutations(names)):
            where = draw(st.sampled_from(["none", "split", "sum"]))
            if where == "split":
                dims[draw(st.integers(0, rank - 1))].append(m)
            elif where == "sum" and (within is None or m in within):
                unreduced.add(m)
        return Layout(axes, (64,) * rank, mesh, tuple(tuple(d) for d in dims), frozenset(unreduced))

    src = layout()
    return src, layout(src.unreduced)


@given(layout_pairs(), st.sampled_from([1, 2, 4]), st.sampled_from(sorted(PROFILES)))
def test_each_priced_collective_follows_the_ring_formulas(pair, itemsize, profile):
    """Bytes from the layouts' own per-device bytes (Layout.bytes_per_device, not price's loop) through the
    module doc's table; time from the profile; the record is what the move says (kind, axes, layouts)."""
    src, dst = pair
    after, found = moves.transition(src, dst)
    _, priced = transition(src, dst, itemsize=itemsize, profile=PROFILES[profile], tensor="t")
    assert len(found) == len(priced)
    for m, c in zip(found, priced, strict=True):
        local_in, local_out = m.before.bytes_per_device(itemsize), m.after.bytes_per_device(itemsize)
        n = m.group_size
        want_array, want_sent = {
            "all-gather": (local_out, (n - 1) / n * local_out),
            "reduce-scatter": (local_in, (n - 1) / n * local_in),
            "all-reduce": (local_in, 2 * (n - 1) / n * local_in),
            "all-to-all": (local_in, (n - 1) / n * local_in),
            "collective-permute": (min(local_in, local_out), min(local_in, local_out)),
        }[m.kind]
        assert (c.array_bytes, c.bytes) == (want_array, round(want_sent))
        assert (c.kind, c.axes, c.group_size, c.why, c.dim, c.to_dim, c.tensor) == (
            m.kind,
            m.axes,
            n,
            m.why,
            m.dim,
            m.to_dim,
            "t",
        )
        assert (c.before, c.after, c.operand) == (m.before, m.after, None)
        sizes = {a.name: a.size for a in src.mesh}
        per_axis = tuple(sizes[a] for a in m.axes)
        per_axis = per_axis if len(per_axis) and _prod(per_axis) == n else (n,)
        assert c.time == PROFILES[profile].collective_time(m.kind, n, c.bytes, c.array_bytes, per_axis)


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def test_every_collective_kind_has_a_formula():
    assert set(RING_BYTES) == set(einshard.analysis.KINDS)


def test_a_permute_that_moves_nothing_sends_nothing():
    lay = Layout(("a",), (16,), MESH, (("data", "model"),))
    _, move = moves.collective_permute(lay, lay.dims)
    c = price(move, itemsize=4)
    assert (move.axes, move.group_size, c.bytes, c.array_bytes) == ((), 1, 0, 4 * 16 // 8)


def test_a_regroup_prices_the_finer_split_s_blocks():
    """[c@x] → [c@y] with |x| = 4, |y| = 2: a permute of the x-blocks (4 bytes each, 16 one-byte elements
    over 4), then an all-gather over the remaining factor 2 of the y-blocks (8 bytes)."""
    a = Layout(("c",), (16,), (MeshAxis("x", 4), MeshAxis("y", 2)), (("x",),))
    b, found = moves.regroup(a, "c", ("x",), ("y",))
    priced = [price(m, itemsize=1) for m in found]
    assert b.dims == (("y",),)
    assert [(c.kind, c.group_size, c.array_bytes, c.bytes) for c in priced] == [
        ("collective-permute", 4, 4, 4),
        ("all-gather", 2, 8, 4),
    ]
    # the coarser source: [c@y] → [c@x] sends the finer x-blocks once, nothing to gather
    _, back = moves.regroup(b, "c", ("y",), ("x",))
    assert [(m.kind, m.group_size, price(m, itemsize=1).array_bytes) for m in back] == [("collective-permute", 4, 4)]


# -- the trusted constructors --------------------------------------------------------------------------------


def test_derive_validates_under_checks_and_trusts_otherwise():
    bad = (("a", "b"), (6, 4), MESH, (("data",), ()), frozenset())  # 6 does not split over data=4
    Layout._derive(*bad)  # trusted: the caller's promise, not re-checked (the analyzer's hot path)
    with invariant_checks(), pytest.raises(einshard.EinshardError, match="does not split over"):
        Layout._derive(*bad)
    with invariant_checks(), pytest.raises(einshard.EinshardError, match="sizes are positive integers"):
        MeshAxis._derive("data", 0)
    c = price(moves.all_gather(Layout(("a",), (8,), MESH, (("data",),)), ("data",))[1])
    values = dict(vars(c))
    assert Collective._derive(values) == c
    del values["why"]
    with invariant_checks(), pytest.raises(einshard.EinshardError, match="internal: Collective._derive"):
        Collective._derive(values)


def test_a_derived_layout_equals_the_validated_one():
    lay = Layout._derive(("a", "b"), (8, 4), MESH, (("data",), ("model",)), frozenset(), {"data": 4, "model": 2})
    assert lay == Layout(("a", "b"), (8, 4), MESH, (("data",), ("model",)))
    assert lay.mesh_sizes == {"data": 4, "model": 2} and lay.shard_shape == (2, 2)


CASES = [
    ("b@data x, x y@model -> b? y?", {"data": 4, "model": 2}, {"b": 64, "x": 128, "y": 256}),
    ("b x@(data,model), x@(data,model) y -> b? y?", {"data": 4, "model": 2}, {"b": 64, "x": 128, "y": 256}),
    ("b x@data, x y@model, y z -> b z@data", {"data": 2, "model": 4}, {"b": 32, "x": 64, "y": 64, "z": 128}),
    ("b s@data h, h f@model -> b s f", {"data": 1, "model": 2}, {"b": 4, "s": 16, "h": 32, "f": 64}),
    ("b x@data, x y -> b y@data {U:model}", {"data": 2, "model": 2}, {"b": 8, "x": 16, "y": 32}),
]


@pytest.mark.parametrize("expr, mesh, sizes", CASES)
def test_the_analyzer_builds_only_valid_layouts(expr, mesh, sizes):
    """Under EINSHARD_CHECKS every layout the analyzer derives (every candidate, move and resolution) is
    validated as Layout(...) validates it, and the plans are the ones the trusted path gives."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            einshard.clear_caches()
            want = einshard.analyze(expr, mesh=mesh, sizes=sizes)
            want_alternatives = want.alternatives
        except einshard.EinshardError as err:
            einshard.clear_caches()
            with invariant_checks(), pytest.raises(einshard.EinshardError, match=str(err.reason)[:30]):
                einshard.analyze(expr, mesh=mesh, sizes=sizes)
            return
        einshard.clear_caches()
        with invariant_checks():
            got = einshard.analyze(expr, mesh=mesh, sizes=sizes)
            got_alternatives = got.alternatives
    assert got == want and got_alternatives == want_alternatives
    einshard.clear_caches()


@given(layout_pairs())
def test_transition_builds_only_valid_layouts(pair):
    src, dst = pair
    with invariant_checks():
        try:
            got = moves.transition(src, dst)
        except einshard.EinshardError:
            assert dst.unreduced - src.unreduced
            return
    assert got == moves.transition(src, dst)


def test_the_checks_switch_on_from_the_environment():
    env = {**os.environ, "EINSHARD_CHECKS": "1"}
    code = "import einshard._src._checks as c; print(c.INVARIANTS)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_explain_builds_only_valid_layouts():
    """explain's walk copies and derives layouts per value (walker._private_copy, the costing's moves): under
    EINSHARD_CHECKS each is validated, and the report is the trusted path's."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))

    def loss(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    w = jax.ShapeDtypeStruct((32, 64), jnp.float32)
    x = jax.ShapeDtypeStruct((16, 32), jnp.float32)
    specs = (P(None, "model"), P("data", None))
    want = einshard.explain(jax.grad(loss), w, x, mesh=mesh, in_specs=specs, profile="cpu")
    with invariant_checks():
        got = einshard.explain(jax.grad(loss), w, x, mesh=mesh, in_specs=specs, profile="cpu")
    assert got.ops == want.ops and got.comm_bytes == want.comm_bytes and got.peak_bytes == want.peak_bytes
    assert got.comm_count == want.comm_count > 0


def test_explicit_collectives_in_a_shard_map_body_are_priced_by_the_same_formulas():
    """explain prices a shard_map body's psum / all_gather / psum_scatter / all_to_all / ppermute on the local
    block (16×32 float32 = 2048 bytes over data=4) with cost.RING_BYTES, the analyzer's table."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))

    def body(x):
        a = jax.lax.psum(x, "data")
        b = jax.lax.all_gather(x, "data", axis=0, tiled=True)
        c = jax.lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True)
        d = jax.lax.all_to_all(x, "data", 0, 1, tiled=True)
        e = jax.lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()

    f = jax.shard_map(body, mesh=mesh, in_specs=P("data", None), out_specs=P(), check_vma=False)
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    report = einshard.explain(f, x, mesh=mesh, in_specs=(P("data", None),), profile="cpu")
    got = [(c.kind, c.axes, c.group_size, c.bytes, c.array_bytes) for op in report.ops for c in op.collectives]
    assert got == [
        ("all-reduce", ("data",), 4, 3072, 2048),  # 2·(3/4)·2048
        ("all-gather", ("data",), 4, 6144, 8192),  # (3/4) of the gathered 8 KiB
        ("reduce-scatter", ("data",), 4, 1536, 2048),
        ("all-to-all", ("data",), 4, 1536, 2048),
        ("collective-permute", ("data",), 4, 2048, 2048),  # the block, once
    ]
    # on the profile the walk ranks on (Profile.walking: the cpu profile's, with the ring count), whose pricing is
    # the cpu profile itself
    walked = report.profile
    assert walked.latency_steps == "ring" and walked.collective_overhead == 0.0
    assert walked.pricing().latency_steps == PROFILES["cpu"].latency_steps and walked.walking() is walked
    for op in report.ops:
        for c in op.collectives:
            assert c.time == walked.collective_time(c.kind, 4, c.bytes, c.array_bytes)


@pytest.mark.parametrize(
    "src, dst",
    [
        ((("b", "c"), ()), (("a", "b"), ())),  # a concatenate joining rows@(b,c) onto rows@(a,b)
        ((("a",), ("b",)), (("b",), ("a",))),
        ((("a",), ("b",)), (("c",), ("a",))),
    ],
)
def test_same_blocks_on_other_devices_is_one_permute_as_xla(src, dst):
    """Every dimension split as many ways on both sides (other mesh axes): XLA's partitioner sends each block
    with one collective-permute (its reshard where the two tile grids have one shape), measured here."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard.testing import hlo

    axes = (MeshAxis("a", 2), MeshAxis("b", 2), MeshAxis("c", 2))
    lay = Layout(("x", "y"), (16, 16), axes, src)
    after, got = moves.transition(lay, lay.with_dims(dst))
    assert after.dims == dst
    moved = {m for sd, dd in zip(src, dst) if sd != dd for m in (*sd, *dd)}
    assert [(m.kind, m.group_size) for m in got] == [("collective-permute", 2 ** len(moved))]
    mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
    spec = lambda dims: P(*(d or None for d in dims))  # noqa: E731
    f = lambda u: jax.lax.with_sharding_constraint(u * 2, NamedSharding(mesh, spec(dst)))  # noqa: E731
    x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    compiled = jax.jit(f, in_shardings=NamedSharding(mesh, spec(src))).lower(x).compile()
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    assert [c.kind for c in found] == ["collective-permute"]
    assert found[0].array_bytes == 16 * 16 * 4 // 4


@pytest.mark.parametrize(
    "src, dst, kinds",
    [
        ((("b",), ()), (("a",), ("b",)), ["collective-permute"]),  # each [4, 8] block lies in one [8, 16] block
        ((("b",), ()), (("a",), ()), ["collective-permute"]),
        ((("b",), ()), ((), ("a", "b")), ["all-to-all"]),  # the rows' split gets coarser: not a permute
    ],
)
def test_a_finer_split_on_other_mesh_axes_is_sliced_and_permuted_as_xla(src, dst, kinds):
    """On (4, 2): where every dimension's target split refines the source's (as many blocks or a multiple), XLA
    slices each target block where a device holds it and sends it with one collective-permute of the block."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard.testing import hlo

    lay = Layout(("x", "y"), (16, 16), (MeshAxis("a", 4), MeshAxis("b", 2)), src)
    _, got = moves.transition(lay, lay.with_dims(dst))
    assert [m.kind for m in got] == kinds
    mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    spec = lambda dims: P(*(d or None for d in dims))  # noqa: E731
    f = lambda u: jax.lax.with_sharding_constraint(u * 2, NamedSharding(mesh, spec(dst)))  # noqa: E731
    x = jax.ShapeDtypeStruct((16, 16), jnp.float32)
    compiled = jax.jit(f, in_shardings=NamedSharding(mesh, spec(src))).lower(x).compile()
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    assert [c.kind for c in found] == kinds


def _layouts(names: tuple[str, ...], rank: int) -> list[tuple[tuple[str, ...], ...]]:
    """Every layout of a rank-``rank`` tensor over mesh axes ``names``: each mesh axis splits at most one
    dimension, in any order within it."""
    import itertools

    out = set()
    for k in range(len(names) + 1):
        for chosen in itertools.permutations(names, k):
            for cuts in itertools.combinations_with_replacement(range(k + 1), rank - 1):
                bounds = (0, *cuts, k)
                out.add(tuple(tuple(chosen[bounds[i] : bounds[i + 1]]) for i in range(rank)))
    return sorted(out)


MESH_SHAPES = {"4x2": ((4, 2), ("a", "b")), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}


def _xla_and_transition(mesh_key: str, src: tuple, dst: tuple) -> tuple[tuple, tuple]:
    """XLA's compiled reshard (jit in_shardings -> out_shardings of a float32 value, 16 per dimension in 2-D,
    8 in 3-D) and transition's priced collectives for the same pair: (kinds counted, bytes in all) each."""
    from collections import Counter

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from einshard.testing import hlo

    sizes, names = MESH_SHAPES[mesh_key]
    mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))
    shape = (16, 16) if len(src) == 2 else (8, 8, 8)
    spec = lambda dims: P(*(None if not d else d[0] if len(d) == 1 else d for d in dims))  # noqa: E731
    f = jax.jit(
        lambda u: u * 2, in_shardings=NamedSharding(mesh, spec(src)), out_shardings=NamedSharding(mesh, spec(dst))
    )
    found = [c for c in hlo.normalized(f.lower(jax.ShapeDtypeStruct(shape, jnp.float32)).compile().as_text())]
    found = [c for c in found if c.group_size > 1]
    axes = tuple(MeshAxis(n, k) for n, k in zip(names, sizes, strict=True))
    tensor = tuple("xyz"[: len(shape)])
    _, colls = transition(Layout(tensor, shape, axes, src), Layout(tensor, shape, axes, dst))
    want = (Counter(c.kind for c in found), sum(c.array_bytes for c in found))
    got = (Counter(c.kind for c in colls), sum(c.array_bytes for c in colls))
    return want, got


# One pair per rule of XLA's reshard that transition follows (each measured on its compiled HLO, held here again).
XLA_RESHARDS = [
    # a dimension an all-to-all fills gives up its other mesh axes first: all-gather b, then all-to-all a
    ("4x2", (("a",), ("b",)), ((), ("a",))),
    ("4x2", (("b",), ("a",)), (("a",), ())),
    # two dimensions trade their counts (4 and 2): one all-to-all by the factor 2, then a permute
    ("4x2", (("a",), ("b",)), (("b",), ("a",))),
    ("4x2", (("b",), ("a",)), (("a",), ("b",))),
    ("4x2", ((), ("a",), ("b",)), ((), ("b",), ("a",))),
    # ... or one hands a factor of its split to the other (8 and 1 ways to 2 and 4), after the free slices
    ("2x2x2", ((), ("a", "b", "c")), (("a",), ("c", "b"))),
    ("2x2x2", ((), ("a", "b")), (("a", "c"), ("b",))),
    # every dimension coarser or as split, over other mesh axes: a permute, then gathers by factors, the last first
    ("4x2", (("a",), ("b",)), (("b",), ())),
    ("4x2", (("b",), ("a",)), ((), ("b",))),
    ("2x2x2", (("a",), ("c",)), (("c",), ())),
    # the source's tiling shifted one dimension major-ward, its replicated axis splitting the last: the whole
    # block moved, then sliced (and its converse, slices first: the next pair)
    ("4x2", ((), ("a",)), (("a",), ("b",))),
    ("4x2", ((), (), ("a",)), ((), ("a",), ("b",))),
    ("4x2", ((), ("a",), ()), (("a",), ("b",), ())),
    # a dimension emptied before it is filled: no permute between the all-to-alls
    ("4x2", ((), ("a",), ("b",)), (("b",), (), ("a",))),
    # mesh axes fanning out of one dimension into two (counts no permutation of each other): gathered whole
    ("4x2", ((), (), ("a", "b")), (("a",), ("b",), ())),
    ("4x2", ((), ("a",), ("b",)), (("a", "b"), (), ())),
    # ... where the counts trade, all-to-alls and a permute
    ("2x2x2", ((), ("b",), ("a", "c")), (("c",), ("b", "a"), ())),
    # every dimension finer or as split over other mesh axes: one permute of the smaller (target's) block
    ("2x2x2", ((), ("b",)), (("c",), ("a",))),
]


@pytest.mark.parametrize("mesh_key, src, dst", XLA_RESHARDS)
def test_transition_is_xlas_reshard(mesh_key: str, src: tuple, dst: tuple) -> None:
    want, got = _xla_and_transition(mesh_key, src, dst)
    assert got == want


@pytest.mark.slow  # 110 compiles (about 25 s of CPU)
def test_every_reshard_on_a_4x2_mesh_is_xlas():
    """transition against XLA's compiled reshard (jit in_shardings -> out_shardings) for every ordered pair of
    2-D layouts on (4, 2): XLA's kinds and bytes, all 110."""
    import itertools

    layouts = _layouts(("a", "b"), 2)
    assert len(layouts) == 11
    differ = {
        (src, dst)
        for src, dst in itertools.permutations(layouts, 2)
        if (lambda w_g: w_g[0] != w_g[1])(_xla_and_transition("4x2", src, dst))
    }
    assert differ == set()


# The pairs where transition's collectives still differ from XLA's compiled reshard (kinds counted, bytes in all),
# with both, as measured on jax 0.10's XLA:CPU: of every 2-D pair on (4, 2) (110) and 3-D pair (342), and of 1200
# (of 2352) drawn 2-D pairs and 600 (of 11130) drawn 3-D pairs on (2, 2, 2), and the draws below.  On (4, 2) two
# remain; on (2, 2, 2) 113 and 143 (91% and 76% match): XLA's partitioner reshards by tile counts and device order,
# and its other patterns there (an all-to-all by a factor of a merged split, a permute after a partial gather, an
# all-to-all then a gather in one dimension) have no rule yet.
RESHARD_MISSES_FILE = os.path.join(os.path.dirname(__file__), "golden", "reshard_misses.json")


@functools.cache
def _known_misses() -> dict[tuple[str, tuple, tuple], str]:
    import json

    with open(RESHARD_MISSES_FILE) as f:
        rows = json.load(f)

    def dims(d: list) -> tuple:
        return tuple(tuple(x) for x in d)

    return {(r["mesh"], dims(r["src"]), dims(r["dst"])): r["xla"] for r in rows}


@st.composite
def reshard_pairs(draw: st.DrawFn) -> tuple[str, tuple, tuple]:
    mesh_key = draw(st.sampled_from(sorted(MESH_SHAPES)))
    rank = draw(st.sampled_from([2, 3]))
    layouts = _layouts(MESH_SHAPES[mesh_key][1], rank)
    src = draw(st.sampled_from(layouts))
    dst = draw(st.sampled_from([lay for lay in layouts if lay != src]))
    return mesh_key, src, dst


def _check_reshard(pair: tuple[str, tuple, tuple]) -> None:
    """transition's collectives are XLA's for the pair, or the pair is a listed miss (and still one)."""
    want, got = _xla_and_transition(*pair)
    listed = pair in _known_misses()
    assert (got != want) == listed, f"{pair}: XLA {want}, transition {got}, listed as a miss: {listed}"


@given(reshard_pairs())
@settings(max_examples=6, deadline=None, derandomize=True, database=None)
def test_a_drawn_reshard_is_xlas(pair):
    """3-D tensors and the (2, 2, 2) mesh too: a few drawn pairs against XLA's compiled reshard."""
    _check_reshard(pair)


@pytest.mark.slow  # about 100 compiles
@given(reshard_pairs())
@settings(max_examples=100, deadline=None, derandomize=True, database=None)
def test_drawn_reshards_are_xlas_but_the_listed_ones(pair):
    _check_reshard(pair)
