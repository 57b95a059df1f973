"""An elementwise op whose operands disagree, read by a placement: explain's collectives (kinds, bytes, group sizes)
and peak memory against XLA's compiled program, on a minimal optimizer step, Auto and Explicit meshes.

Adam's moments of a weight kept whole, ``mu2 = 0.9 * mu + 0.1 * g`` with the gradient g split over 'model' (a
Dense kernel behind a channel-split conv, the external corpus' flax_bn tp / dp_tp steps): on Explicit axes the step
runs in ``jax.sharding.auto_axes``, whose exit reshards each output whole inside the program.  Shardy settles that
placement before the add: mu2 is made whole (``0.1 * g`` gathered at the add, 640 B), and so is the update read from
the moments, so the new weight needs no gather: two all-gathers, where explain made all three results split and
gathered each at the exit.  Under Auto axes the ``out_shardings`` are not part of the program and XLA gathers all
three outputs (rules_structural._placed_reader_split reads only a placement in the program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard.testing import hlo


def _adam(p: jax.Array, mu: jax.Array, nu: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    mu2 = 0.9 * mu + 0.1 * g
    nu2 = 0.99 * nu + 0.01 * g * g
    return p - 0.01 * mu2 / (jnp.sqrt(nu2) + 1e-8), mu2, nu2


@pytest.mark.parametrize("kind, gathers", [("explicit", 2), ("auto", 3)])
def test_moments_placed_whole_are_gathered_at_their_add_as_xla_does(kind: str, gathers: int) -> None:
    t = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(t, t))
    whole = NamedSharding(mesh, P())
    in_sh = (whole, whole, whole, NamedSharding(mesh, P("model")))
    out_sh = (whole,) * 3
    args = [jax.device_put(jnp.ones((32, 10)), s) for s in in_sh]
    fn = jax.sharding.auto_axes(_adam, out_sharding=out_sh) if kind == "explicit" else _adam
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh).lower(*args).compile()
        report = trace(fn, *args, mesh=mesh).report(("a b -> a b",) * 3 + ("a b -> a@model b",), [P()] * 3)
    xla = hlo.normalized(compiled.as_text())
    got = sorted((c.kind, c.array_bytes, c.group_size) for op in report.ops for c in op.collectives)
    assert got == sorted((c.kind, c.array_bytes, c.group_size) for c in xla)
    assert len(got) == gathers
    assert sum(c.bytes for op in report.ops for c in op.collectives) == sum(c.sent_bytes for c in xla)
    mem = compiled.memory_analysis()
    peak = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
    assert 0.75 * peak <= report.peak_bytes <= 1.25 * peak
