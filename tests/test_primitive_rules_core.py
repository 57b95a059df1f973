"""Per-primitive differential property tests for the primitives every model is made of (issue 20).

The machinery is tests/test_primitive_rules.py's (:func:`check` compiles the one-op program or its
``jax.grad`` on a 1-, 2- or 3-axis mesh, Auto or Explicit, and holds explain's collectives, bytes, result
layout and peak memory against XLA's compiled HLO and ``memory_analysis()``); this file draws the core
primitives' programs:

* ``dot_general`` with general dimension numbers: batch dimensions, one or two contracting dimensions, free
  dimensions on either side, the operands' dimensions in any order, split on any of them, bfloat16 or float32;
* reductions (``reduce_sum`` / ``reduce_max`` / ``reduce_min``, and ``mean``) over one or several axes, kept or
  not, split or not;
* ``reshape``: dimensions merged and split around where a split axis lands;
* ``transpose``, ``broadcast_in_dim`` (new dimensions, size-1 dimensions expanded), ``convert_element_type``
  followed by an op, ``squeeze`` / ``expand_dims``;
* elementwise ops of a full operand and one with size-1 dimensions lax broadcasts implicitly (``x / s`` of a
  softmax's ``s = sum(x, keepdims=True)``), either side, split or not.

Each family: a small derandomized budget in the default run, a deep ``@pytest.mark.slow`` run.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, MEMORY_BOUNDS, MESHES, Case, _case, check

# XLA:CPU computes 16-bit floats in f32: it holds an f32 copy of each bf16 operand and result around the ops
# that read them (a bf16 dot's operands and product, a reduction's accumulator), which the memory walk does not
# model (measured down to 0.34 of XLA's peak on the gradient of a bf16 vector dot). A known gap of the memory
# walk (einshard/_src/analysis/program/memory.py), bounded here so that it cannot grow; collectives, bytes (XLA:CPU
# moves bf16 as f32: Profile.narrow_floats) and layouts are held exactly.
MEMORY_BOUNDS.setdefault("narrow", (0.3, 1.25))
# Dimensions small enough that a rank-4 operand compiles quickly; 24 splits over 8 but not 16, 12 over 4 not 8.
SMALL = st.sampled_from([8, 12, 16, 24, 32])
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])


def _struct(shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _memory(*dtypes: Any) -> str:
    """The peak bound a case is held to: the known bf16 gap where a 16-bit float is computed, else the default."""
    return "narrow" if any(jnp.dtype(d).itemsize < 4 for d in dtypes) else "default"


# -- dot_general ------------------------------------------------------------------------------------------------


@st.composite
def dot_general_case(draw: Any) -> Case:
    """``lax.dot_general`` with ``nb`` batch, ``nc`` contracting and free dimensions on each side, every operand's
    dimensions in a drawn order (so batch and contracting dimensions are not always leading or trailing)."""
    nb = draw(st.integers(0, 1))
    nc = draw(st.integers(1, 2))
    nl = draw(st.integers(0, 2 if nb + nc < 3 else 1))
    nr = draw(st.integers(0, 1 if nl else 2))
    batch = [draw(SMALL) for _ in range(nb)]
    contract = [draw(SMALL) for _ in range(nc)]
    free_l = [draw(SMALL) for _ in range(nl)]
    free_r = [draw(SMALL) for _ in range(nr)]
    # Logical order: batch, contracting, free; the drawn permutation places them in the operand.
    lhs_logical = batch + contract + free_l
    rhs_logical = batch + contract + free_r
    lperm = draw(st.permutations(range(len(lhs_logical))))
    rperm = draw(st.permutations(range(len(rhs_logical))))
    lhs_shape = tuple(lhs_logical[p] for p in lperm)
    rhs_shape = tuple(rhs_logical[p] for p in rperm)
    where_l = {p: i for i, p in enumerate(lperm)}  # logical index -> position in the operand
    where_r = {p: i for i, p in enumerate(rperm)}
    lb = tuple(where_l[k] for k in range(nb))
    rb = tuple(where_r[k] for k in range(nb))
    lc = tuple(where_l[nb + k] for k in range(nc))
    rc = tuple(where_r[nb + k] for k in range(nc))
    dimension_numbers = ((lc, rc), (lb, rb))
    dtype = draw(DTYPES)

    def dot(x: Any, y: Any) -> Any:
        return lax.dot_general(x, y, dimension_numbers)

    return _case(draw, "dot_general", dot, (_struct(lhs_shape, dtype), _struct(rhs_shape, dtype)), _memory(dtype))


# -- reductions -------------------------------------------------------------------------------------------------

REDUCERS = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min, "mean": jnp.mean}


@st.composite
def reduction_case(draw: Any) -> Case:
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(SMALL) for _ in range(rank))
    axes = tuple(sorted(draw(st.sets(st.integers(0, rank - 1), min_size=1))))
    keepdims = draw(st.booleans())
    kind = draw(st.sampled_from(sorted(REDUCERS)))
    op = REDUCERS[kind]
    dtype = draw(DTYPES)

    def reduce(x: Any) -> Any:
        return op(x, axis=axes, keepdims=keepdims)

    return _case(draw, f"reduce_{kind}", reduce, (_struct(shape, dtype),), _memory(dtype))


# -- reshape ----------------------------------------------------------------------------------------------------


def _groups(draw: Any, n: int) -> list[int]:
    """A composition of ``n`` factors into consecutive groups (their sizes)."""
    cuts = sorted(draw(st.sets(st.integers(1, n - 1))) if n > 1 else set())
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def _merge(factors: list[int], groups: list[int]) -> tuple[int, ...]:
    out, i = [], 0
    for g in groups:
        out.append(math.prod(factors[i : i + g]))
        i += g
    return tuple(out)


@st.composite
def reshape_case(draw: Any) -> Case:
    """A reshape between two groupings of the same factors (dimensions merged, split, or both), now and then with a
    size-1 dimension inserted; the input's split lands on a group's major or minor part."""
    n = draw(st.integers(2, 4))
    factors = [draw(st.sampled_from([2, 3, 4, 8])) for _ in range(n)]
    src = list(_merge(factors, _groups(draw, n)))
    dst = list(_merge(factors, _groups(draw, n)))
    if draw(st.booleans()):
        dst.insert(draw(st.integers(0, len(dst))), 1)
    if src == dst:
        dst = [math.prod(dst)]  # flatten: always a reshape
    if math.prod(src) < 64:
        src, dst = [4, *src], [4, *dst]  # enough elements for a 3-axis split
    out = tuple(dst)

    def reshape(x: Any) -> Any:
        return jnp.reshape(x, out)

    return _case(draw, "reshape", reshape, (_struct(tuple(src)),))


# -- transpose, broadcast_in_dim, convert_element_type, squeeze / expand_dims --------------------------------


@st.composite
def transpose_case(draw: Any) -> Case:
    rank = draw(st.integers(2, 3))
    shape = tuple(draw(SMALL) for _ in range(rank))
    perm = tuple(draw(st.permutations(range(rank)).filter(lambda p: list(p) != sorted(p))))  # a transpose is emitted
    if draw(st.booleans()):
        # A transpose and an op that reads both layouts (q @ k.T's shape of things): the operand meets itself.
        def fn(x: Any) -> Any:
            return jnp.tanh(jnp.transpose(x, perm))

    else:

        def fn(x: Any) -> Any:
            return jnp.transpose(x, perm)

    dtype = draw(DTYPES)
    return _case(draw, "transpose", fn, (_struct(shape, dtype),), _memory(dtype))


@st.composite
def broadcast_case(draw: Any) -> Case:
    """``broadcast_in_dim`` from a rank-1/2 operand (some dimensions size 1, expanded) into a rank-2/3 result with
    new dimensions, added to a full-size operand (a bias, a norm scale) or returned alone."""
    out_rank = draw(st.integers(2, 3))
    out_shape = tuple(draw(SMALL) for _ in range(out_rank))
    in_rank = draw(st.integers(1, out_rank))
    kept = tuple(sorted(draw(st.sets(st.integers(0, out_rank - 1), min_size=in_rank, max_size=in_rank))))
    in_shape = tuple(1 if draw(st.integers(0, 3)) == 0 else out_shape[k] for k in kept)
    if in_shape == out_shape:
        in_shape = (1, *in_shape[1:])  # a broadcast of the same shape is no op at all (the program returns x)
    if in_shape != out_shape and draw(st.booleans()):
        # (a same-shape operand would be an elementwise mix of two layouts: another family's)

        def bias(x: Any, b: Any) -> Any:
            return x + lax.broadcast_in_dim(b, out_shape, kept)

        return _case(draw, "broadcast_in_dim", bias, (_struct(out_shape), _struct(in_shape)))

    def bcast(b: Any) -> Any:
        return lax.broadcast_in_dim(b, out_shape, kept)

    return _case(draw, "broadcast_in_dim", bcast, (_struct(in_shape),))


@st.composite
def size1_broadcast_case(draw: Any) -> Case:
    """An elementwise op of a full operand and one of the same rank with some dimensions of size 1, which lax
    broadcasts implicitly (``x / s`` of a softmax's ``s = sum(x, keepdims=True)``, a router's weights times its
    per-token scale): the small operand's splits along the dimensions it spans are the result's factors too."""
    rank = draw(st.integers(2, 3))
    shape = tuple(draw(SMALL) for _ in range(rank))
    ones = draw(st.sets(st.integers(0, rank - 1), min_size=1, max_size=rank - 1))
    small = tuple(1 if k in ones else n for k, n in enumerate(shape))
    op = draw(st.sampled_from((lax.mul, lax.add, lax.div, lax.max)))
    first = draw(st.booleans())  # which side the small operand is on

    def fn(x: Any, s: Any) -> Any:
        return op(x, s) if first else op(s, x)

    return _case(draw, op.__name__, fn, (_struct(shape), _struct(small)))


FOLLOWERS = ("tanh", "sum", "mul", "matmul")


@st.composite
def convert_case(draw: Any) -> Case:
    """``convert_element_type`` (float32 <-> bfloat16) and the op that reads the converted value: the collectives
    after it carry the new dtype's bytes."""
    shape = (draw(SMALL), draw(SMALL))
    src, dst = draw(st.sampled_from([(jnp.float32, jnp.bfloat16), (jnp.bfloat16, jnp.float32)]))
    follower = draw(st.sampled_from(FOLLOWERS))
    axis = draw(st.integers(0, 1))

    if follower in ("tanh", "sum"):

        def convert_one(x: Any) -> Any:
            c = x.astype(dst)
            return jnp.tanh(c) if follower == "tanh" else jnp.sum(c, axis=axis)

        return _case(draw, "convert_element_type", convert_one, (_struct(shape, src),), "narrow")

    def convert(x: Any, y: Any) -> Any:
        c = x.astype(dst)
        return c * y.astype(dst) if follower == "mul" else c @ y.astype(dst).T

    return _case(draw, "convert_element_type", convert, (_struct(shape, src), _struct(shape, src)), "narrow")


