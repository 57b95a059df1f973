"""A mixture-of-experts router meeting expert-split activations: explain's collectives equal XLA's, unmarked.

The program (keras-hub's Mixtral block, minimal): router logits on token-split inputs, softmax, ``top_k``, the
probabilities normalised, ``one_hot(top_i) · top_p`` summed over ``k`` into routing weights ``[e, t]``, expert
feed-forwards ``[e, t, f]`` with the expert weights split over the same mesh axis as the tokens, and the
routed expert sum.  The two splits meet at the ``mul`` weighting the experts' outputs.  XLA does not move the
routing weights there (an all-to-all): its sharding propagation carries the expert split back through the
routing chain and all-gathers the top-k indices and probabilities, and in the gradient reduce-scatters their
cotangents back onto the tokens' split (einshard._src.analysis.program.upstream).  explain models that rule;
this file holds it against the compiled HLO and ``memory_analysis()`` over token and expert counts, ``k``,
widths, 1-, 2- and 3-axis meshes, Auto and Explicit, forward and ``jax.grad``: kinds and counts exact, bytes
within 10%, peak within the range the report's caveat states (top_k's scratch).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_primitive_rules import DEEP, FAST, _mesh

from einshard._src.analysis.program import trace
from einshard._src.analysis.program.memory import SCRATCH
from einshard.testing import hlo

F32 = jnp.float32
BYTES_TOLERANCE = 0.10
PEAK_RANGE = SCRATCH["top_k"][1:]  # the report's caveat for top_k's scratch (explain / XLA)


def _moe(k: int, residual: bool = False) -> Any:
    def moe(x: Any, wr: Any, wg: Any, wo: Any) -> Any:
        e = wr.shape[1]
        probs = jax.nn.softmax(x @ wr, axis=-1)
        top_p, top_i = lax.top_k(probs, k)
        top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
        routing = jnp.sum(jax.nn.one_hot(top_i, e, dtype=top_p.dtype) * top_p[..., None], axis=1).T  # [e, t]
        hidden = jax.nn.silu(jnp.einsum("td,edf->etf", x, wg))
        out = jnp.einsum("etf,efd->etd", hidden, wo)
        y = jnp.sum(out * routing[:, :, None], axis=0)
        # A residual stream (a decoder block's): the expert sum lands token-split, a reduce-scatter, and in the
        # gradient the token-split cotangent is gathered for the expert-split weighting (the split carried back).
        return x + y if residual else y

    return moe


def _loss(fn: Any) -> Any:
    return jax.grad(lambda *a: jnp.mean(fn(*a) ** 2), argnums=(0, 1, 2, 3))


def _args(t: int, d: int, f: int, e: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    return tuple(jax.ShapeDtypeStruct(s, F32) for s in ((t, d), (d, e), (e, d, f), (e, f, d)))


def _program(fn: Any, mesh: Any, specs: Any, grad: bool, explicit: bool) -> tuple[Any, Any]:
    """(the step as run, its result layouts): gradients laid out as their parameters, the forward's result
    tokens split as its input; on an Explicit mesh JAX refuses the expert einsum (tokens and experts split over
    one mesh axis), so the step runs inside ``jax.sharding.auto_axes``, as JAX documents."""
    out = tuple(NamedSharding(mesh, s) for s in specs) if grad else NamedSharding(mesh, specs[0])
    if explicit:
        fn = jax.sharding.auto_axes(fn, out_sharding=out)
    return fn, out


def _measured(fn: Any, mesh: Any, args: Any, specs: Any, out: Any, explicit: bool) -> tuple[Counter, float, float]:
    shardings = tuple(NamedSharding(mesh, s) for s in specs)
    with jax.set_mesh(mesh):
        if explicit:
            placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(args, shardings)]
            compiled = jax.jit(fn, out_shardings=out).lower(*placed).compile()
        else:
            compiled = jax.jit(fn, in_shardings=shardings, out_shardings=out).lower(*args).compile()
    found = [c for c in hlo.normalized(compiled.as_text()) if c.group_size > 1]
    kinds: Counter = Counter()
    for c in found:
        kinds[c.kind] += c.runs
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return kinds, float(sum(c.sent_bytes * c.runs for c in found)), float(peak)


def _explained(fn: Any, mesh: Any, args: Any, specs: Any, out: Any, explicit: bool) -> Any:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    out_specs = [s.spec for s in jax.tree.leaves(out)]
    if explicit:
        placed = tuple(
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, specs)
        )
        with jax.set_mesh(mesh):
            return trace(fn, *placed, mesh=sizes).report(None, out_specs)
    return trace(fn, *args, mesh=sizes).report(specs, out_specs)


def _kinds(report: Any) -> Counter:
    return Counter(c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1)


def split_axes(mesh: Any) -> tuple[str, ...]:
    """The mesh axes tokens and experts are split over: at least 4 ways (the first two axes of (2, 2, 2)).

    Not a 2-way axis beside unused ones: XLA then partitions the expert einsum itself over the unused axes too
    (a collective-permute and a 4-way all-gather of the tokens, measured on (2, 2, 2) and (2, 4) meshes), a
    dot_general heuristic of its own, not the router's."""
    names, sizes = tuple(mesh.axis_names), tuple(mesh.axis_sizes)
    return names[:1] if sizes[0] >= 4 else names[:2]


