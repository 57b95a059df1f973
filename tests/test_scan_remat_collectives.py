"""A scan over remat'd layers under FSDP and data parallelism: explain's collectives against XLA's HLO.

XLA's while body moves each layer's FSDP weight with an all-gather and its gradient with a
reduce-scatter every iteration (the per-iteration gradient is summed straight to its split); on
Explicit axes the transposed bias broadcast is typed replicated, and XLA all-gathers the
activation's cotangent for it.  Kinds, counts per step (a loop collective counts once per
iteration, as :func:`einshard.testing.hlo.normalized` reads the trip count) and bytes are
compared with the compiled program, for placed inputs on Auto and Explicit meshes, forward and
``jax.grad``, with and without ``jax.checkpoint``.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard.testing import hlo

L, B, S, D, F = 4, 8, 8, 32, 64
SPECS = {
    "dp": {"w1": P(), "b1": P(), "w2": P(), "b2": P()},
    "fsdp": {"w1": P(None, "data"), "b1": P(), "w2": P(None, "data"), "b2": P()},
}


def _loss(remat: bool) -> Any:
    def block(h: Any, p: Any) -> tuple[Any, None]:
        z = h @ p["w1"]
        y = jax.nn.gelu(z + jnp.broadcast_to(p["b1"], z.shape))  # as Haiku's Linear adds its bias
        return h + y @ p["w2"] + p["b2"], None

    step = jax.checkpoint(block) if remat else block

    def loss(params: Any, x: Any) -> Any:
        return jnp.mean(jax.lax.scan(step, x, params)[0] ** 2)

    return loss


def _compare(strategy: str, mode: str, remat: bool, kind: str) -> tuple[Counter, Counter, float, float]:
    t = AxisType.Auto if kind == "auto" else AxisType.Explicit
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(t, t))
    specs, xspec = SPECS[strategy], P("data")
    shapes = {"w1": (L, D, F), "b1": (L, F), "w2": (L, F, D), "b2": (L, D)}
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))  # noqa: E731
    params = {k: sds(s, specs[k]) for k, s in shapes.items()}
    x = sds((B, S, D), xspec)
    fn = jax.grad(_loss(remat)) if mode == "grad" else _loss(remat)
    out = specs if mode == "grad" else P()
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    with jax.set_mesh(mesh):
        compiled = (
            jax.jit(
                fn,
                in_shardings=(jax.tree.map(shard, specs, is_leaf=is_spec), shard(xspec)),
                out_shardings=jax.tree.map(shard, out, is_leaf=is_spec),
            )
            .lower(params, x)
            .compile()
        )
        report = trace(fn, params, x, mesh=mesh).report((specs, xspec), jax.tree.leaves(out, is_leaf=is_spec))
    ours = Counter(c.kind for op in report.ops for c in op.collectives for _ in range(op.repeat) if c.group_size > 1)
    theirs: Counter = Counter()
    xla = hlo.normalized(compiled.as_text())
    for c in xla:
        theirs[c.kind] += c.runs
    ours_bytes = float(sum(c.bytes * op.repeat for op in report.ops for c in op.collectives))
    return ours, theirs, ours_bytes, float(sum(c.sent_bytes * c.runs for c in xla))


# The default run keeps one case per fix (the remat'd FSDP gradient's per-iteration reduce-scatters on both
# mesh kinds, the Explicit bias gradients' all-gathers); the rest run with the slow tests.
_SLOW = pytest.mark.slow
CASES = [
    pytest.param("fsdp", "grad", True, "auto"),
    pytest.param("fsdp", "grad", True, "explicit"),
    pytest.param("dp", "grad", True, "explicit"),
    pytest.param("fsdp", "grad", False, "explicit", marks=_SLOW),
    pytest.param("fsdp", "grad", False, "auto", marks=_SLOW),
    pytest.param("dp", "grad", True, "auto", marks=_SLOW),
    pytest.param("fsdp", "fwd", True, "auto", marks=_SLOW),
    pytest.param("fsdp", "fwd", True, "explicit", marks=_SLOW),
]


@pytest.mark.parametrize(("strategy", "mode", "remat", "kind"), CASES)
def test_scanned_stack_collectives_match_xla(strategy: str, mode: str, remat: bool, kind: str) -> None:
    ours, theirs, ours_bytes, theirs_bytes = _compare(strategy, mode, remat, kind)
    assert ours == theirs
    assert ours_bytes == pytest.approx(theirs_bytes, rel=0.10)
