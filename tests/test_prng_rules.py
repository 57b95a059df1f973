"""Typed PRNG keys' primitives against XLA (tests/test_primitive_rules.py's harness): ``random_split``,
``random_fold_in``, ``random_bits`` (under ``bernoulli``), ``random_wrap`` / ``random_unwrap``, on key batches split
over 1-, 2- and 3-axis meshes, Auto and Explicit, threefry / rbg / unsafe_rbg keys, and the gradient of a dropout
MLP whose per-example keys are split with its batch.  Explain must follow every op (a dropout model's report used
to say INCOMPLETE naming random_split), name XLA's collectives, give the result XLA's layout, and hold the peak,
the threefry hash's scratch included (memory.hash_scratch)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, Case, _case, _explain, _mesh, _spec_dims, _xla, check

import einshard
from einshard import EinshardError
from einshard._src.analysis.program import RULES, coverage
from einshard._src.analysis.program.rules_random import fold_in, key_batch, wrap

IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")
BATCH = st.sampled_from([8, 16, 32])


def _keys(shape: tuple[int, ...], impl: str) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jax.random.key(0, impl=impl).dtype)


def _batched(op: Any, depth: int) -> Any:
    for _ in range(depth):
        op = jax.vmap(op)
    return op


@st.composite
def split_case(draw: Any) -> Case:
    batch = tuple(draw(BATCH) for _ in range(draw(st.integers(1, 2))))
    shape = draw(st.sampled_from([(2,), (3,), (2, 2)]))
    impl = draw(st.sampled_from(IMPLS))
    fn = _batched(lambda k: jax.random.split(k, shape), len(batch))
    return _case(draw, "random_split", fn, (_keys(batch, impl),), grad=False)


@st.composite
def fold_in_case(draw: Any) -> Case:
    batch = (draw(BATCH),)
    impl = draw(st.sampled_from(IMPLS))
    if draw(st.booleans()):  # one message for every key, or one per key (msgs laid out as drawn)
        fn = jax.vmap(lambda k: jax.random.fold_in(k, 7))
        return _case(draw, "random_fold_in", fn, (_keys(batch, impl),), grad=False)
    fn = jax.vmap(jax.random.fold_in)
    return _case(draw, "random_fold_in", fn, (_keys(batch, impl), jax.ShapeDtypeStruct(batch, jnp.uint32)), grad=False)


@st.composite
def bits_case(draw: Any) -> Case:
    batch = (draw(BATCH),)
    sample = (draw(st.sampled_from([1, 4, 16])),)
    impl = draw(st.sampled_from(IMPLS))
    fn = jax.vmap(lambda k: jax.random.bernoulli(k, 0.9, sample))
    return _case(draw, "random_bits", fn, (_keys(batch, impl),), grad=False)


@st.composite
def wrap_case(draw: Any) -> Case:
    """key_data / wrap_key_data: the data's trailing words may be drawn split (rbg's 4 words over a 2- or 4-way
    split): a key is hashed whole, so they are gathered first."""
    batch = draw(BATCH)
    impl = draw(st.sampled_from(IMPLS))
    words = 2 if impl == "threefry2x32" else 4
    if draw(st.booleans()):
        fn = lambda d: jax.random.wrap_key_data(d, impl=impl)  # noqa: E731
        return _case(draw, "random_wrap", fn, (jax.ShapeDtypeStruct((batch, words), jnp.uint32),), grad=False)
    return _case(draw, "random_unwrap", jax.random.key_data, (_keys((batch,), impl),), grad=False)


@st.composite
def dropout_case(draw: Any) -> Case:
    """A dropout MLP's loss and gradient: one key per example, laid out like the batch or otherwise."""
    b, d, h = draw(BATCH), draw(st.sampled_from([16, 32])), draw(st.sampled_from([16, 32]))

    def mlp(x: Any, w: Any, keys: Any) -> Any:
        hidden = jnp.tanh(x @ w)
        keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.9, row.shape))(keys, hidden)
        return jnp.where(keep, hidden / 0.9, 0.0)

    args = (
        jax.ShapeDtypeStruct((b, d), jnp.float32),
        jax.ShapeDtypeStruct((d, h), jnp.float32),
        _keys((b,), "threefry2x32"),
    )
    case = _case(draw, "dropout", mlp, args)
    # The keys are laid out like the batch they drop from (made from the step's key per example, as users do);
    # keys split where the batch is not: DROPOUT_MISS below.
    batch_split = (tuple(case.specs[0]) + (None,))[0]
    # (Built anew from the unplaced arguments: on Explicit axes Case places them by its specs, the keys' new one.)
    specs = (case.specs[0], case.specs[1], P(batch_split))
    return Case(case.primitive, mlp, args, specs, case.mesh_rank, case.explicit, case.grad, case.memory)