@st.composite
def squeeze_case(draw: Any) -> Case:
    """``expand_dims`` then a broadcast along the new axis (``x[:, None] * w``: w's size-1 axes expanded), or
    ``squeeze`` of size-1 dimensions."""
    shape = (draw(SMALL), draw(SMALL))
    axis = draw(st.integers(0, 2))
    if draw(st.booleans()):
        width = draw(st.sampled_from([1, 8]))

        def expand(x: Any) -> Any:
            grown = jnp.expand_dims(x, axis)
            return grown * jnp.ones(grown.shape[:axis] + (width,) + grown.shape[axis + 1 :], x.dtype)

        return _case(draw, "expand_dims", expand, (_struct(shape),))
    ones = tuple(sorted(draw(st.sets(st.integers(0, 3), min_size=1, max_size=2))))
    full = list(shape)
    for k in ones:
        full.insert(k, 1)
    full_shape = tuple(full)
    dims = tuple(k for k, s in enumerate(full_shape) if s == 1)

    def squeeze(x: Any) -> Any:
        return lax.squeeze(x, dims)

    return _case(draw, "squeeze", squeeze, (_struct(full_shape),))


STRATEGIES: dict[str, Any] = {
    "dot_general": dot_general_case(),
    "reduce": reduction_case(),
    "reshape": reshape_case(),
    "transpose": transpose_case(),
    "broadcast_in_dim": broadcast_case(),
    "convert_element_type": convert_case(),
    "squeeze": squeeze_case(),
    "size1_broadcast": size1_broadcast_case(),
}


@pytest.mark.parametrize("family", sorted(STRATEGIES))
def test_core_rule_matches_xla(family: str) -> None:
    FAST(given(STRATEGIES[family])(check))()


