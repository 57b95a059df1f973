"""Bad input to the lowering (einsum, lower, data_parallel, fsdp, fsdp_layouts): an EinshardError naming the argument.

Never a raw KeyError/TypeError/shard_map error, never silent acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import einshard
from einshard.errors import EinshardError

MESH = jax.make_mesh((4, 2), ("data", "model"))  # JAX's default (Explicit) axis types
X = np.ones((8, 4), np.float32)
W = np.ones((4, 6), np.float32)
PARAMS = {"w": W}
BATCH = {"x": X, "y": np.zeros((8, 6), np.float32)}


def _loss(p: Any, b: Any) -> Any:
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


def _vector_loss(p: Any, b: Any) -> Any:
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2, axis=1)  # one loss per example: not reduced


CASES: dict[str, tuple[Callable[[], Any], str]] = {
    # einsum / lower
    "einsum: mode is not a mode": (
        lambda: einshard.einsum("b k, k n -> b n", X, W, mesh=MESH, mode="fast"),
        r"mode= must be one of 'sync', 'async', 'auto', got 'fast'",
    ),
    "lower: mode is not a string": (
        lambda: einshard.lower("b k, k n -> b n", X, W, mesh=MESH, mode=None),
        r"mode= must be one of",
    ),
    "einsum: two_way without async": (
        lambda: einshard.einsum("b k@model, k@model n -> b n@model", X, W, mesh=MESH, two_way=True),
        r"two_way=True .* mode='sync' runs no ring",
    ),
    "einsum: two_way not a bool": (
        lambda: einshard.einsum("b k, k n -> b n", X, W, mesh=MESH, mode="async", two_way="yes"),
        r"two_way= is True or False",
    ),
    "einsum: mesh= a dict of sizes": (
        lambda: einshard.einsum("b k@model, k@model n -> b n", X, W, mesh={"data": 4, "model": 2}),
        r"einshard.einsum: mesh= is a dict of axis sizes",
    ),
    "lower: mesh= a dict of sizes": (
        lambda: einshard.lower("b k@model, k@model n -> b n", X, W, mesh={"model": 2}),
        r"einshard.lower: mesh= is a dict of axis sizes",
    ),
    "einsum: mesh= not a mesh": (
        lambda: einshard.einsum("b k, k n -> b n", X, W, mesh="data"),
        r"mesh= takes a jax.sharding.Mesh",
    ),
    "einsum: an AbstractMesh with concrete operands": (
        lambda: einshard.einsum("b k@model, k@model n -> b n", X, W, mesh=MESH.abstract_mesh),
        r"AbstractMesh.* has no devices",
    ),
    "einsum: no mesh anywhere": (
        lambda: einshard.einsum("b k@model, k@model n -> b n", X, W),
        r"einshard.einsum needs a mesh",
    ),
    "einsum: an operand that is not an array": (
        lambda: einshard.lower("b k, k n -> b n", X, W, mesh=MESH)(X, "w"),
        r"operand 2 is a str, not an array",
    ),
    "einsum: an operand of another shape than lowered for": (
        lambda: einshard.lower("b k, k n -> b n", X, W, mesh=MESH)(X, np.ones((4, 7), np.float32)),
        r"operand 2 of shape \(4, 7\) does not fit",
    ),
    "einsum: a size-0 axis split over a mesh axis": (
        lambda: einshard.einsum("b k@model, k@model n -> b n", np.ones((8, 0)), np.ones((0, 6)), mesh=MESH),
        r"'k'.*size 0|size 0.*'k'",
    ),
    # data_parallel / fsdp
    "data_parallel: a loss that returns a vector": (
        lambda: einshard.data_parallel(_vector_loss, mesh=MESH)(PARAMS, BATCH),
        r"einshard.data_parallel: loss_fn must return one number .* shape \(2,\)",
    ),
    "fsdp: a loss that returns a vector": (
        lambda: einshard.fsdp(_vector_loss, {"w": "d f -> d@data f"}, mesh=MESH)(PARAMS, BATCH),
        r"einshard.fsdp: loss_fn must return one number",
    ),
    "data_parallel: mesh= a dict of sizes": (
        lambda: einshard.data_parallel(_loss, mesh={"data": 4})(PARAMS, BATCH),
        r"einshard.data_parallel: mesh= is a dict of axis sizes",
    ),
    "fsdp: mesh= a dict of sizes": (
        lambda: einshard.fsdp(_loss, "d f -> d@data f", mesh={"data": 4})(PARAMS, BATCH),
        r"einshard.fsdp: mesh= is a dict of axis sizes",
    ),
    "data_parallel: a string leaf in params": (
        lambda: einshard.data_parallel(_loss, mesh=MESH)({"w": W, "name": "layer0"}, BATCH),
        r"the params leaf at \['name'\] is a str \('layer0'\), not an array of numbers",
    ),
    "fsdp: an object leaf in the batch": (
        lambda: einshard.fsdp(_loss, {"w": "d f -> d@data f"}, mesh=MESH)(PARAMS, {**BATCH, "f": object()}),
        r"the batch leaf at \['f'\] is a object",
    ),
    "data_parallel: a scalar batch leaf": (
        lambda: einshard.data_parallel(_loss, mesh=MESH)(PARAMS, {**BATCH, "t": np.float32(1)}),
        r"the batch leaf at \['t'\] is a scalar",
    ),
    "data_parallel: a batch that does not split over the batch axis": (
        lambda: einshard.data_parallel(_loss, mesh=MESH)(PARAMS, {"x": X[:6], "y": BATCH["y"][:6]}),
        r"the batch leaf at \['x'\] has 6 rows, which do not split evenly over data \(4 devices\)",
    ),
    "data_parallel: batch_axis not a mesh axis": (
        lambda: einshard.data_parallel(_loss, mesh=MESH, batch_axis="batch")(PARAMS, BATCH),
        r"batch_axis='batch' is not an axis of the mesh \(its axes: data, model\)",
    ),
    "fsdp: fsdp_axis not a mesh axis": (
        lambda: einshard.fsdp(_loss, "d f -> d@data f", mesh=MESH, fsdp_axis="shard")(PARAMS, BATCH),
        r"fsdp_axis='shard' is not an axis of the mesh",
    ),
    "fsdp: a layout that does not fit its leaf": (
        lambda: einshard.fsdp(_loss, {"w": "d f -> d f@data"}, mesh=MESH)(PARAMS, BATCH),
        r"at \['w'\]",
    ),
    # fsdp_layouts
    "fsdp_layouts: size=0": (lambda: einshard.fsdp_layouts(PARAMS, size=0), r"size= .* positive integer; got 0"),
    "fsdp_layouts: size<0": (lambda: einshard.fsdp_layouts(PARAMS, size=-4), r"size= .* got -4"),
    "fsdp_layouts: size not an integer": (lambda: einshard.fsdp_layouts(PARAMS, size=2.5), r"size= .* got 2.5"),
    "fsdp_layouts: axis not a name": (lambda: einshard.fsdp_layouts(PARAMS, size=4, axis=3), r"axis= .* got 3"),
    "fsdp_layouts: min_elements<0": (
        lambda: einshard.fsdp_layouts(PARAMS, size=4, min_elements=-1),
        r"min_elements= .* got -1",
    ),
    "fsdp_layouts: a string leaf": (
        lambda: einshard.fsdp_layouts({"w": W, "act": "gelu"}, size=4),
        r"the params leaf at \['act'\] is a str",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_an_einshard_error_naming_the_argument(case: str) -> None:
    call, message = CASES[case]
    with pytest.raises(EinshardError, match=message):
        call()


def test_a_vector_loss_is_refused_under_jit_and_grad_too() -> None:
    loss = einshard.data_parallel(_vector_loss, mesh=MESH)
    with pytest.raises(EinshardError, match="loss_fn must return one number"):
        jax.jit(jax.grad(loss))(PARAMS, BATCH)
