"""The planner's collective combining (planner/combining.py) against the ops XLA compiles.

XLA's combiners merge independent collectives of one kind over the same device groups into one tuple-shaped op.
The collectives settled at the program's end (an output brought to its layout, a pending sum summed) depend only
on the output value's own upstream collectives: a data-parallel step's gradient all-reduces are independent of
each other and of the loss's, and XLA runs them as one all-reduce.  Each case compiles a training step (the
gradient of a small MLP) on the 8 CPU devices and counts XLA's collective instructions (a tuple-shaped one once,
each ``runs`` times) against ``combined_report``'s ops; explain's own count (one per collective, before
combining) is XLA's count of pieces.  On XLA:CPU only the all-reduce combiner runs, and a reduce-scatter is an
all-reduce whose result is sliced (COMBINER_RULES["cpu"]).  The byte threshold of a combined op (tens of MiB) is
not modelled: these programs are far below it.
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
from einshard._src.planner.combining import COMBINER_RULES, CombinerRule, combined_report
from einshard.testing import hlo

MESH_SHAPE = (4, 2)
AXES = ("data", "model")


def mlp_loss(params: list[jax.Array], x: jax.Array) -> jax.Array:
    h = x
    for i, w in enumerate(params):
        h = h @ w
        if i < len(params) - 1:
            h = jnp.tanh(h)
    return jnp.mean(h**2)


def scanned_loss(params: jax.Array, x: jax.Array) -> jax.Array:
    """The same MLP with its square layers stacked and scanned over (one layer per iteration)."""

    def layer(h: jax.Array, w: jax.Array) -> tuple[jax.Array, None]:
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, params)
    return jnp.mean(h**2)


def _widths(layers: int) -> list[int]:
    return [64] + [128] * (layers - 1) + [64]


def _mlp_params(layers: int) -> list[jax.ShapeDtypeStruct]:
    w = _widths(layers)
    return [jax.ShapeDtypeStruct((w[i], w[i + 1]), jnp.float32) for i in range(layers)]


def _tp(layers: int) -> list[P]:
    """Megatron pairs: column- then row-parallel."""
    return [P(None, "model") if i % 2 == 0 else P("model", None) for i in range(layers)]


def _fsdp(layers: int) -> list[P]:
    return [P("data")] + [P(None, "data")] * (layers - 1)


# name -> (parameter specs, batch spec) for a step of ``layers`` layers; the gradients are laid out as their
# parameters (out_shardings), as the planner asks.
LAYOUTS: dict[str, Callable[[int], tuple[list[P], P]]] = {
    "dp": lambda n: ([P()] * n, P(("data", "model"))),
    "fsdp": lambda n: (_fsdp(n), P("data")),
    "tp": lambda n: (_tp(n), P()),
    "dp_tp": lambda n: (_tp(n), P("data")),
}


def xla_ops(fn: Any, args: tuple[Any, ...], in_specs: Any, out_specs: Any, mesh: jax.sharding.Mesh) -> tuple[int, int]:
    """(XLA's collective ops, each tuple-shaped one once, times its runs; the pieces they carry, times runs)."""

    def shard(tree: Any) -> Any:
        return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=lambda s: isinstance(s, P))

    text = jax.jit(fn, in_shardings=shard(in_specs), out_shardings=shard(out_specs)).lower(*args).compile().as_text()
    runs: dict[str, int] = {}
    pieces = 0
    for c in hlo.normalized(text):
        runs[c.name] = c.runs
        pieces += c.runs
    return sum(runs.values()), pieces


def _check(fn: Any, args: tuple[Any, ...], in_specs: Any, out_specs: Any, mesh: jax.sharding.Mesh) -> int:
    ops, pieces = xla_ops(fn, args, in_specs, out_specs, mesh)
    leaves = jax.tree.leaves(out_specs, is_leaf=lambda s: isinstance(s, P))  # one spec per output leaf
    report, combined = combined_report(trace(fn, *args, mesh=mesh, profile="cpu"), in_specs, leaves)
    assert report.comm_count == pieces  # the same collectives before combining
    assert combined.ops == ops, (combined, ops, pieces)
    return ops


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit], ids=["auto", "explicit"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_training_steps_combined_collectives_are_xlas(layout: str, axis_type: AxisType) -> None:
    mesh = jax.make_mesh(MESH_SHAPE, AXES, axis_types=(axis_type,) * 2)
    layers = 3
    w_specs, x_spec = LAYOUTS[layout](layers)
    args = (_mlp_params(layers), jax.ShapeDtypeStruct((256, 64), jnp.float32))
    ops = _check(jax.value_and_grad(mlp_loss), args, (w_specs, x_spec), (P(), w_specs), mesh)
    # What XLA compiles (jax 0.10.2, XLA:CPU): every gradient all-reduce of a data-parallel step merged with the
    # loss's into one op; FSDP's three weight all-gathers unmerged, its reduce-scatters merged with the loss's
    # all-reduce; tensor parallelism's forward all-reduce, then its backward one merged with the loss's.
    assert ops == {"dp": 1, "fsdp": 4, "tp": 2, "dp_tp": 3}[layout]


def test_gradient_all_reduces_settled_at_the_end_are_one_op_at_any_depth() -> None:
    """Before, each output's settlement was put after every collective before it: a chain of 5 ops here."""
    mesh = jax.make_mesh(MESH_SHAPE, AXES, axis_types=(AxisType.Auto,) * 2)
    args = (_mlp_params(5), jax.ShapeDtypeStruct((256, 64), jnp.float32))
    specs = [P()] * 5
    assert _check(jax.value_and_grad(mlp_loss), args, (specs, P(("data", "model"))), (P(), specs), mesh) == 1


def test_a_scanned_stacks_gradient_all_reduces_are_one_per_iteration() -> None:
    """A scan over stacked layers, data parallel: XLA sums each layer's weight gradient inside the loop (one
    all-reduce per iteration: nothing merges across iterations) and the loss after it: 4 + 1 ops."""
    mesh = jax.make_mesh(MESH_SHAPE, AXES, axis_types=(AxisType.Auto,) * 2)
    args = (jax.ShapeDtypeStruct((4, 64, 64), jnp.float32), jax.ShapeDtypeStruct((256, 64), jnp.float32))
    in_specs, out_specs = (P(), P(("data", "model"))), (P(), P())
    assert _check(jax.value_and_grad(scanned_loss), args, in_specs, out_specs, mesh) == 5


def test_the_cpu_rule_merges_reduce_scatters_as_all_reduces_and_never_all_gathers() -> None:
    cpu = COMBINER_RULES["cpu"]
    assert cpu.kind_of("reduce-scatter") == "all-reduce" == cpu.kind_of("all-reduce")
    assert cpu.kind_of("all-gather") is None and cpu.kind_of("all-to-all") is None
    assert CombinerRule(frozenset({"all-gather"})).kind_of("all-gather") == "all-gather"
