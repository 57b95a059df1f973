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


# ---------------------------------------------------------------------------
# Issue 25's kinds of bad input, each named by the message (the fuzzer, tests/test_argument_fuzz.py, covers the
# rest of every public signature).

from einshard._src.core.layout import Layout, MeshAxis  # noqa: E402
from einshard.analysis import Profile  # noqa: E402

_DUPLICATE_MESH = jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "data"))

ISSUE_CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "a bare ndarray of strings": (
        lambda: einshard.einshard(np.array(["a"] * 8), "a -> a@data", mesh=MESH),
        r"x= is a numpy array of <U1",
    ),
    "a bare ndarray of objects": (
        lambda: einshard.einshard(np.array([object()] * 8), "a -> a@data", mesh=MESH),
        r"x= is a numpy array of object",
    ),
    "a leaf array of objects in a tree": (
        lambda: einshard.einshard({"w": np.array([object()] * 8)}, "a -> a@data", mesh=MESH),
        r"at \['w'\].*numpy array of object",
    ),
    "a mesh with duplicate axis names (placement)": (
        lambda: einshard.einshard(X, "b k -> b@data k", mesh=_DUPLICATE_MESH),
        r"mesh= names an axis twice",
    ),
    "a mesh with duplicate axis names (einsum: XLA crashed)": (
        lambda: einshard.einsum("b k, k n -> b n", X, W, mesh=_DUPLICATE_MESH),
        r"mesh= names an axis twice",
    ),
    "a bytes regex pattern": (
        lambda: einshard.einshard({"w": X}, {b"w": "a b -> a b"}, mesh=MESH),
        r"a path pattern is a string .* got bytes",
    ),
    "a pattern that overflows the regex compiler": (
        lambda: einshard.einshard({"w": X}, {"(" * 5000 + "w" + ")" * 5000: "a b -> a b"}, mesh=MESH),
        r"too deeply nested or too large",
    ),
    "a count with thousands of digits (was lark.VisitError)": (
        lambda: einshard.spec("a -> a" + "9" * 5000, (8,)),
        r"a count of 5000 digits",
    ),
    "names= not a string": (
        lambda: einshard.describe(einshard.einshard(X, "b k -> b@data k", mesh=MESH), names=["b", "k"]),
        r"names= takes axis names as one string",
    ),
    "sizes= a list of pairs": (
        lambda: einshard.analyze("a b, b c -> a c", mesh={"data": 4}, sizes=[("a", 8)]),
        r"sizes= takes a dict of axis sizes",
    ),
    "sizes= a NaN size": (
        lambda: einshard.analyze("a b, b c -> a c", mesh={"data": 4}, sizes={"a": float("nan"), "b": 4, "c": 4}),
        r"sizes= gives axis 'a' the size float nan",
    ),
    "sizes= a bool size": (
        lambda: einshard.analyze("a b, b c -> a c", mesh={"data": 4}, sizes={"a": True, "b": 4, "c": 4}),
        r"sizes= gives axis 'a' the size bool True",
    ),
    "in_specs= an int": (
        lambda: einshard.analyze("a b, b c -> a c", X, np.ones((4, 4)), in_specs=1, mesh=MESH),
        r"in_specs= takes a tuple of PartitionSpecs",
    ),
    "a Layout's axes= a string": (
        lambda: Layout("ab", (8, 4), (MeshAxis("data", 4),), ((), ())),  # type: ignore[arg-type]
        r"Layout: axes= takes a tuple of axis names",
    ),
    "a Layout's shape= floats": (
        lambda: Layout(("a", "b"), (8.0, 4), (MeshAxis("data", 4),), ((), ())),  # type: ignore[arg-type]
        r"Layout: shape= takes a tuple of integer sizes",
    ),
    "a Profile of zeros (was ZeroDivisionError)": (lambda: Profile("z", 0, 0, 0), r"flops= takes a number > 0"),
    "a Profile with a NaN bandwidth": (
        lambda: Profile("z", 1e12, float("nan"), 0),
        r"bandwidth= takes a finite number",
    ),
    "precision= passed raw to JAX": (
        lambda: einshard.einsum("b k, k n -> b n", X, W, mesh=MESH, precision="bogus"),
        r"precision= takes None, a jax.lax.Precision",
    ),
    "preferred_element_type= passed raw to JAX": (
        lambda: einshard.einsum("b k, k n -> b n", X, W, mesh=MESH, preferred_element_type="bogus"),
        r"preferred_element_type= takes a numeric dtype",
    ),
    "a NaN memory budget": (
        lambda: einshard.plan(lambda p, x: x @ p, W, X, mesh={"data": 4}, memory_budget=float("nan")),
        r"memory_budget= is not a size",
    ),
    "an infinite memory budget": (
        lambda: einshard.plan(lambda p, x: x @ p, W, X, mesh={"data": 4}, memory_budget=float("inf")),
        r"memory_budget= is not a size",
    ),
    "a zero memory budget": (
        lambda: einshard.plan(lambda p, x: x @ p, W, X, mesh={"data": 4}, memory_budget=0),
        r"memory_budget= is not a size",
    ),
}


@pytest.mark.parametrize("case", list(ISSUE_CASES))
def test_issue_25_bad_input_is_an_einshard_error_naming_it(case: str) -> None:
    call, message = ISSUE_CASES[case]
    with pytest.raises(EinshardError, match=message):
        call()