def check_router(
    t: int, d: int, f: int, e: int, k: int, rank: int, explicit: bool, grad: bool, residual: bool = False
) -> None:
    """explain against XLA on the routed expert block, tokens and experts split over the mesh's first axis."""
    mesh = _mesh(rank, explicit)
    split = split_axes(mesh)
    specs = (P(split), P(), P(split), P(split))
    fn = _moe(k, residual)
    run, out = _program(_loss(fn) if grad else fn, mesh, specs, grad, explicit)
    args = _args(t, d, f, e)
    want_kinds, want_bytes, want_peak = _measured(run, mesh, args, specs, out, explicit)
    report = _explained(run, mesh, args, specs, out, explicit)
    got_kinds = _kinds(report)
    where = f"t={t} d={d} f={f} e={e} k={k} mesh={mesh.axis_sizes} explicit={explicit} grad={grad} res={residual}"
    assert report.complete and not report.approximate, (where, str(report).splitlines()[0])
    # XLA's gathers of the top-k outputs, never an all-to-all of the routing weights.
    assert "all-to-all" not in got_kinds and got_kinds["all-gather"] >= 2, (where, got_kinds)
    assert got_kinds == want_kinds, (where, got_kinds, want_kinds)
    assert abs(report.comm_bytes - want_bytes) <= BYTES_TOLERANCE * want_bytes, (where, report.comm_bytes, want_bytes)
    lo, hi = PEAK_RANGE
    assert lo * want_peak <= report.peak_bytes <= hi * want_peak, (where, report.peak_bytes, want_peak)


ROUTERS = st.tuples(
    st.sampled_from([16, 32, 64]),  # tokens
    st.sampled_from([8, 16]),  # model width
    st.sampled_from([8, 32]),  # expert width
    st.sampled_from([8, 16]),  # experts (divisible by every mesh's first axis)
    st.integers(1, 3),  # k
    st.sampled_from([1, 2, 3]),  # mesh rank: (8,), (4, 2), (2, 2, 2)
    st.booleans(),  # explicit
    st.booleans(),  # grad
    st.booleans(),  # a residual stream around the block
)


@FAST
@given(ROUTERS)
@example((64, 32, 64, 4, 2, 2, False, False, False))  # keras-hub's Mixtral sizes on the corpus's (4, 2) mesh
@example((64, 32, 64, 4, 2, 2, True, True, False))
@example((64, 32, 64, 4, 2, 2, False, True, True))  # the residual's cotangent gathered, as in the Mixtral block
@example((32, 16, 16, 8, 2, 3, False, True, False))
@example((32, 16, 16, 8, 3, 3, True, False, True))
def test_a_router_meeting_expert_split_activations_is_settled_upstream_as_xla_does(drawn: tuple) -> None:
    check_router(*drawn)


@pytest.mark.slow
@DEEP
@given(ROUTERS)
def test_a_router_meeting_expert_split_activations_is_settled_upstream_as_xla_does_deep(drawn: tuple) -> None:
    check_router(*drawn)
