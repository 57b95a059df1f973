"""A dot whose operands split one mesh axis on two result factors, settled by its elementwise readers: explain's
collectives (kinds, bytes, group sizes) and peak memory against XLA's compiled program, on minimal programs.

A Megatron attention's output-projection weight gradient ``g[b, s, d@model] . y[b, s, h@model, k] -> [d, h, k]``
(transposed to the kernel's ``[h, k, d]``) cannot keep both splits.  With no output asking (the step's optimizer
reads the gradient first), Shardy's elementwise-first pass reaches the dot from the optimizer's moment
``v[h@model, k, d]``, read with the gradient (``dw * v``, or Adafactor's ``0.9 * v + 0.1 * dw * dw`` and
``dw * new_v ** -0.5``), before the dot's own operands settle it: XLA gathers g and keeps y's head split (its dot
is ``f32[32, 16]``: d whole, the heads halved), where explain gathered y and all-to-all'd the gradient at each
reader (the external corpus' flax_encdec tp / dp_tp steps under optax.adafactor: 6 all-to-alls XLA does not make).
The moment's split is read even where its readers come after the dot in program order (rules_indexing._seeded_dims).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard.testing import hlo

B, S, H, K, D = 8, 8, 4, 8, 32


def _gradient(order: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """The weight gradient [h, k, d] of y . w, the cotangent g the left operand or the right one."""
    if order == "cotangent_first":
        return lambda y, g: jnp.einsum("bsd,bshk->dhk", g, y).transpose(1, 2, 0)
    return lambda y, g: jnp.einsum("bshk,bsd->hkd", y, g)


def _step(order: str, reader: str) -> Callable[..., Any]:
    grad = _gradient(order)

    def step(y: jax.Array, g: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        dw = grad(y, g)
        if reader == "adafactor":  # optax.scale_by_factored_rms on an unfactored kernel
            new_v = 0.9 * v + 0.1 * (dw * dw + 1e-30)
            return dw * new_v**-0.5, new_v
        return dw * v, v

    return step


@pytest.mark.parametrize("reader", ["moment", "adafactor"])
@pytest.mark.parametrize("order", ["cotangent_first", "activation_first"])
def test_a_clashing_weight_gradient_takes_its_optimizer_readers_split(order: str, reader: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto))
    step = _step(order, reader)
    heads = P(None, None, "model")
    specs = (heads, heads, P("model"))
    args = tuple(jnp.ones(s, jnp.float32) for s in ((B, S, H, K), (B, S, D), (H, K, D)))
    in_sh = tuple(NamedSharding(mesh, s) for s in specs)
    out_sh = (NamedSharding(mesh, P("model")),) * 2
    with jax.set_mesh(mesh):
        compiled = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()
        exprs = ("b s h k -> b s h@model k", "b s d -> b s d@model", "h k d -> h@model k d")
        report = trace(step, *args, mesh=mesh).report(exprs, [P("model"), P("model")])
    xla = hlo.normalized(compiled.as_text())
    got = sorted((c.kind, c.array_bytes, c.group_size) for op in report.ops for c in op.collectives)
    want = sorted((c.kind, c.array_bytes, c.group_size) for c in xla)
    # (XLA counts a collective-permute's group as the devices that send or receive; explain as the permute's ring)
    assert [(k, b) for k, b, _ in got] == [(k, b) for k, b, _ in want]
    assert not any(op.primitive in ("add", "mul", "output") and op.collectives for op in report.ops)
    assert sum(c.bytes for op in report.ops for c in op.collectives) == sum(c.sent_bytes for c in xla)
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    assert 0.75 * peak <= report.peak_bytes <= 1.25 * peak