STRATEGIES: dict[str, Any] = {
    "split": split_case(),
    "fold_in": fold_in_case(),
    "bits": bits_case(),
    "wrap": wrap_case(),
    "dropout": dropout_case(),
}


@pytest.mark.parametrize("family", sorted(STRATEGIES))
def test_prng_rule_matches_xla(family: str) -> None:
    FAST(given(STRATEGIES[family])(check))()


# The deep draws the rules or the memory walk do not yet hold to XLA (not strict: the derandomized draws follow the
# code's paths; the misses are named, not hidden).  Collectives, bytes and layouts held in every draw seen; peak:
DEEP_MISSES = {
    "dropout": (
        "keys and batch split over both axes of a 2-axis mesh, w's columns over one of them "
        "(x[8@(a,b), 16] @ w[16, 16@a]): XLA gives the result w's split P(None, 'a') where explain keeps the "
        "batch's, and with w[16, 16@b] XLA moves x by 13 all-gathers against explain's one; layout propagation, "
        "not this module's rules (reached once the Explicit draws placed the keys by their own spec; the earlier "
        "miss, x[8@a, 16] @ w[16@a, 32]'s forward at 0.69x XLA's peak, is 1.04x now: the threefry loop's buffers)"
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
def test_prng_rule_matches_xla_deep(family: str) -> None:
    DEEP(given(STRATEGIES[family])(check))()


# -- fixed programs: each layout the rules distinguish, on a key batch split over a mesh axis ------------------


def _fixed(
    primitive: str, fn: Any, args: tuple[Any, ...], specs: tuple[P, ...], rank: int, explicit: bool, grad: bool = False
) -> Case:
    return Case(primitive, fn, args, specs, rank, explicit, grad)


FIXED = [
    # the batch's split carries through; the new keys are whole on each device; no collective
    _fixed(
        "random_split", jax.vmap(lambda k: jax.random.split(k, 4)), (_keys((16,), "threefry2x32"),), (P("a"),), 1, True
    ),
    _fixed(
        "random_split",
        jax.vmap(jax.vmap(lambda k: jax.random.split(k, (2, 3)))),
        (_keys((16, 4), "threefry2x32"),),
        (P("a", "b"),),
        2,
        False,
    ),
    _fixed(
        "random_split",
        jax.vmap(lambda k: jax.random.split(k, 3)),
        (_keys((256,), "threefry2x32"),),
        (P("a"),),
        1,
        False,
    ),
    _fixed("random_fold_in", jax.vmap(lambda k: jax.random.fold_in(k, 3)), (_keys((256,), "rbg"),), (P("a"),), 1, True),
    _fixed(
        "random_bits",
        jax.vmap(lambda k: jax.random.bits(k, (16,))),
        (_keys((256,), "threefry2x32"),),
        (P("a"),),
        1,
        False,
    ),
    # unsafe_rbg folds the first message into one key: split messages are sliced (one all-reduce of 16 B)
    _fixed(
        "random_fold_in",
        jax.vmap(jax.random.fold_in),
        (_keys((8,), "unsafe_rbg"), jax.ShapeDtypeStruct((8,), jnp.uint32)),
        (P(None), P("a")),
        1,
        False,
    ),
    # rbg / unsafe_rbg draw a batch from its first key: one all-reduce of its 16 B, the result whole everywhere
    _fixed("random_bits", jax.vmap(lambda k: jax.random.bits(k, (16,))), (_keys((256,), "rbg"),), (P("a"),), 1, False),
    _fixed(
        "random_split", jax.vmap(lambda k: jax.random.split(k, 3)), (_keys((256,), "unsafe_rbg"),), (P("a"),), 1, False
    ),
    # the key data's words split: gathered before the keys are made (one all-gather)
    _fixed(
        "random_wrap",
        lambda d: jax.random.wrap_key_data(d, impl="rbg"),
        (jax.ShapeDtypeStruct((16, 4), jnp.uint32),),
        (P("a", "b"),),
        2,
        False,
    ),
    _fixed(
        "random_wrap",
        lambda d: jax.random.wrap_key_data(d, impl="rbg"),
        (jax.ShapeDtypeStruct((16, 4), jnp.uint32),),
        (P(None, "b"),),
        2,
        False,
    ),
    _fixed("random_unwrap", jax.random.key_data, (_keys((16,), "threefry2x32"),), (P("a"),), 1, True),
    # keys whole: new keys and key data are buffers made whole on every device (only bits take their readers' split)
    _fixed(
        "random_split", jax.vmap(lambda k: jax.random.split(k, 2)), (_keys((32,), "threefry2x32"),), (P(),), 1, False
    ),
    _fixed("random_unwrap", jax.random.key_data, (_keys((32,), "rbg"),), (P(),), 1, False),
]


@pytest.mark.parametrize(
    "case", FIXED, ids=lambda c: f"{c.primitive}-{c.args[0].shape}-{c.specs}-explicit={c.explicit}"
)
def test_prng_fixed_programs_match_xla(case: Case) -> None:
    check(case)


def _dropout_mlp_loss(w1: Any, w2: Any, x: Any, keys: Any) -> Any:
    h = jnp.tanh(x @ w1)
    keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.9, row.shape))(keys, h)
    return jnp.mean((jnp.where(keep, h / 0.9, 0.0) @ w2) ** 2)


