"""Peak memory per device against XLA's buffer assignment, drawn: the structures explain's liveness walk models.

Hypothesis draws the sizes, the layout strategy (data-parallel, FSDP, Megatron column/row), the mesh kind
(Auto, Explicit) and forward or ``jax.grad`` of small programs built from the structures
einshard/analysis/program/memory.py models -- a chain of dots, a gathered weight, a scan over stacked
layer weights, a Python loop over their rows, each stack also under ``jax.checkpoint`` (remat) -- compiles each with XLA and compares
``ProgramReport.peak_bytes`` with ``memory_analysis()`` (arguments + outputs + temporaries - aliased)
within the corpus's 25% (tests/external_corpus/compare.py's ``MEMORY_TOLERANCE``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from einshard._src.analysis.program import trace
from einshard._src.analysis.program import xla_behaviour as xb

TOLERANCE = 0.25
FAST = settings(max_examples=2, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
DEEP = settings(
    max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None
)

Strategy = Literal["dp", "fsdp", "tp"]
Mode = Literal["fwd", "grad"]
Structure = Literal["dots", "scan", "scan_remat", "stacked", "stacked_remat"]

# Weight layouts per strategy, for a weight pair (a: D->F, b: F->D), stacked (leading L) or not.
_WEIGHTS: dict[Strategy, tuple[tuple[Any, ...], tuple[Any, ...]]] = {
    "dp": ((), ()),
    "fsdp": (("data", None), ("data", None)),
    "tp": ((None, "model"), ("model", None)),
}


def _mesh(kind: Literal["auto", "explicit"]) -> jax.sharding.Mesh:
    t = AxisType.Auto if kind == "auto" else AxisType.Explicit
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(t, t))


def _program(structure: Structure, layers: int) -> Callable[[Any, Any], Any]:
    def block(h: Any, w: Any) -> tuple[Any, None]:
        return h + jnp.tanh(h @ w["a"]) @ w["b"], None

    def loss(p: Any, x: Any) -> Any:
        if structure == "dots":
            h = x
            for w in p:  # one weight pair per layer, as unscanned models hold them
                h = block(h, w)[0]
        elif structure in ("stacked", "stacked_remat"):
            # A Python loop over the stacked weights' rows (an unrolled decoder's params[i]): the gradient pads
            # each layer's into the stack and sums the pads.
            step = jax.checkpoint(block) if structure == "stacked_remat" else block
            h = x
            for i in range(layers):
                h = step(h, {"a": p["a"][i], "b": p["b"][i]})[0]
        else:
            step = jax.checkpoint(block) if structure == "scan_remat" else block
            h = jax.lax.scan(step, x, p)[0]
        return jnp.mean(h**2)

    return loss


def _peaks(structure: Structure, strategy: Strategy, mode: Mode, kind: str, layers: int, d: int, f: int, b: int):
    """(explain's peak, XLA's peak) per device, for the drawn program."""
    mesh = _mesh(kind)  # type: ignore[arg-type]
    a_spec, b_spec = _WEIGHTS[strategy]
    xspec = P() if strategy == "tp" else P("data")
    if structure == "dots":
        wspec: Any = [{"a": P(*a_spec), "b": P(*b_spec)}] * layers
        params: Any = [
            {"a": jax.ShapeDtypeStruct((d, f), jnp.float32), "b": jax.ShapeDtypeStruct((f, d), jnp.float32)}
        ] * layers
    else:
        wspec = {"a": P(None, *a_spec), "b": P(None, *b_spec)}
        params = {
            "a": jax.ShapeDtypeStruct((layers, d, f), jnp.float32),
            "b": jax.ShapeDtypeStruct((layers, f, d), jnp.float32),
        }
    x = jax.ShapeDtypeStruct((b, d), jnp.float32)
    loss = _program(structure, layers)
    fn = jax.grad(loss) if mode == "grad" else loss
    out = wspec if mode == "grad" else P()
    if strategy == "tp" and kind == "explicit":
        # JAX refuses a dot contracting a split axis on Explicit axes: run it as users must, under auto_axes.
        fn = jax.sharding.auto_axes(fn, out_sharding=out)
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    with jax.set_mesh(mesh):
        sds = lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shard(spec))  # noqa: E731
        placed = (jax.tree.map(sds, params, wspec), sds(x, xspec))
        compiled = (
            jax.jit(
                fn,
                in_shardings=(jax.tree.map(shard, wspec, is_leaf=is_spec), shard(xspec)),
                out_shardings=jax.tree.map(shard, out, is_leaf=is_spec),
            )
            .lower(*placed)
            .compile()
        )
        report = trace(fn, *placed, mesh=mesh).report((wspec, xspec), jax.tree.leaves(out, is_leaf=is_spec))
    m = compiled.memory_analysis()
    xla = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return report.peak_bytes, xla


_draws = dict(
    structure=st.sampled_from(["dots", "scan", "scan_remat", "stacked", "stacked_remat"]),
    strategy=st.sampled_from(["dp", "fsdp", "tp"]),
    mode=st.sampled_from(["fwd", "grad"]),
    kind=st.sampled_from(["auto", "explicit"]),
    layers=st.integers(2, 4),
    d=st.sampled_from([64, 128]),
    f=st.sampled_from([128, 256]),
    b=st.sampled_from([32, 64]),
)


# jax 0.12.0.1's XLA:CPU holds the Megatron remat gradient of a stacked loop as the walk does; jax 0.10.2's holds more
# (test_stacked_megatron_gradient_known_miss).  jax 0.11 is not measured (no wheel for this machine's Python).
_JAX_BEFORE_012 = xb._jax_version() < (0, 12)


def _known_miss(structure: str, strategy: str, mode: str, layers: int) -> bool:
    """The drawn programs explain is known to miss on this jax (test_stacked_megatron_gradient_known_miss): a Megatron
    layout's gradient of a Python loop over stacked weights under remat, from 4 layers, before jax 0.12."""
    return _JAX_BEFORE_012 and structure == "stacked_remat" and strategy == "tp" and mode == "grad" and layers >= 4