# The deep draws a rule does not yet hold to XLA (not strict: the derandomized draws follow the code's paths, so a
# change elsewhere moves a family's first failing draw; the misses are named, not hidden).
DEEP_MISSES = {
    "dot_general": (
        "the gradient of dot_general(x[8@a, 8, 8], y[8@a, 8, 8]) contracting (0, 1) with (2, 1) (mesh 1): the "
        "collectives match (2 all-gathers and an all-reduce, 4352 B), explain's peak is 1.28x XLA's (6912 B "
        "against 5392 B: the memory walk's, not the rule's)"
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
def test_core_rule_matches_xla_deep(family: str) -> None:
    DEEP(given(STRATEGIES[family])(check))()


# -- the draws that found a rule's gap, fixed by the rule (each held exactly, or within the mark's bound) ------


def _dot(dimension_numbers: Any) -> Any:
    def dot(x: Any, y: Any) -> Any:
        return lax.dot_general(x, y, dimension_numbers)

    return dot


MM = (((1,), (0,)), ((), ()))


@pytest.mark.parametrize(
    ("lhs", "rhs", "dimension_numbers"),
    [
        ((64, 32), (32, 16), MM),
        ((64, 8, 32), (8, 32, 16), (((2,), (1,)), ((1,), (0,)))),  # the lhs's batch dimension not leading
        ((8, 64, 32), (32, 8, 16), (((2,), (0,)), ((0,), (1,)))),  # the rhs's
        ((8, 8, 8, 8), (8, 8), (((0, 1), (0, 1)), ((), ()))),  # two contracted dimensions leading
        ((8, 8, 8, 8), (8, 8), (((2, 3), (0, 1)), ((), ()))),  # canonical: no copy
        ((16, 16, 12), (16, 16, 12), (((2,), (2,)), ((0,), (0,)))),  # one free, one contracted: either way round
        ((16, 32, 24, 12), (8, 32, 24), (((2, 1), (2, 1)), ((), ()))),
    ],
)
def test_dot_canonical_copies_in_peak(lhs: tuple[int, ...], rhs: tuple[int, ...], dimension_numbers: Any) -> None:
    """XLA:CPU transposes a dot's operand into its canonical order (batch, free, contracted) before the product
    where it is not (memory.dot_scratch): peak memory counts the copy (the deep run's draws: explain was 0.5x)."""
    args = (_struct(lhs), _struct(rhs))
    check(Case("dot_general", _dot(dimension_numbers), args, (P(), P()), 1, False, False))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("explicit", [False, True])
def test_bf16_collectives_carry_f32_on_cpu(grad: bool, explicit: bool) -> None:
    """XLA:CPU converts bf16 to f32 around every collective (Profile.narrow_floats): a bf16 max over split rows
    all-reduces 4-byte elements, a bf16 matmul of a gathered operand gathers 4-byte elements (explain said half)."""
    x = _struct((8, 8, 8), jnp.bfloat16)
    check(Case("reduce_max", lambda x: jnp.max(x, axis=1), (x,), (P(None, "a", None),), 1, explicit, grad, "narrow"))
    if explicit:
        return  # (x @ y.T of two row-split operands has no Explicit type: JAX refuses it)
    y = _struct((8, 8), jnp.float32)
    convert = lambda x, y: x.astype(jnp.bfloat16) @ y.astype(jnp.bfloat16).T  # noqa: E731
    check(Case("convert_element_type", convert, (y, y), (P("a", None), P("a", None)), 1, explicit, grad, "narrow"))


def test_one_sided_contraction_is_marked_and_within_its_bound() -> None:
    """A contraction split by one operand only (a vector dot, x split 8 ways, y whole): XLA slices y and
    all-reduces 4 bytes where explain's α–β time gathers x; on a (4, 2) mesh with the other axis idle XLA gathers.
    The dot is marked approximate (its first line says so) and XLA's choice lies within the bound either way."""
    v = _struct((8,))
    check(Case("dot_general", _dot((((0,), (0,)), ((), ()))), (v, v), (P("a"), P()), 1, False, False))
    a, b = _struct((8, 64)), _struct((64, 8))
    for rank, spec in ((1, P(None, "a")), (2, P(None, "a")), (2, P("b", "a")), (2, P(None, ("a", "b")))):
        check(Case("dot_general", _dot(MM), (a, b), (spec, P()), rank, False, False))
    # The deep run's draw: one contracted axis split over b and over (a, b): XLA gathers both (explain permuted,
    # gathered and all-reduced; now marked, within the bound).
    check(Case("dot_general", _dot((((0,), (0,)), ((), ()))), (v, v), (P("b"), P(("a", "b"))), 2, False, False))
    # Both operands split one mesh axis on different contracted pairs: XLA all-to-alls one and all-reduces.
    x, y = _struct((8, 8)), _struct((8, 8, 8))
    crossed = (((0, 1), (1, 0)), ((), ()))
    check(Case("dot_general", _dot(crossed), (x, y), (P("a", None), P("a", None, None)), 1, False, False))


@pytest.mark.parametrize("explicit", [False, True])
def test_reduction_gradient_lands_where_its_type_says(explicit: bool) -> None:
    """The gradient of mean(x, 1) with x's rows split over b: on Explicit axes JAX types the broadcast cotangent
    split like x, and XLA makes it there (a local slice: its peak half of a replicated one); on Auto axes XLA
    leaves it whole."""
    x = _struct((8, 8, 8))
    check(Case("reduce_mean", lambda x: jnp.mean(x, axis=1), (x,), (P(None, "b", None),), 2, explicit, True))


def test_transpose_gradient_fuses_and_drops_the_dead_loss() -> None:
    """jax.grad keeps the forward's loss unread (``_ = reduce_sum(y ** 2)``): XLA removes it, so the transposed
    value is read once and fuses into the gradient's loop (peak: the argument and the gradient; explain held
    the transposed copy too, 1.5x)."""
    x = _struct((24, 12, 8))
    check(Case("transpose", lambda x: jnp.transpose(x, (2, 0, 1)), (x,), (P(),), 1, False, True))


# -- the layout algebra's transitions against XLA's partitioner (einshard._src.core.moves.transition) ----------

# src -> dst on a (16, 16) float32 value, each pair a reshard rule measured on the compiled HLO of a one-op program
# whose argument and result are laid out so (the whole 2-D table on (4, 2) and (2, 2, 2): tools one-off, the
# differing pairs 18 -> 9 of 110 and 1155 -> 888 of 2352 with these rules; of the 450 pairs on (2, 2, 2) that move
# one split dimension to another, 252 -> 66).
RESHARDS = [
    # several dimensions gathered: the last first (its gather moves the smaller block)
    ((("a",), ("b",)), ((), ()), 2),
    ((("b",), ("a",)), ((), ()), 2),
    ((("a",), ("b",)), ((), ()), 3),
    # a dimension's whole split moved by one all-to-all in its own order, then reordered
    ((("b", "a"), ()), ((), ("b", "a")), 2),
    ((("b", "a"), ()), ((), ("a", "b")), 2),
    # a major mesh axis moved while a minor one is gathered: gathered whole (full rematerialization)
    ((("a", "b"), ()), ((), ("a",)), 2),
    (((), ("b", "a")), (("b",), ()), 2),
    # the other way round: the minor one moved, the major one gathered after it
    ((("a", "b"), ()), ((), ("b",)), 2),
    # one dimension's whole split moved to another split as many ways over other mesh axes, the source's major
    # axis among them: an all-to-all, then a permute to the devices the target names
    ((("b", "c"), ()), ((), ("a", "b")), 3),
    ((("a", "b"), ()), ((), ("a", "c")), 3),
    # ... and where the major axis leaves, a gather and a slice
    ((("a",), ()), ((), ("b",)), 3),
]


@pytest.mark.parametrize(("src", "dst", "rank"), RESHARDS)
def test_transition_is_xlas_reshard(src: Any, dst: Any, rank: int) -> None:
    from collections import Counter

    from jax.sharding import NamedSharding
    from test_primitive_rules import MESHES, _mesh

    from einshard._src.analysis.cost import transition
    from einshard._src.core.layout import Layout, MeshAxis
    from einshard.testing import hlo

    def spec(dims: Any) -> P:
        return P(*[None if not d else d[0] if len(d) == 1 else d for d in dims])

    mesh = _mesh(rank, False)
    sharded = jax.jit(
        lambda x: x * 2, in_shardings=NamedSharding(mesh, spec(src)), out_shardings=NamedSharding(mesh, spec(dst))
    )
    found = hlo.normalized(sharded.lower(_struct((16, 16))).compile().as_text())
    want = Counter(c.kind for c in found if c.group_size > 1)
    want_bytes = sum(c.array_bytes for c in found if c.group_size > 1)
    axes = tuple(MeshAxis(n, s) for s, n in zip(*MESHES[rank]))
    _, colls = transition(Layout(("x", "y"), (16, 16), axes, src), Layout(("x", "y"), (16, 16), axes, dst))
    assert (Counter(c.kind for c in colls), sum(c.array_bytes for c in colls)) == (want, want_bytes)


# -- issue 20's deep misses, fixed by the rules: each held exactly against XLA's compiled program -----------------

BATCH_CONTRACT_1 = (((1,), (1,)), ((0,), (0,)))  # batch 0, contracting 1 with 1, a free axis on each side


@pytest.mark.parametrize(
    ("lhs", "rhs", "specs", "rank", "dimension_numbers"),
    [
        # the deep run's draw: equal sizes, the left operand's free split wins, the right one is gathered
        ((8, 8, 8), (8, 8, 8), (P(None, None, "a"), P("a", None, None)), 1, BATCH_CONTRACT_1),
        # the left one's batch split wins: the right one's free split all-to-alls onto its batch axis
        ((8, 8, 8), (8, 8, 8), (P("a", None, None), P(None, None, "a")), 1, BATCH_CONTRACT_1),
        # the larger (right) operand's batch split wins over the left one's free split: an all-to-all
        ((8, 8, 8), (8, 8, 64), (P(None, None, "a"), P("a", None, None)), 1, BATCH_CONTRACT_1),
        # ... its free split over the left one's batch split: the left one gathered
        ((8, 8, 8), (8, 8, 64), (P("a", None, None), P(None, None, "a")), 1, BATCH_CONTRACT_1),
        # two free axes on one mesh axis: the larger side's wins; a split over (a, b) that loses a is cut whole
        ((16, 8), (8, 64), (P(("a", "b"), None), P(None, "a")), 2, MM),
        ((16, 8), (8, 16), (P("a", None), P(None, "a")), 1, MM),
        # the batch axis split differently on each side (b against a): neither wins it, both free splits stay
        ((8, 8, 16), (8, 8, 8), (P("b", None, "a"), P("a", None, "b")), 2, BATCH_CONTRACT_1),
    ],
)
def test_dot_result_factors_on_one_mesh_axis_settle_as_shardy(
    lhs: tuple[int, ...], rhs: tuple[int, ...], specs: tuple[P, P], rank: int, dimension_numbers: Any
) -> None:
    """Two operands splitting one mesh axis along different factors of the result (a batch axis on one side, a free
    axis on the other): XLA does not choose by bytes (explain all-to-all'd 256 B where XLA gathers 2048 B) but by
    Shardy's propagation, the larger operand's splits first (rules_indexing.passthrough_conflict)."""
    check(Case("dot_general", _dot(dimension_numbers), (_struct(lhs), _struct(rhs)), specs, rank, False, False))


def test_dot_clash_gather_reused_by_the_gradient() -> None:
    """x[8, 8@a] . y[8@a] (y's split is contracted): the gradient's outer product meets g[8@a] and y[8@a] on two
    free axes, and the clash gathers y, which the forward gathered already: XLA reuses it (one all-gather)."""
    args = (_struct((8, 8)), _struct((8,)))
    check(Case("dot_general", _dot((((0,), (0,)), ((), ()))), args, (P(None, "a"), P("a")), 1, False, True))


def _bias(shape: tuple[int, ...], axis: int) -> Any:
    def bias(x: Any, b: Any) -> Any:
        return x + lax.broadcast_in_dim(b, shape, (axis,))

    return bias


@pytest.mark.parametrize(
    ("shape", "axis", "specs", "rank", "grad"),
    [
        # the deep run's draws: the bias's split is not the rows' (or columns'): XLA moves the bias to it
        ((8, 8), 0, (P("b", None), P("a")), 2, False),  # a collective-permute and an all-gather
        ((16, 12), 0, (P("b", "c"), P("a")), 3, False),  # one collective-permute
        ((16, 12), 1, (P("b", "c"), P("a")), 3, False),
        ((8, 8), 0, (P("b", None), P("a")), 2, True),
        # no clash: the bias's split on its own axis stays and the other operand is sliced
        ((8, 8), 1, (P("b", None), P("a")), 2, False),
        ((8, 8), 0, (P("a", None), P(("a", "b"))), 2, False),
    ],
)
def test_bias_broadcast_meets_its_readers_split_first(
    shape: tuple[int, int], axis: int, specs: tuple[P, P], rank: int, grad: bool
) -> None:
    """x + broadcast(b): Shardy propagates the add before the broadcast, so the broadcast's result takes x's split
    and the bias is brought to it (rules_structural._split_by_users); explain merged the two splits to a whole
    result and gathered both (448 B where XLA permutes 32 B)."""
    args = (_struct(shape), _struct((shape[axis],)))
    check(Case("broadcast_in_dim", _bias(shape, axis), args, specs, rank, False, grad))


@pytest.mark.parametrize(
    ("lhs", "rhs", "rank"),
    [
        # x.astype(bf16) @ y.astype(bf16).T: both free axes split over b (the deep run's draws)
        (P("b", None), P(("a", "b"), None), 2),
        (P(("a", "b"), None), P("b", None), 2),
    ],
)
@pytest.mark.parametrize("grad", [False, True])
def test_converted_product_free_axes_on_one_mesh_axis(lhs: P, rhs: P, rank: int, grad: bool) -> None:
    """A product of converted operands whose free axes are split over one mesh axis: the clash settles as Shardy
    does (rules_indexing.passthrough_conflict), in the converted dtype's bytes (explain gathered 384 B where XLA
    gathers 1536 B, and differed by 2 collectives on the other draw)."""
    convert = lambda x, y: x.astype(jnp.bfloat16) @ y.astype(jnp.bfloat16).T  # noqa: E731
    args = (_struct((32, 12)), _struct((32, 12)))
    check(Case("convert_element_type", convert, args, (lhs, rhs), rank, False, grad, "narrow"))


def test_clamp_bound_whose_split_moves_and_grows_is_gathered_whole() -> None:
    """lax.clamp(lo, x, hi), x[32@(a,b,c), 24], lo[32@a, 24@c]: lo's target takes c from its other dimension (an
    all-to-all) and b it does not split over (a slice) on one dimension; XLA has no direct reshard for that and
    gathers lo whole (core.moves._shift_meets_slice; explain all-to-all'd 384 B where XLA gathers 4608 B)."""
    args = (_struct((32, 24)),) * 3
    specs = (P(("a", "b", "c"), None), P("a", "c"), P("a", None))
    check(Case("clamp", lambda x, lo, hi: lax.clamp(lo, x, hi), args, specs, 3, False, False, "moved"))


@pytest.mark.parametrize(
    ("src", "dst", "rank"),
    [
        ((("a",), ("c",)), (("a", "b", "c"), ()), 3),  # c moved and b sliced onto one dimension: gathered whole
        ((("a",), ("c",)), (("a", "c", "b"), ()), 3),
        ((("a",), ("c",)), (("a", "c"), ()), 3),  # c moved alone: one all-to-all
        ((("b",), ("c",)), (("b", "a", "c"), ()), 3),
        (((), ("b",)), (("a", "b"), ()), 2),  # no kept mesh axis there: a sliced first, one all-to-all
        ((("a", "c"), ()), (("a",), ("b", "c")), 3),  # from an earlier one: b sliced first, one all-to-all
        ((("a", "c"), ()), ((), ("b", "c")), 3),  # a mesh axis leaves: not rematerialized
    ],
)
def test_shift_and_slice_onto_one_dimension_is_xlas_reshard(src: Any, dst: Any, rank: int) -> None:
    """A dimension that keeps a mesh axis and takes one from a later dimension and one the source does not use, at
    once: XLA's partitioner rematerializes (core.moves._shift_meets_slice), measured as
    test_transition_is_xlas_reshard."""
    test_transition_is_xlas_reshard(src, dst, rank)


def test_operand_split_swapped_to_another_dimension_is_marked() -> None:
    """a * b, a[16@b, 16], b[16@a, 16@c] (mesh 3): the merged result [16, 16@c] is XLA's, and a's split moves whole
    from its rows over b to its columns over c.  XLA all-to-alls and permutes it there (1536 B in all) where the
    same move alone, or against b[16, 16@c], is one all-gather, as explain prices it: the device order of the
    layout a meets decides, which explain does not carry, so the op is marked approximate (movement.mark_swap) and
    XLA's choice lies within its bound."""
    args = (_struct((16, 16)), _struct((16, 16)))
    for grad in (False, True):
        check(Case("mul", lambda a, b: a * b, args, (P("b", None), P("a", "c")), 3, False, grad, "moved"))


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_explicit_dot_gradient_follows_its_typed_results(explicit: bool) -> None:
    """The gradient of dot_general(x[8@a, 16, 8], y[16@a, 8, 24]) contracting 1/0, batch 2/1 on Explicit axes: the
    backward dots' result types decide their splits, not the propagation: g[8, 8@a, 24] . y typed [8, 8@a, 16]
    reuses the forward's gather of y (explain gathered g), and y's gradient, a sum typed [8, 24, 16@a], is
    reduce-scattered at its dot (explain all-reduced it at the output): XLA all-gathers once and reduce-scatters
    (24576 B).  The peak: XLA:CPU's reduce-scatter is an all-reduce of the whole partial then a slice, so the whole
    sum is held next to the partial (memory._whole_sum_beside; explain's peak was 0.72x XLA's on Explicit axes)."""
    args = (_struct((8, 16, 8)), _struct((16, 8, 24)))
    dimension_numbers = (((1,), (0,)), ((2,), (1,)))
    check(Case("dot_general", _dot(dimension_numbers), args, (P("a", None, None),) * 2, 1, explicit, explicit))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (P("a", "b"), P(("a", "b"), None)),  # the deep run's draw: the rows' 8-way split wins b
        (P(("a", "b"), None), P("a", "b")),  # whichever operand holds it
        (P("a", "b"), P(None, ("b", "a"))),  # the columns' 8-way split wins a
        (P(None, "a"), P("a", None)),  # a tie: the first operand's split
    ],
)
@pytest.mark.parametrize("grad", [False, True])
def test_elementwise_mesh_axis_on_two_dimensions_claimed_as_shardy(a: P, b: P, grad: bool) -> None:
    """a * b whose merged splits name one mesh axis on two dimensions (mesh 4 x 2): the dimension split over more
    devices claims it first (rules_structural.claimed_dims); explain took the first operand's whole layout and
    all-to-all'd the other the wrong way (result [16@a, 16@b] where XLA's is [16@(a,b), 16])."""
    args = (_struct((16, 16)), _struct((16, 16)))
    check(Case("mul", lambda x, y: x * y, args, (a, b), 2, False, grad, "moved"))


