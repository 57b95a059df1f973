"""A dot's partial sum whose consumer is another dot contracting the summed axis split over the summed mesh axes.

Found on a model nobody here wrote (a Flax linen block whose first MLP Dense contracts the attention output's
features split over 'model'): explain's consumer rule (rules_indexing.consumer_split, the dot branch)
reduce-scattered the sum onto the consumer's split, where XLA, with mesh axes neither dot operand uses holding
at least as many devices as the sum, all-reduces one slice per idle group and permutes it into place (as it
does for a conv's input gradient: rules_windows._scatter_axes).  Without idle axes it is a reduce-scatter
(on CPU an all-reduce and a dynamic slice, einshard.testing.hlo.normalized).
"""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard.testing import hlo

B, S, D, F, H = 8, 8, 32, 64, 16


def _mesh():
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def _row_then_contract(x, wo, w1):
    a = jnp.einsum("bsh,hd->bsd", x, wo)  # partial over 'model' (h split)
    return jnp.einsum("bsd,df->bsf", a, w1).sum()  # w1 splits d over 'model'


def _row_then_weight_grad(x, wo, y):
    a = jnp.einsum("bsh,hd->bsd", x, wo)
    return jnp.einsum("bsd,bsf->df", a, y).sum()  # y splits s over 'model'


CASES = [
    # (function, shapes, specs, XLA's collectives measured on jax 0.10.2's XLA:CPU, normalized)
    pytest.param(
        _row_then_contract,
        [(B, S, H), (H, D), (D, F)],
        [P(None, None, "model"), P("model"), P("model")],
        {"all-reduce": 2, "collective-permute": 1},
        id="idle-data-axis",
    ),
    pytest.param(
        _row_then_contract,
        [(B, S, H), (H, D), (D, F)],
        [P("data", None, "model"), P("model"), P("model")],
        {"all-reduce": 2, "reduce-scatter": 1},
        id="batch-on-data",
    ),
    pytest.param(
        _row_then_weight_grad,
        [(B, S, H), (H, D), (B, S, F)],
        [P("data", None, "model"), P("model"), P("data", "model")],
        {"all-reduce": 2, "reduce-scatter": 1},
        id="weight-grad-batch-on-data",
    ),
]


@pytest.mark.parametrize(("fn", "shapes", "specs", "xla_kinds"), CASES)
def test_explain_names_xlas_collectives(fn, shapes, specs, xla_kinds):
    mesh = _mesh()
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    compiled = jax.jit(fn, in_shardings=[NamedSharding(mesh, s) for s in specs]).lower(*args).compile()
    xla = Counter(c.kind for c in hlo.normalized(compiled.as_text()) if c.group_size > 1)
    assert xla == Counter(xla_kinds)  # the measurement this test was written from still holds
    report = trace(fn, *args, mesh=mesh).report(tuple(specs))
    got = Counter(c.kind for op in report.ops for c in op.collectives if c.group_size > 1)
    assert got == xla and not report.approximate
    xla_bytes = sum(c.array_bytes * c.runs for c in hlo.normalized(compiled.as_text()) if c.group_size > 1)
    got_bytes = sum(c.array_bytes * op.repeat for op in report.ops for c in op.collectives if c.group_size > 1)
    assert got_bytes == pytest.approx(xla_bytes, rel=0.10)