def _check(structure, strategy, mode, kind, layers, d, f, b) -> None:
    assume(not _known_miss(structure, strategy, mode, layers))
    got, xla = _peaks(structure, strategy, mode, kind, layers, d, f, b)
    assert got == pytest.approx(xla, rel=TOLERANCE), (structure, strategy, mode, kind, got, xla, got / xla)


@FAST
@given(**_draws)
# One iteration of a scan over stacked weights holds the layer's slice (a dot reads it: XLA copies it) and,
# under FSDP, its gathered copy: explain counted the loop through its operands only (0.49-0.62x XLA).
@example("scan", "fsdp", "fwd", "auto", 4, 128, 256, 64)
@example("scan_remat", "fsdp", "grad", "auto", 4, 128, 256, 64)
@example("scan", "dp", "grad", "explicit", 4, 128, 256, 64)
@example("scan_remat", "tp", "grad", "auto", 4, 128, 256, 64)
@example("dots", "fsdp", "grad", "explicit", 3, 128, 256, 64)
# A Python loop over stacked weights (an unrolled decoder's params[i]): each layer's gradient padded into the stack
# and the pads summed, one fusion on XLA:CPU; each layer's w[i] copied at the step's start; a data-parallel layer's
# gradients all-reduced together before the pads.  explain held 0.63-0.75x XLA's peak before those three rules
# (memory._fusible_elementwise's pad, _slices_of_arguments_first, _stacking_steps), 20 of 48 such programs outside
# the 25% (tp remat gradients at 4 layers still are: _known_miss).
@example("stacked", "dp", "grad", "auto", 4, 128, 256, 64)
@example("stacked_remat", "dp", "grad", "explicit", 4, 128, 256, 64)
@example("stacked", "dp", "fwd", "auto", 4, 128, 256, 64)
@example("stacked", "fsdp", "grad", "explicit", 4, 128, 256, 64)
@example("stacked_remat", "tp", "fwd", "explicit", 4, 128, 256, 64)
def test_peak_memory_matches_xla(structure, strategy, mode, kind, layers, d, f, b):
    _check(structure, strategy, mode, kind, layers, d, f, b)


@pytest.mark.slow
@DEEP
@given(**_draws)
def test_peak_memory_matches_xla_deep(structure, strategy, mode, kind, layers, d, f, b):
    _check(structure, strategy, mode, kind, layers, d, f, b)


@pytest.mark.xfail(
    _JAX_BEFORE_012,
    strict=True,
    reason="a Megatron layout's gradient of a Python loop over stacked weights, under remat: jax 0.10.2's XLA holds "
    "~96 KiB a layer more than the walk at d=64, f=256 (0.87x at 2 layers, 0.78x at 3, 0.73x at 4, 0.69x at 6); "
    "jax 0.12.0.1's holds what the walk holds",
)
@pytest.mark.parametrize("layers", [4, 6])
def test_stacked_megatron_gradient_known_miss(layers: int) -> None:
    got, xla = _peaks("stacked_remat", "tp", "grad", "auto", layers, 64, 256, 64)
    assert got == pytest.approx(xla, rel=TOLERANCE), (got, xla, got / xla)


def test_unscanned_fsdp_gradient_on_explicit_axes():
    """On Explicit axes the weight gradients are typed like the weights (split on 'data'): XLA:CPU all-reduces each
    whole partial gradient and slices it (no reduce-scatter), the layer's partials and whole sums live together at
    the combined all-reduce (memory._whole_sum_beside): 0.55x before that rule, exact after."""
    got, xla = _peaks("dots", "fsdp", "grad", "explicit", 3, 128, 256, 64)
    assert got == pytest.approx(xla, rel=0.01), (got, xla, got / xla)