@pytest.mark.parametrize("explicit", [False, True])
def test_a_dropout_mlp_gradient_is_complete_and_matches_xla(explicit: bool) -> None:
    """The user's program: the gradient of a 2-layer dropout MLP, data-parallel, keys split with the batch (one
    per example, from split then fold_in of the step's key) — explain's collectives, bytes and peak are XLA's."""

    def step(w1: Any, w2: Any, x: Any, key: Any) -> Any:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, 1))(jax.random.split(key, x.shape[0]))
        return jax.grad(_dropout_mlp_loss, argnums=(0, 1))(w1, w2, x, keys)

    case = Case(
        "dropout_mlp",
        lambda w1, w2, x, keys: jax.grad(_dropout_mlp_loss, argnums=(0, 1))(w1, w2, x, keys),
        (
            jax.ShapeDtypeStruct((32, 64), jnp.float32),
            jax.ShapeDtypeStruct((64, 32), jnp.float32),
            jax.ShapeDtypeStruct((64, 32), jnp.float32),
            _keys((64,), "threefry2x32"),
        ),
        (P(), P(), P(("a", "b")), P(("a", "b"))),
        2,
        explicit,
        False,  # the case's fn is already the gradient
    )
    check(case)
    # and through the public face, with the key split inside the step: complete, nothing unfollowed (on Auto axes;
    # on Explicit ones JAX refuses the step as typed: the keys, split from a replicated key, are vmapped with rows
    # of a batch split over (data, model), and explain says so as an EinshardError naming in_specs=)
    args = (jnp.ones((32, 64)), jnp.ones((64, 32)), jnp.ones((64, 32)), jax.random.key(0))
    in_specs = (None, None, "b d -> b@(data,model) d", None)
    auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    report = einshard.explain(step, *args, mesh=auto, in_specs=in_specs)
    assert report.complete and report.unfollowed == ()
    with pytest.raises(EinshardError, match=r"Explicit axes JAX refuses fn with its arguments typed by in_specs="):
        einshard.explain(step, *args, mesh=jax.make_mesh((4, 2), ("data", "model")), in_specs=in_specs)


def test_the_registry_holds_the_key_rules() -> None:
    for name in ("random_split", "random_bits", "random_unwrap"):
        assert RULES[name] is key_batch, name
    assert RULES["random_wrap"] is wrap
    assert RULES["random_fold_in"] is fold_in
    for name in ("random_seed", "random_clone"):
        assert name in RULES, name
    for rule in ("rules_random.key_batch", "rules_random.wrap", "rules_random.fold_in"):
        assert "test_prng_rules.py" in coverage.TESTS[rule], rule