def test_explicit_elementwise_result_lands_at_its_type() -> None:
    """lax.clamp(lo, x, hi) on Explicit axes, x and hi [16@(a,b), 16], lo [16@b, 16] (mesh 4 x 2): the result's
    type is x's split, and XLA permutes lo there (128 B); explain merged the splits to their common prefix, a
    whole result, and gathered all three (3072 B)."""
    args = (_struct((16, 16)),) * 3
    specs = (P(("a", "b"), None), P("b", None), P(("a", "b"), None))
    check(Case("clamp", lambda x, lo, hi: lax.clamp(lo, x, hi), args, specs, 2, True, False, "moved"))


def test_explicit_elementwise_result_typed_whole_gathers() -> None:
    """lax.clamp(lo, x, hi) on Explicit axes, x whole, lo and hi [16@a, 16] (mesh 1): the result is typed whole,
    as x, and XLA gathers lo and hi (2048 B); explain kept their split (no collective)."""
    args = (_struct((16, 16)),) * 3
    specs = (P(None, None), P("a", None), P("a", None))
    check(Case("clamp", lambda x, lo, hi: lax.clamp(lo, x, hi), args, specs, 1, True, False, "moved"))


def test_explicit_bf16_dot_gradient_all_reduces() -> None:
    """The gradient of x.astype(bf16) @ y.astype(bf16).T on Explicit axes, x[8@a, 8], y[8, 8@a]: y's gradient is a
    sum typed split, but XLA:CPU sums bf16 in f32 and converts before the slice, so it all-reduces (no
    reduce-scatter, unlike the f32 case above)."""
    convert = lambda x, y: x.astype(jnp.bfloat16) @ y.astype(jnp.bfloat16).T  # noqa: E731
    args = (_struct((8, 8)), _struct((8, 8)))
    check(Case("convert_element_type", convert, args, (P("a", None), P(None, "a")), 1, True, True, "narrow"))


