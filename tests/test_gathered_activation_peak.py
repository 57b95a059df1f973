"""Peak memory of a program-made activation all-gathered for a dot, against XLA:CPU's ``memory_analysis()``.

An activation the program computes from an argument (``t * 2``, ``tanh(t)``), read by a dot against a weight split
over 'model' by columns or by rows: under tensor parallelism the walk all-gathers the activation for a dot (the
forward's, or the backward's weight gradient), and XLA:CPU issues that all-gather right after the activation's first
reader and holds the gathered copy to the last dot reading it (memory._dot_gather_holds).  Explain's peak is held to
the corpus' 25% of XLA's (tests/external_corpus/compare.py), on (data, model) meshes of (4, 2), (2, 4) and (2, 2) Auto
axes, sizes drawn, the loss or its gradient.  (Before the copy was held: 0.44x-0.72x on the residual's gradients.)

Not drawn, the same on the code before the copy was held (explain over XLA's peak, measured on 40 draws): a
forward (the loss) on a row-split weight, 1.29x-1.8x, or of the residual ``x + tanh(x @ w)``, 1.43x (the open-value
loss gap: tests/test_open_values.py's strict xfails); the gradient on a row-split weight with t split over 'data',
1.33x on (4, 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_external_repros import _xla_peak
from test_open_values import PEAK_TOLERANCE

import einshard
from einshard._src.analysis.program import trace

_MAKERS = {"scale": lambda t: t * 2.0, "tanh": jnp.tanh}


@st.composite
def gathered_activation_case(draw: st.DrawFn) -> dict:
    mesh_shape = draw(st.sampled_from([(4, 2), (2, 4), (2, 2)]))
    split = draw(st.sampled_from(["col", "row"]))
    grad = split == "row" or draw(st.booleans())
    residual = grad and draw(st.booleans())
    t_split = split == "col" and draw(st.booleans())
    return {
        "mesh": mesh_shape,
        "make": draw(st.sampled_from(sorted(_MAKERS))),
        "split": split,
        "residual": residual,
        "grad": grad,
        "t_split": t_split,
        "batch": draw(st.sampled_from([4, 8])),
        "width": draw(st.sampled_from([16, 32])),
        "out": draw(st.sampled_from([16, 32, 64])),
    }


def _peaks(case: dict) -> tuple[int, int]:
    rows, cols = case["mesh"]
    devices = np.array(jax.devices()[: rows * cols])
    mesh = jax.make_mesh((rows, cols), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=devices)
    d = case["width"]
    f = d if case["residual"] else case["out"]
    make, residual = _MAKERS[case["make"]], case["residual"]

    def loss(t: jax.Array, w: jax.Array) -> jax.Array:
        x = make(t)  # the activation: made by the program, not an argument
        y = jnp.tanh(x @ w)
        return jnp.mean(jnp.square(x + y if residual else y))

    fn = jax.grad(loss, argnums=1) if case["grad"] else loss
    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(rng.normal(size=(case["batch"], 8, d)), jnp.float32),
        jnp.asarray(rng.normal(size=(d, f)) / d, jnp.float32),
    )
    specs = (
        "a b c -> a@data b c" if case["t_split"] else "a b c -> a b c",
        "a b -> a b@model" if case["split"] == "col" else "a b -> a@model b",
    )
    shardings = tuple(einshard.sharding(e, a.shape, mesh=mesh) for e, a in zip(specs, args))
    out = shardings[1] if case["grad"] else NamedSharding(mesh, P())
    placed = jax.device_put(args, shardings)
    with jax.set_mesh(mesh):
        compiled = jax.jit(fn, in_shardings=shardings, out_shardings=out).lower(*placed).compile()
        report = trace(fn, *placed, mesh=mesh).report(specs, [out.spec])
    return int(report.peak_bytes), _xla_peak(compiled)


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(gathered_activation_case())
def test_a_gathered_activations_peak_is_xlas(case: dict) -> None:
    peak, xla_peak = _peaks(case)
    assert abs(peak - xla_peak) <= PEAK_TOLERANCE * xla_peak, (case, peak, xla_peak, round(peak / xla_peak, 2))


def test_the_residual_gradients_copy_is_held() -> None:
    """The diagnosed case (tanh_residual's tensor-parallel gradient): without the held copy 0.69x of XLA's peak."""
    case = {"mesh": (4, 2), "make": "scale", "split": "col", "residual": True, "grad": True, "t_split": False}
    peak, xla_peak = _peaks({**case, "batch": 8, "width": 32, "out": 32})
    assert abs(peak - xla_peak) <= PEAK_TOLERANCE * xla_peak, (peak, xla_peak)
