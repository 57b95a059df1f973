"""Dots on Explicit meshes whose result is *typed* (``out_sharding=``): JAX's type, not the propagation, names the
result's layout, and XLA brings the operands to it (an operand split on a free axis the type leaves whole is
gathered, one the type splits further is sliced).  Hypothesis draws small einsums on Explicit (4, 2) and
(2, 2, 2) meshes with drawn operand types and a drawn ``out_sharding``, and holds explain's collectives
(kinds, counts, bytes), peak and result layout against the compiled HLO and ``memory_analysis()``
(test_primitive_rules.check: XLA within the report's stated bound, zero where nothing is marked approximate)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, MESHES, Case, _mesh, check, specs_for

from einshard._src.analysis.program import trace

# einsum, operand shapes by letter; the letters' sizes divide by every mesh axis set (8 = 2 * 2 * 2 = 4 * 2).
EQUATIONS = ["mk,kn->mn", "mk,nk->mn", "km,kn->mn", "bmk,bkn->bmn", "bmk,kn->bmn"]
SIZES = {"m": 16, "k": 32, "n": 8, "b": 8}


def _einsum(equation: str, out: P) -> Any:
    return lambda x, y: jnp.einsum(equation, x, y, out_sharding=out)


@st.composite
def typed_dot(draw: Any) -> Case:
    equation = draw(st.sampled_from(EQUATIONS))
    rank = draw(st.sampled_from([2, 3]))
    sizes, names = MESHES[rank]
    inputs, result = equation.split("->")
    shapes = [tuple(SIZES[c] for c in side) for side in inputs.split(",")]
    specs = tuple(draw(specs_for(s, names, sizes)) for s in shapes)
    out = draw(specs_for(tuple(SIZES[c] for c in result), names, sizes))
    args = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    return Case("dot_general", _einsum(equation, out), args, specs, rank, True, False)


@FAST
@given(typed_dot())
def test_a_typed_dot_matches_xla(case: Case) -> None:
    check(case)


# Draws no rule reproduces yet (found by the deep run, each checked on its compiled HLO): listed, not hidden.
TYPED_DEEP_MISSES = (
    "the derandomized run's first failing draw once the operand swapped to its type is said so (below), the same "
    "before it: x[16, 32@b] . y[32@b, 8] typed [16@(a, b), 8] on (4, 2): XLA multiplies the whole [16, 8] partial "
    "product, all-reduces it over b and slices (its reduce-scatter, 512 B); explain slices x by a first and "
    "reduce-scatters the [4, 8] partial (128 B); "
    "x[16@b, 32] . y[32@a, 8] typed [16@a, 8@b] on (4, 2): XLA permutes and gathers 1024 B, explain 1536 B "
    "(explain's operand order, the dot partitioner's own; the same reshard alone, "
    "jit(in_shardings=[32@a, 8], out_shardings=[32, 8@b]), gathers 512 B as transition); "
    "operands split on a contraction one-sidedly (x[16, 32@a] . y[32, 8] typed [16@(c,b), 8] on (2, 2, 2)): XLA "
    "gathers x where explain sums partial products (the lone-contraction choice, unmarked on typed results); "
    "peak of a whole operand sliced to the type (below)"
)


@pytest.mark.slow
@pytest.mark.xfail(reason=TYPED_DEEP_MISSES, strict=False)
def test_a_typed_dot_matches_xla_deep() -> None:
    DEEP(given(typed_dot())(check))()


# The minimal programs behind the rule (each measured on its compiled HLO; check() holds them to it again).
MINIMAL = [
    # a free split the type drops: XLA gathers the operand (explain moved nothing)
    ("mk,kn->mn", (P("a", None), P(None, "b")), P(None, "b"), 2),
    ("mk,nk->mn", (P(("a", "b"), None), P()), P(), 2),
    # (peak: XLA slices the whole x to the result's split, a [4, 16, 32] buffer beside x: memory._sliced_operand)
    ("bmk,kn->bmn", (P(None, None, None), P(None, "a")), P("c", None, None), 3),
    # a contracted split whose mesh axis the type claims for a free factor: gathered directly (not through the
    # idle mesh axes, the route two clashing operands take)
    ("mk,kn->mn", (P(), P("b", None)), P("b", None), 2),
    ("mk,nk->mn", (P(None, "b"), P()), P(None, "b"), 3),
]


# An operand the type splits on another dimension over a group of another size (y[32@b, 8] for the type's
# [16@b, 8@a] on (4, 2)): explain slices it first and gathers 256 B, XLA's partitioner finds no direct path inside
# the program and gathers it whole, 1024 B ("involuntary full rematerialization"; the same pair between jit's in_
# and out_shardings is sliced first): the device order decides, so the report says so (movement.mark_swap).
SWAPPED = ("mk,kn->mn", (P(), P("b", None)), P("b", "a"), 2)


def test_an_operand_swapped_to_its_type_is_said_so() -> None:
    equation, specs, out, rank = SWAPPED
    inputs = equation.split("->")[0].split(",")
    args = tuple(jax.ShapeDtypeStruct(tuple(SIZES[c] for c in side), jnp.float32) for side in inputs)
    case = Case("dot_general", _einsum(equation, out), args, specs, rank, True, False)
    check(case)  # XLA's 1024 B within the stated bound
    mesh = _mesh(rank, True)
    with jax.set_mesh(mesh):  # (the case's arguments carry their layouts in their types)
        report = trace(case.fn, *case.args, mesh=dict(zip(mesh.axis_names, mesh.axis_sizes))).report(None)
    assert report.approximate_at and report.approximate_bound.bytes > 0


@pytest.mark.parametrize("equation, specs, out, rank", MINIMAL, ids=[str(i) for i in range(len(MINIMAL))])
def test_the_type_settles_the_operands(equation: str, specs: tuple[P, P], out: P, rank: int) -> None:
    inputs = equation.split("->")[0].split(",")
    args = tuple(jax.ShapeDtypeStruct(tuple(SIZES[c] for c in side), jnp.float32) for side in inputs)
    check(Case("dot_general", _einsum(equation, out), args, specs, rank, True, False))


# -- the draws widened: jax.sharding.reshard itself, after an elementwise op and after a reduction ---------------


@st.composite
def typed_reshard(draw: Any) -> Case:
    rank = draw(st.sampled_from([2, 3]))
    sizes, names = MESHES[rank]
    kind = draw(st.sampled_from(["reshard", "elementwise", "reduction"]))
    src = draw(specs_for((16, 16), names, sizes))
    dst = draw(specs_for((16,) if kind == "reduction" else (16, 16), names, sizes))
    if kind == "reshard":
        fn = lambda x: jax.sharding.reshard(x, dst)  # noqa: E731
    elif kind == "elementwise":
        fn = lambda x: jax.sharding.reshard(jnp.sin(x) * 2, dst)  # noqa: E731
    else:
        fn = lambda x: jax.sharding.reshard(jnp.sum(x, axis=0), dst)  # noqa: E731
    return Case(kind, fn, (jax.ShapeDtypeStruct((16, 16), jnp.float32),), (src,), rank, True, False)


# Found by the draws above (34 of 40 drawn programs match; each checked on its compiled HLO). No fast run: its
# derandomized draws meet the first of these (a reshard's peak), which no rule reproduces yet.
RESHARD_DEEP_MISSES = (
    "the derandomized run's first failing draw once a sum placed at a split matched (SUMS_PLACED below), peak only: "
    "x[16@c, 16@b] resharded to [16@(a, b, c), 16] on (2, 2, 2): two all-gathers, 1536 B, as XLA's; explain's peak "
    "768 B against XLA's 1924 B (beside the 256 B shard and the 128 B result XLA's temporaries are 1540 B: "
    "layout copies and both gathers' buffers, the whole [16, 16] among them; explain's 384 B); on (2, 2, 2), "
    "x[16@a, 16] resharded to [16, 16@b] or [16, 16@c] inside the program: XLA all-to-alls and permutes (1024 B), "
    "transition gathers (512 B), as XLA does for the same pair between jit's in_ and "
    "out_shardings (tests/test_primitive_rules_core.RESHARDS); [16@c, 16] to [16@b, 16@a]: one permute of 512 B "
    "where explain's carries 256 B, as XLA's does for that pair between jit's in_ and out_shardings "
    "(tests/test_core_moves.py): XLA's choice inside the program, not the pair's"
)


@pytest.mark.slow
@pytest.mark.xfail(reason=RESHARD_DEEP_MISSES, strict=False)
def test_a_reshard_on_explicit_axes_matches_xla_deep() -> None:
    DEEP(given(typed_reshard())(check))()


# A sum over split rows placed at a split (jax.sharding.reshard on Explicit axes, with_sharding_constraint on Auto
# ones): XLA all-reduces over the summed mesh axes and each device slices its piece.  Where every device of a group
# keeps its own piece (the split takes all the summed axes, with others or not), that is CPU's reduce-scatter;
# where they keep the same piece (the split is by other axes) an all-reduce and a local slice (the HLO reader's
# same_piece).  Then a permute where the piece is not the asked one.  Each measured on (2, 2, 2).
SUMS_PLACED = [
    (P("a", None), P("a")),  # a reduce-scatter over a
    (P("a", None), P("c")),  # an all-reduce over a, sliced by c: both devices of a group keep the same half
    (P("a", None), P(("b", "a"))),  # one reduce-scatter over a; b sliced locally
    (P(("a", "b"), None), P(("c", "a", "b"))),  # one reduce-scatter over (a, b)
    (P(("a", "b"), None), P(("c", "a"))),  # an all-reduce: b's two devices keep the same piece
    (P("a", "b"), P(("c", "a"))),  # a reduce-scatter to [16@(b, a)], then a permute
]


@pytest.mark.parametrize("explicit", [True, False], ids=["reshard", "constraint"])
@pytest.mark.parametrize("src, dst", SUMS_PLACED, ids=[f"{s}->{d}" for s, d in SUMS_PLACED])
def test_a_sum_placed_at_a_split_matches_xla(src: P, dst: P, explicit: bool) -> None:
    mesh = _mesh(3, explicit)
    if explicit:
        fn = lambda x: jax.sharding.reshard(jnp.sum(x, axis=0), dst)  # noqa: E731
    else:
        fn = lambda x: jax.lax.with_sharding_constraint(jnp.sum(x, axis=0), NamedSharding(mesh, dst))  # noqa: E731
    check(Case("reduction", fn, (jax.ShapeDtypeStruct((16, 16), jnp.float32),), (src,), 3, explicit, False))


# The reshards core.moves.transition took by mesh axes where XLA's partitioner goes by tile counts (on (4, 2), each
# measured on its compiled HLO; all seven were off at 3b3ef3e): explain's collectives, bytes and peak for
# jax.sharding.reshard of an elementwise result on Explicit axes, held to XLA's by check().
TILE_COUNT_RESHARDS = [
    (P(None, "a"), P("a", "b")),  # the source's tiling shifted one dimension: one all-to-all of the whole block
    (P("a", "b"), P(None, "a")),  # a dimension an all-to-all fills gathers first
    (P("b", "a"), P("a", None)),
    (P("a", "b"), P("b", "a")),  # counts traded: an all-to-all by the factor 2, then a permute
    (P("b", "a"), P("a", "b")),
    (P("a", "b"), P("b", None)),  # coarser everywhere: a permute, then gathers by factors
    (P("b", "a"), P(None, "b")),
]


@pytest.mark.parametrize("src, dst", TILE_COUNT_RESHARDS, ids=[f"{s}->{d}" for s, d in TILE_COUNT_RESHARDS])
def test_a_reshard_by_tile_counts_matches_xla(src: P, dst: P) -> None:
    fn = lambda x: jax.sharding.reshard(jnp.sin(x) * 2, dst)  # noqa: E731
    check(Case("elementwise", fn, (jax.ShapeDtypeStruct((16, 16), jnp.float32),), (src,), 2, True, False))