# Keys split over a mesh axis that the batch is not split over, and a dot before the dropout whose contraction is
# split over that axis: XLA reduce-scatters the dot's partial sum onto the keys' batch split (its propagation reaches
# the mask's split from the keys, an argument), explain all-reduces it: the look-ahead for a dot's summed result
# (rules_indexing.consumer_split) reads only layouts already bound, and the mask is made after the dot.  Not
# reproduced yet (a gap of that look-ahead, not of this module's rules): named here, not hidden.
def _dropout_after_dot(x: Any, w: Any, keys: Any) -> Any:
    hidden = jnp.tanh(x @ w)
    keep = jax.vmap(lambda k, row: jax.random.bernoulli(k, 0.9, row.shape))(keys, hidden)
    return jnp.where(keep, hidden, 0.0)


DROPOUT_MISS = Case(
    "dropout",
    _dropout_after_dot,
    (
        jax.ShapeDtypeStruct((8, 16), jnp.float32),
        jax.ShapeDtypeStruct((16, 16), jnp.float32),
        _keys((8,), "threefry2x32"),
    ),
    (P(None, "a"), P("a", None), P("a")),
    1,
    False,
    False,
)


@pytest.mark.xfail(reason="a dot's partial sum lands on a split its consumer takes from a later-made mask", strict=True)
def test_keys_split_off_the_batch_after_a_split_contraction() -> None:
    check(DROPOUT_MISS)


# -- the threefry loop's bytes, exactly: one model for bits fused into their reader and bits that are the output ----


def _bits_out(k: Any) -> Any:
    return jax.random.bits(k, (64, 16))


def _vmapped_bits(k: Any) -> Any:
    return jax.vmap(lambda kk: jax.random.bits(kk, (16,)))(k)


def _mask(x: Any, k: Any) -> Any:
    return x * jax.random.bernoulli(k, 0.9, x.shape)


_F32 = jax.ShapeDtypeStruct((64, 128), jnp.float32)
# (program, arguments, layouts, how close explain's peak is to XLA's): XLA:CPU's buffer assignment holds, for a
# threefry draw, the loop's two state words and one temporary word per element, six 64-byte-aligned per-key u32
# arrays and 388 bytes, and the bits' buffer (the output's, or the reader's result: the walk's fourth word).  rbg's
# RngBitGenerator is expanded into the reader's loop: nothing of its own (XLA's last 132-196 B: its loop's state).
LOOP_PROGRAMS = {
    "threefry-bits-out-whole-key": (_bits_out, (_keys((), "threefry2x32"),), (P(),), 0.0),
    "threefry-bits-out-whole-batch": (_vmapped_bits, (_keys((64,), "threefry2x32"),), (P(),), 0.0),
    "threefry-bits-out-split-batch": (_vmapped_bits, (_keys((256,), "threefry2x32"),), (P("a"),), 0.0),
    "threefry-mask-split-x": (_mask, (_F32, _keys((), "threefry2x32")), (P("a"), P()), 0.0),
    "threefry-mask-whole-x": (_mask, (_F32, _keys((), "threefry2x32")), (P(), P()), 0.0),
    "rbg-bits-out-whole-batch": (_vmapped_bits, (_keys((64,), "rbg"),), (P(),), 0.03),
    "rbg-mask-split-x": (_mask, (_F32, _keys((), "rbg")), (P("a"), P()), 0.03),
    "unsafe_rbg-mask-whole-x": (_mask, (_F32, _keys((), "unsafe_rbg")), (P(), P()), 0.01),
}


@pytest.mark.parametrize("name", sorted(LOOP_PROGRAMS))
def test_random_bits_peak_is_xlas_buffer_assignment(name: str) -> None:
    """The random bits' bytes held once (memory._random_bits / _loop_bytes; HASH_SCRATCH is split's and
    fold_in's): exact for threefry, whole or split, output or fused, on an Auto mesh; rbg within 3%.  (Merged
    with a second model of the same loop, these held it twice: 2.5x XLA's peak on the output bits.)"""
    fn, args, specs, rel = LOOP_PROGRAMS[name]
    case = Case("random_bits", fn, args, specs, 1, False, False)
    mesh = _mesh(1, False)
    _, _, want_outs, want_peak = _xla(case, mesh, fn)
    report, _, _, got_outs = _explain(case, mesh, fn)
    assert report.peak_bytes == pytest.approx(want_peak, rel=rel, abs=0), (report.peak_bytes, want_peak)
    assert got_outs == [_spec_dims(o, len(d)) for o, d in zip(want_outs, got_outs)], (got_outs, want_outs)