def test_valid_neighbours_of_the_bad_values_still_work() -> None:
    """The checks refuse only what is wrong: numpy integers, bfloat16, preset names, a valid precision pair."""
    assert einshard.spec("a b -> a@data b", (np.int64(8), np.int32(4)), mesh=MESH) == jax.P("data", None)
    y = einshard.einsum(
        "b k, k n -> b n", X, W, mesh=MESH, precision=("highest", "highest"), preferred_element_type=jnp.float32
    )
    np.testing.assert_allclose(np.asarray(y), X @ W)
    assert einshard.analyze("a b, b c -> a c", mesh={"data": 4}, sizes={"a": np.int64(8), "b": 4, "c": 4}).flops > 0
    placed = einshard.einshard(np.ones(8, jnp.bfloat16), "a -> a@data", mesh=MESH)
    assert placed.dtype == jnp.bfloat16


# ---------------------------------------------------------------------------
# Bounded work


def _old_split_devices(total: int, weights: list[int], sizes: list[int | None]) -> list[int]:
    """einshard 0.3's search: every ordered factorization (exponential in the number of stars)."""
    import math

    base = math.prod(weights)
    if total % base:
        raise ValueError("ratio")
    rest = total // base

    def factorizations(n: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(n,)]
        return [(d, *r) for d in range(1, n + 1) if n % d == 0 for r in factorizations(n // d, k - 1)]

    fits = [
        f
        for f in factorizations(rest, len(weights))
        if not any(s is not None and s % (w * x) for s, w, x in zip(sizes, weights, f))
    ]
    if not fits:
        raise ValueError("none")
    best = min(fits, key=lambda f: (max(f) / min(f), tuple(-x for x in f)))
    return [w * x for w, x in zip(weights, best)]


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(
    total=st.sampled_from([1, 2, 4, 6, 8, 12, 16, 24, 32, 36, 48, 64, 72, 96, 128]),
    stars=st.lists(
        st.tuples(st.sampled_from([1, 1, 2, 3, 4]), st.sampled_from([None, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 5])),
        min_size=1,
        max_size=4,
    ),
)
def test_the_polynomial_star_split_gives_the_old_answers(total: int, stars: list[tuple[int, int | None]]) -> None:
    from einshard._src.core.layout import split_devices

    weights, sizes = [w for w, _ in stars], [s for _, s in stars]
    try:
        expected: list[int] | str = _old_split_devices(total, weights, sizes)
    except ValueError:
        expected = "no split"
    try:
        got: list[int] | str = split_devices(total, weights, sizes)
    except ValueError:
        got = "no split"
    assert got == expected


def test_hundreds_of_stars_resolve() -> None:
    """128 starred axes (the old search: 95 s and 900 MB) over 8 devices: three get 2, the rest 1."""
    names = " ".join(f"{{a{i}}}" for i in range(128))
    stars = " ".join(f"{{a{i}}}*" for i in range(128))
    spec = einshard.spec(f"{names} -> {stars}", (8,) * 128)
    assert sum(1 for e in spec if e is not None) == 3


class _FakeDevice:
    def __init__(self, i: int) -> None:
        self.id = i


class _ManyDevices:
    """A sharding of a 1-D array over ``n`` devices, one block each: what 100,000 devices look like to show()."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.device_set = {_FakeDevice(i) for i in range(2)}

    def devices_indices_map(self, shape: tuple[int, ...]) -> dict[Any, tuple[slice, ...]]:
        return {_FakeDevice(i): (slice(i, i + 1),) for i in range(self.n)}


def test_show_draws_a_bounded_summary_of_100000_devices() -> None:
    from einshard._src.drawing import render

    x = jax.ShapeDtypeStruct((100_000,), np.float32)
    fake = type("Shaped", (), {"shape": x.shape, "dtype": x.dtype, "sharding": _ManyDevices(100_000)})()
    text = render(fake)
    lines = text.splitlines()
    assert len(lines) < 40 and max(map(len, lines)) < 400, text[:2000]
    assert "not drawn" in text and "100000 devices" in text


def _cli(*argv: str) -> tuple[int, str]:
    import contextlib
    import io

    from einshard_apps import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(list(argv))
        except SystemExit as exit_:  # argparse's own errors
            code = int(exit_.code or 0)
    return code, err.getvalue()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("show", "a b -> a b@x", "--shape", "8,8", "--mesh", "x=2", "--mesh", "x=4"), "--mesh: given twice"),
        (("analyze", "a b, b c -> a c", "--sizes", "a=2,a=4,b=2,c=2"), "--sizes gives 'a' twice"),
        (("analyze", "a b, b c -> a c", "--mesh", "x=2,x=4", "--sizes", "a=2,b=2,c=2"), "--mesh gives 'x' twice"),
        (("show", "a b -> a* b", "--shape", "8,8", "--devices", "100000"), "--devices asks for 100,000"),
        (("show", "a b -> a b@x", "--shape", "8,8", "--mesh", "x=100000"), "--mesh x=100000 asks for 100,000"),
        (("show", "a b -> a* b", "--shape", "8,8", "--dtype", "bogus"), "--dtype takes a numeric type"),
        (("show", "a b -> a* b", "--shape", "8," + "9" * 5000), "--shape takes sizes"),
        (("plan", "--budget", "nan"), "--budget is not a size"),
        (("analyze", "a b, b c -> a c", "--sizes", "a=" + "9" * 5000 + ",b=2,c=2"), "--sizes: expected name=size"),
    ],
)
def test_cli_bad_options_are_errors_naming_the_flag(argv: tuple[str, ...], message: str) -> None:
    code, err = _cli(*argv)
    assert code == 2 and message in err, err