# -- projections sharing a hidden state whose contraction they do not split (idle_axes.py) -----------------------


def _projections(n: int) -> Any:
    """``n`` projections of one hidden state, each with its own weight (q, k, v of one attention block)."""

    def project(x: jax.Array, *ws: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(jnp.einsum("bsd,dhk->bshk", x, w) for w in ws[:n])

    return project


# Where the memory walk or another choice of XLA's still differs (collectives held exactly elsewhere): named here.
# Read from XLA:CPU's buffer assignment (jax 0.10, --xla_dump_to): its scheduled module runs the input gradient's dot
# (ynn_fusion.1) before the weight gradient's, so its temporaries peak (26624 B) there with the partial x gradient
# f32[64,32], x gathered and re-laid row-major (copy_bitcast_fusion, 8 KiB, kept for the later weight-gradient dot),
# the cotangent f32[64,16] and its transposed copy f32[16,64], and w's transposed copy f32[16,32]; and it reports the
# output allocations (10256 B) apart from the temporaries though they are written after that dot (the all-gather's
# own buffer shares the x gradient's): 6144 + 10256 + 26624 = 43024 B.  explain's walk runs the dots in jaxpr order
# (the weight gradient's first: the gathered x is freed before the input gradient's dot) and counts each output from
# its producer: 26624 B.  XLA's scheduler's order and buffer assignment's packing, not the liveness walk's rules.
_LONE_PEAK = pytest.mark.xfail(
    strict=True,
    reason="peak (memory.py): one projection alone with its gradient, explain 26624 B vs XLA 43024 B (0.62x): XLA "
    "schedules the input gradient's dot first (the gathered x's re-laid copy live across it) and reports its output "
    "allocations (10256 B) apart from the temporaries (buffer assignment's packing); the collectives are XLA's",
)
_SMALL_HEADS = pytest.mark.xfail(
    strict=True,
    reason="heads x head_dim smaller than the hidden state's d (32 vs 4), the gradient (the forward is XLA's, peak "
    "included, since the moved operand is no longer held as a whole gathered copy): its backward dots XLA computes "
    "with a collective-permute and an all-reduce per projection where explain gathers each projection's operand "
    "through the idle axes (rules_indexing.passthrough_conflict, idle_axes.gather_route: on Auto axes explain 6 "
    "all-reduces, 3 all-gathers, 1 permute vs XLA 9 all-reduces, 7 permutes), not modelled",
)


@pytest.mark.parametrize(
    ("n", "mesh_rank", "split", "heads", "head_dim"),
    [
        # (4, 2) mesh, split over 'b' (2), idle 'a' (4): the result block is the smaller, summed over 'a'
        pytest.param(2, 2, "b", 4, 8, id="2-summed"),
        pytest.param(3, 2, "b", 4, 8, id="3-summed"),
        # (2, 2, 2) mesh, split over 'a', idle ('b', 'c') as many devices: summed over both
        pytest.param(2, 3, "a", 4, 8, id="2-two-idle"),
        pytest.param(3, 3, "a", 4, 8, id="3-two-idle"),
        pytest.param(1, 2, "b", 4, 8, id="1-summed"),
        pytest.param(3, 2, "b", 2, 2, id="3-small-heads"),
    ],
)
@pytest.mark.parametrize("grad", [False, True], ids=["value", "grad"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_projections_of_one_resplit_hidden_state_as_xla(
    n: int, mesh_rank: int, split: str, heads: int, head_dim: int, grad: bool, explicit: bool, request: Any
) -> None:
    """x[b, s, d@M] against n weights [d, h@M, k] (GPT-2's tp with the token table split on d): XLA re-splits x's
    d from M onto the idle mesh axes once (one collective-permute, shared by every projection: CSE), then sums
    each projection's partial products over the idle axes (one all-reduce per projection, combined into a tuple
    all-reduce that counts one per projection); explain charged the first projection's all-reduce only."""
    args = (_struct((8, 8, 32)),) + (_struct((32, heads, head_dim)),) * n
    specs = (P(None, None, split),) + (P(None, split, None),) * n
    if grad and n == 1 and not explicit:
        request.applymarker(_LONE_PEAK)
    if grad and heads == 2 and not explicit:
        request.applymarker(_SMALL_HEADS)
    check(Case("dot_general", _projections(n), args, specs, mesh_rank, explicit, grad))


# -- a clash of two free axes over one mesh axis, the loser gathered through the idle mesh axes (idle_axes.py) ---

ROWS = (((0,), (0,)), ((), ()))  # x[b, i] . y[b, j] -> [i, j]: a kernel gradient's contraction over the rows
_REGATHERED_FOR_THE_BACKWARD = pytest.mark.xfail(
    strict=True,
    reason="the gradient with the rows split over 'c' too: XLA shares the forward's collective-permute of x but "
    "all-gathers it over 'b' a second time for the backward dot (two identical all-gathers of one permute, 1024 B "
    "more); explain reuses the forward's gather (Walker.change's CSE), as XLA does on the 2-axis mesh; when XLA "
    "repeats such a gather not yet known",
)


_JAX_MINOR = tuple(int(p) for p in jax.__version__.split(".")[:2])
# Seen on jax 0.12.0.1 (CI's py3.12) and, the same bytes, on jax 0.11.2 (a lent GPU machine's image, CPU devices).
_MORE_SCRATCH_ON_JAX_011 = pytest.mark.xfail(
    strict=True,
    reason="peak only, on jax 0.11+'s XLA:CPU: the gradient with nothing idle (one mesh axis) holds 1024 B more "
    "temporaries than jax 0.10's for the same program (7440 B against explain's 5376 B, 0.72x; on jax 0.10 within "
    "the 25% band); the collectives and bytes are XLA's on both",
)


@pytest.mark.parametrize(
    ("lhs", "rhs", "specs", "rank"),
    [
        # (4, 2) mesh, both free axes over 'b' (2), 'a' (4) idle: the smaller operand re-split onto 'a' (one
        # collective-permute) and gathered over it
        pytest.param((16, 32), (16, 64), (P(None, "b"), P(None, "b")), 2, id="idle-a"),
        pytest.param((16, 64), (16, 32), (P(None, "b"), P(None, "b")), 2, id="idle-a-left-gathered"),
        # (2, 2, 2) mesh, over 'a', 'b' and 'c' idle (4 devices): through both
        pytest.param((16, 32), (16, 64), (P(None, "a"), P(None, "a")), 3, id="idle-bc"),
        # the rows split over 'c' as well: 'b' alone is idle, as many devices as 'a'
        pytest.param((16, 32), (16, 64), (P("c", "a"), P("c", "a")), 3, id="idle-b-rows-over-c"),
        # over 'a' (4) with 'b' (2) idle, and a 1-axis mesh (nothing idle): gathered over the clashing axis
        pytest.param((16, 32), (16, 64), (P(None, "a"), P(None, "a")), 2, id="too-few-idle"),
        pytest.param((16, 32), (16, 64), (P(None, "a"), P(None, "a")), 1, id="no-idle"),
    ],
)
@pytest.mark.parametrize("grad", [False, True], ids=["value", "grad"])
def test_free_axes_clash_gathers_through_idle_mesh_axes(
    lhs: tuple[int, ...], rhs: tuple[int, ...], specs: tuple[P, P], rank: int, grad: bool, request: Any
) -> None:
    """x[b, i@M] . y[b, j@M] -> [i, j]: the clash keeps the larger operand's split and makes the other whole; with
    as many idle devices as M or more, XLA re-splits it onto the idle mesh axes and gathers it over them (a
    collective-permute and an all-gather; explain gathered it over M: one all-gather of other bytes)."""
    if grad and "rows-over-c" in request.node.callspec.id:
        request.applymarker(_REGATHERED_FOR_THE_BACKWARD)
    if grad and request.node.callspec.id.endswith("no-idle") and _JAX_MINOR >= (0, 11):
        request.applymarker(_MORE_SCRATCH_ON_JAX_011)
    check(Case("dot_general", _dot(ROWS), (_struct(lhs), _struct(rhs)), specs, rank, False, grad))


# -- a reshape that cuts a split dimension into several: the split spreads over them (rules_structural.reshape_split) --


def _reshaped(shape: tuple[int, ...], to: tuple[int, ...], spec: P, rank: int, explicit: bool, grad: bool) -> Case:
    return Case(
        "reshape", lambda x: x.reshape(to), (jax.ShapeDtypeStruct(shape, jnp.float32),), (spec,), rank, explicit, grad
    )


# The deep run's draw (x[4, 8] columns@a, 8 ways, to (4, 2, 4): Shardy splits a into sub-axes over both parts, XLA
# gathers each, the minor first, 192 B) and the measured neighbours: at mesh-axis boundaries the split is kept
# ((a, b, c) over 2 x 4 is a then (b, c), nothing moves; its gradient merges them back), on sub-axes it is
# gathered one dimension at a time and marked (a consumer that keeps the sub-axes moves nothing, or sums).
RESHAPE_SPLIT_DRAWS = [
    _reshaped((4, 8), (4, 2, 4), P(None, "a"), 1, False, False),
    _reshaped((4, 8), (4, 2, 4), P(None, "a"), 1, False, True),
    _reshaped((4, 8), (4, 2, 4), P(None, ("a", "b")), 2, False, False),
    _reshaped((4, 8), (2, 2, 8), P("a", None), 2, False, False),
    _reshaped((4, 8), (4, 2, 4), P(None, ("a", "b", "c")), 3, False, False),
    _reshaped((4, 8), (4, 4, 2), P(None, ("a", "b", "c")), 3, False, True),
    _reshaped((4, 8), (4, 2, 4), P(None, ("a", "b", "c")), 3, True, False),
    _reshaped((4, 16), (2, 2, 16), P(("a", "b"), None), 3, False, True),
    Case(
        "reshape",
        lambda x: jnp.tanh(x.reshape(4, 2, 4)).sum(),
        (jax.ShapeDtypeStruct((4, 8), jnp.float32),),
        (P(None, "a"),),
        1,
        False,
        False,
    ),
]


@pytest.mark.parametrize("case", RESHAPE_SPLIT_DRAWS)
def test_reshape_spreads_a_split_over_the_dimensions_it_cuts(case: Case) -> None:
    check(case)


@pytest.mark.parametrize(
    ("shapes", "specs", "rank"),
    [
        # a router's per-token scale (x / sum(x, keepdims=True)) split over the tokens, x whole: XLA runs the op on
        # the scale's split, x sliced, no collective (explain had gathered the scale: keras-hub Qwen3-MoE's FSDP
        # gradient, benchmarks/keras_hub_probe.py)
        (((16, 4), (16, 1)), (P(), P("a")), 2),
        (((16, 4), (16, 1)), (P(None, "b"), P("a")), 2),
        # the small operand's split meets the result's on one mesh axis: XLA gathers it before broadcasting
        (((8, 8, 8), (1, 1, 8)), (P(("b", "c"), "a", None), P(None, None, "c")), 3),
    ],
)
@pytest.mark.parametrize("grad", [False, True])
def test_a_size1_broadcast_operands_split_is_a_factor_of_the_result(
    shapes: tuple[tuple[int, ...], tuple[int, ...]], specs: tuple[P, P], rank: int, grad: bool
) -> None:
    args = (_struct(shapes[0]), _struct(shapes[1]))
    check(Case("mul", lambda x, s: x * s, args, specs, rank, False, grad))
    if rank == 2:  # (on Explicit axes JAX refuses the third: its result would name 'c' twice)
        check(Case("div", lambda x, s: lax.div(x, s), args, specs, rank, True, grad))


# -- reshapes merging several split dimensions, and size-1 broadcasts against a full operand's split -------------
# (first found by the per-primitive draws with another seed than CI's: session 27)


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@pytest.mark.parametrize(
    ("shape", "spec", "out", "rank"),
    [
        ((4, 2, 2), P("c", "b", "a"), (4, 4), 3),  # two merged, the major kept: (4@c, 4@(b,a)), nothing moves
        ((2, 2, 2, 8), P("a", "b", "c", None), (2, 32), 3),  # b, c and a whole minor one merged: 32@(b,c)
        ((4, 2, 2, 2), P("a", "b", "c", None), (4, 8), 3),
        ((4, 2, 2), P("c", "b", "a"), (16,), 3),  # 4@c split fewer ways than its rows: b and a gathered, 16@c
        ((4, 2, 8), P("a", "b", None), (4, 16), 2),
        ((2, 4, 2, 4), P(None, "a", "b", None), (2, 8, 4), 2),
        ((2, 4, 2, 4), P("b", "a", None, None), (8, 8), 2),
        ((8, 2, 2), P(None, "a", "b"), (2, 4, 4), 3),
        ((4, 2, 2), P("a", None, "b"), (4, 4), 3),  # a whole major in the merged group: b gathered, 4@a kept
        ((2, 2, 4), P(None, "a", "b"), (4, 4), 3),
        ((2, 4, 2), P(None, "a", "b"), (8, 2), 3),
    ],
)
def test_a_reshape_merging_split_dimensions_keeps_what_stays_contiguous(
    shape: tuple[int, ...], spec: P, out: tuple[int, ...], rank: int, grad: bool
) -> None:
    """A reshape groups its input and result dimensions by size; a group of split dimensions merged into one keeps
    their mesh axes in order while each but the last is split all its ways, and its gradient cuts them back: XLA
    moves nothing there (explain had gathered every split, 3 all-gathers where XLA has none)."""
    check(Case("reshape", lambda x: x.reshape(out), (_struct(shape),), (spec,), rank, False, grad))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@pytest.mark.parametrize("small_first", [False, True], ids=["x-op-s", "s-op-x"])
@pytest.mark.parametrize(
    ("shape", "small", "x_spec", "s_spec"),
    [
        ((8, 8), (1, 8), P(None, "a"), P(None, "b")),  # s permuted from b to a, 8 B
        ((8, 8), (1, 8), P("b", "a"), P(None, "b")),
        ((8, 8), (1, 8), P(None, "b"), P(None, "a")),
        ((8, 8), (1, 8), P(None, ("a", "b")), P(None, "b")),
        ((8, 8), (1, 8), P("a", "b"), P(None, "a")),
        ((8, 8), (1, 8), P(None, "b"), P(None, ("a", "b"))),
        ((8, 8), (1, 8), P(None, "a"), P(None, ("b", "a"))),
        ((8, 8), (1, 8), P("a", None), P(None, ("a", "b"))),  # s's a is x's rows': s gathered, x's split kept
        ((8, 8), (1, 8), P(None, "a"), P(None, ("a", "b"))),  # s extends x's split: the result takes (a, b)
        ((8, 8), (1, 8), P(None, None), P(None, "b")),  # x whole there: the result runs on s's split
        ((8, 8, 8), (8, 1, 8), P(None, "a", "b"), P("b", None, "a")),
        ((8, 8, 8), (8, 1, 8), P("a", None, None), P("b", None, "a")),
        ((8, 8, 8), (8, 1, 8), P("a", "b", None), P("b", None, None)),
        # the small operand moved itself, not broadcast first (16 B where explain had moved an (8, 8@c) copy, 64 B)
        ((8, 8), (8, 1), P("a", "c"), P("b", None)),
        ((8, 8), (8, 1), P("a", "b"), P("c", None)),
        ((8, 8), (8, 1), P(("a", "b"), "c"), P("b", None)),
        ((8, 8), (8, 1), P("b", "c"), P(("a", "b"), None)),
    ],
)
def test_a_size1_broadcast_operand_is_moved_to_the_full_operands_split(
    shape: tuple[int, ...], small: tuple[int, ...], x_spec: P, s_spec: P, small_first: bool, grad: bool
) -> None:
    """Where a size-1-broadcast operand's split conflicts with the full operand's, XLA keeps the full operand's
    split and moves the small one to it (a permute of a few bytes); explain had kept the common prefix and
    gathered both (2 all-gathers, up to 288 B where XLA sends 8 B).  On the mesh of (4, 2) or (2, 2, 2)."""
    rank = 3 if len(shape) == 3 or "c" in str((x_spec, s_spec)) else 2

    def fn(x: Any, s: Any) -> Any:
        return lax.mul(s, x) if small_first else lax.mul(x, s)

    check(Case("mul", fn, (_struct(shape), _struct(small)), (x_spec, s_spec), rank, False, grad))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@pytest.mark.parametrize("op", ["where", "add"])
@pytest.mark.parametrize(
    ("x_spec", "s_spec", "rank"),
    [
        (P("b", None), P(None, ("a", "b")), 2),  # [16@b, 16@a]: s gathered over b only, 16 B
        (P("a", None), P(None, ("b", "a")), 2),
        (P("c", None), P(None, ("a", "c", "b")), 3),
        (P(("a", "b"), None), P(None, ("c", "a")), 3),
        (P("b", "a"), P(None, ("a", "b")), 2),
        (P(None, "a"), P(None, ("a", "b")), 2),
    ],
)
def test_a_broadcast_row_keeps_its_split_up_to_a_mesh_axis_used_elsewhere(
    x_spec: P, s_spec: P, rank: int, op: str, grad: bool
) -> None:
    """A row broadcast against a full operand (``jnp.where(x > 0, x, s)`` broadcasts it explicitly, ``x + s``
    implicitly) keeps the prefix of its split up to the first mesh axis the other dimensions use: XLA gathers only
    the rest (16 B where explain had gathered it whole, 64 B)."""

    def fn(x: Any, s: Any) -> Any:
        return jnp.where(x > 0, x, s) if op == "where" else x + s

    check(Case(op, fn, (_struct((16, 16)), _struct((1, 16))), (x_spec, s_spec), rank, False, grad, "moved"))


def _every_layout(rank: int) -> list[P]:
    """Every PartitionSpec of ``rank`` dimensions over (a, b, c), each mesh axis at most once, at most two per
    dimension, something split."""
    options: list[Any] = [None, "a", "b", "c", ("a", "b"), ("b", "a"), ("a", "c"), ("c", "a"), ("b", "c")]
    out = []
    for combo in itertools.product(options, repeat=rank):
        used = [m for e in combo if e for m in ((e,) if isinstance(e, str) else e)]
        if used and len(used) == len(set(used)):
            out.append(P(*combo))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shape", "out"),
    [
        ((4, 2, 2), (4, 4)),
        ((4, 2, 2), (16,)),
        ((2, 2, 4), (4, 4)),
        ((4, 4), (4, 2, 2)),
        ((4, 4), (2, 2, 4)),
        ((2, 4, 2), (8, 2)),
    ],
)
def test_every_reshape_layout_on_the_cube_mesh_is_xlas(shape: tuple[int, ...], out: tuple[int, ...]) -> None:
    """Every layout of a small reshape's input on the (2, 2, 2) mesh whose splits divide it, forward and gradient,
    held to XLA (512 programs in all; 178 missed XLA at session 27's start, none since)."""
    sizes = {"a": 2, "b": 2, "c": 2}
    for spec in _every_layout(len(shape)):
        entries = list(spec)
        if any(
            e is not None and shape[i] % math.prod(sizes[m] for m in ((e,) if isinstance(e, str) else e))
            for i, e in enumerate(entries)
        ):
            continue
        for grad in (False, True):
            check(Case("reshape", lambda x: x.reshape(out), (_struct(shape),), (spec,), 3, False, grad))


_TWO_AXES: list[Any] = [None, "a", "b", ("a", "b"), ("b", "a")]
_THREE_AXES: list[Any] = [None, "a", "b", "c", ("a", "b"), ("b", "a"), ("a", "c"), ("c", "a"), ("b", "c")]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("rank", "small", "grads"),
    [(2, (1, 8), (False, True)), (2, (8, 1), (False, True)), (3, (1, 8), (False,))],
    ids=["4x2-row", "4x2-column", "cube-row"],
)
def test_every_size1_broadcast_layout_is_xlas(rank: int, small: tuple[int, int], grads: tuple[bool, ...]) -> None:
    """``x[8, 8] * s`` with ``s`` a row or a column, every layout of both on the (4, 2) mesh (forward and gradient)
    and on the (2, 2, 2) mesh (forward), held to XLA: 512 programs; 198 missed XLA at session 27's start."""
    options = _TWO_AXES if rank == 2 else _THREE_AXES
    sizes = dict(zip(MESHES[rank][1], MESHES[rank][0]))
    layouts = [
        P(*combo)
        for combo in itertools.product(options, repeat=2)
        if len(used := [m for e in combo if e for m in ((e,) if isinstance(e, str) else e)]) == len(set(used))
        and all(e is None or 8 % math.prod(sizes[m] for m in ((e,) if isinstance(e, str) else e)) == 0 for e in combo)
    ]
    for x_spec in layouts:
        for s_spec in layouts:
            if any(e is not None and n == 1 for e, n in zip(s_spec, small)) or not (any(x_spec) or any(s_spec)):
                continue
            for grad in grads:
                args = (_struct((8, 8)), _struct(small))
                check(Case("mul", lambda x, s: lax.mul(x, s), args, (x_spec, s_spec), rank, False, grad))


@pytest.mark.parametrize("grad", [False, True], ids=["forward", "grad"])
@pytest.mark.parametrize(
    ("shape", "spec", "out"),
    [
        ((4, 2, 2), P("a", "b", None), (16,)),  # typed 16@(a,b): one all-to-all over b, 16 B
        ((4, 2, 2), P("b", "a", None), (16,)),
        ((4, 2, 2), P("a", "c", None), (16,)),
        ((4, 2, 2), P("c", "b", "a"), (4, 4)),  # nothing moves
    ],
)
def test_an_explicit_reshape_moves_its_operand_to_where_it_reshapes_to_its_type(
    shape: tuple[int, ...], spec: P, out: tuple[int, ...], grad: bool
) -> None:
    """On Explicit axes JAX types a merging reshape's result (x[4@a, 2@b, 2] to (16@(a,b),)): XLA moves the operand to
    the layout that reshapes to that type locally, [4@(a,b), 2, 2], by one all-to-all; explain had gathered the
    minor split and sliced (32 B against 16 B, the kinds different)."""
    check(Case("reshape", lambda x: x.reshape(out), (_struct(shape),), (spec,), 3, True, grad))
