"""Explicit-mode meshes: where JAX says "Contracting dimensions are sharded and it is ambiguous", the analyzer
lists the legal result layouts with their costs, and its recommendation makes the JAX call succeed."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard.analysis import spec_partitions
from einshard.testing import hlo


@pytest.fixture(scope="module")
def explicit_mesh():
    return jax.make_mesh((4,), ("x",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])


def _operands(mesh):
    a = jax.device_put(np.arange(8 * 16, dtype=np.float32).reshape(8, 16), NamedSharding(mesh, P(None, "x")))
    b = jax.device_put(np.arange(16 * 32, dtype=np.float32).reshape(16, 32) / 7, NamedSharding(mesh, P("x", None)))
    return a, b


def test_ambiguous_contraction_gets_legal_outputs_and_a_working_recommendation(explicit_mesh):
    a, b = _operands(explicit_mesh)
    with jax.set_mesh(explicit_mesh):
        with pytest.raises(Exception, match="ambiguous"):
            jnp.einsum("mk,kn->mn", a, b)
        plan = einshard.analyze("mk,kn->mn", a, b)  # layouts and mesh from the arrays
        outputs = plan.legal_outputs()
        specs = [s for s, _, _ in outputs]
        for want in (P(None, None), P("x", None), P(None, "x"), P(None, None, unreduced={"x"})):
            assert any(spec_partitions(s) == spec_partitions(want) and s.unreduced == want.unreduced for s in specs)
        times = [t for _, t, _ in outputs]
        assert times == sorted(times) and all(why for _, _, why in outputs)

        expected = np.asarray(a) @ np.asarray(b)
        out = jnp.einsum("mk,kn->mn", a, b, out_sharding=plan.out_spec)  # the recommendation
        np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)
        assert out.sharding.spec == plan.out_spec
        for s in specs:  # every complete legal layout works too
            if not s.unreduced:
                out = jnp.einsum("mk,kn->mn", a, b, out_sharding=s)
                np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5)


def test_each_legal_output_compiles_to_the_predicted_collectives(explicit_mesh):
    a, b = _operands(explicit_mesh)
    with jax.set_mesh(explicit_mesh):
        plan = einshard.analyze("m k, k n -> m? n?", a, b)
        for option in plan.options:
            if option.out_layout.unreduced or option.operands_used != plan.operands:
                continue  # explicit mode keeps operands as they are: only result-side choices apply
            spec = option.out_spec
            f = jax.jit(lambda x, y, spec=spec: jnp.einsum("mk,kn->mn", x, y, out_sharding=spec))
            text = f.lower(a, b).compile().as_text()
            kinds = {"reduce-scatter": "reduction", "all-reduce": "reduction"}
            got = Counter((kinds.get(c.kind, c.kind), c.array_bytes) for c in hlo.normalized(text))
            want = Counter((kinds.get(c.kind, c.kind), c.array_bytes) for c in option.collectives)
            assert got == want, (spec, got, want)


def test_unambiguous_cases_need_no_choice(explicit_mesh):
    a = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(explicit_mesh, P("x", None)))
    b = jax.device_put(np.ones((16, 32), np.float32), NamedSharding(explicit_mesh, P()))
    with jax.set_mesh(explicit_mesh):
        plan = einshard.analyze("m k, k n -> m? n?", a, b)
        assert plan.collectives == () and plan.strategy == "data parallel"
        out = jnp.einsum("mk,kn->mn", a, b, out_sharding=plan.out_spec)
        assert out.sharding.spec == P("x", None)


def test_explain_names_the_placement_jax_refuses_before_any_sharding_rule(explicit_mesh):
    """A ``lax.scan`` over arrays whose scanned axis is split: JAX refuses it while tracing with a plain ValueError
    (before any sharding rule, so the Explicit check never sees it). explain says it is the placement, naming the
    split argument, with an EinshardError; the same step on the same shapes, placed so JAX takes it, is explained;
    a step that fails whatever the placement raises the user's own error as JAX raised it."""

    def step(xs):
        return jax.lax.scan(lambda c, r: (c + r, None), jnp.zeros(xs.shape[1:]), xs)[0].sum()

    split_rows = jax.device_put(jnp.ones((8, 16)), NamedSharding(explicit_mesh, P("x", None)))
    with pytest.raises(einshard.EinshardError, match=r"refuses fn on the arguments as they are placed") as info:
        einshard.explain(step, split_rows)
    assert "xs should be replicated" in str(info.value) and "P('x', None)" in str(info.value)
    assert info.value.__suppress_context__  # not a raw JAX error chained under ours

    split_cols = jax.device_put(jnp.ones((8, 16)), NamedSharding(explicit_mesh, P(None, "x")))
    report = einshard.explain(step, split_cols)
    assert report.complete and report.comm_bytes > 0  # the final sum over the split columns is all-reduced

    def broken(xs):
        return xs @ jnp.ones((3, 3))  # a shape error, whatever the placement

    with pytest.raises(TypeError, match="dot_general requires contracting dimensions to have the same shape"):
        einshard.explain(broken, split_rows)
