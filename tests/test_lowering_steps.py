"""Hand-written step lists for the textbook sharded einsums (docs/theory.md V1-V12) run as shard_maps.

Each case: the result equals jnp.einsum, has the requested layout, and jax.grad of a
scalar function of it equals the unsharded gradient (AD transposes the collectives).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from einshard._src._compat import native_unreduced
from einshard.errors import EinshardError
from einshard.lowering import Step, einsum_layouts, einsum_shard_map, step_layout

HI = jax.lax.Precision.HIGHEST


def S(kind, operand, axes, dim=None, to_dim=None):
    return Step(kind, operand, tuple(axes.split(",")), dim, to_dim)


# (einsum, shapes, steps_before, steps_after, collectives the compiled forward must contain)
CASES = {
    "V6-dp": ("b@data d, d f -> b@data f", [(8, 6), (6, 4)], [], [], {}),
    "V6-column-tp": ("b d, d f@model -> b f@model", [(8, 6), (6, 8)], [], [], {}),
    "V6-dp-x-tp": ("b@data d, d f@model -> b@data f@model", [(8, 6), (6, 8)], [], [], {}),
    "V1-row-tp-psum": (
        "b d@model, d@model f -> b f",
        [(4, 8), (8, 6)],
        [],
        [S("all-reduce", "out", "model")],
        {"all-reduce": 1},
    ),
    "V2-row-tp-psum-scatter": (
        "b d@model, d@model f -> b@model f",
        [(8, 8), (8, 6)],
        [],
        [S("reduce-scatter", "out", "model", 0)],
        {"reduce-scatter": 1},
    ),
    "pending-sums": ("b d@model, d@model f -> b f {U:model}", [(4, 8), (8, 6)], [], [], {}),
    "V12-fsdp-gather": (
        "b@data d, d@data f -> b@data f",
        [(8, 6), (6, 4)],
        [S("all-gather", 0 + 1, "data", 0)],
        [],
        {"all-gather": 1},
    ),
    "V7-k-over-two-axes": (
        "b d@(data,model), d@(data,model) f -> b f",
        [(4, 16), (16, 6)],
        [],
        [S("all-reduce", "out", "data,model")],
        {"all-reduce": 1},
    ),
    "V8-dp-x-row-tp": (
        "b@data d@model, d@model f -> b@data f",
        [(8, 8), (8, 6)],
        [],
        [S("all-reduce", "out", "model")],
        {"all-reduce": 1},
    ),
    "rule9-all-to-all-realign": (
        "b d@model, d f@model -> b f",
        [(4, 8), (8, 8)],
        [S("all-to-all", 1, "model", 1, 0)],
        [S("all-reduce", "out", "model")],
        {"all-to-all": 1, "all-reduce": 1},
    ),
    "V11-reshard-all-to-all": (
        "a@model b -> a b@model",
        [(8, 8)],
        [S("all-to-all", 0, "model", 0, 1)],
        [],
        {"all-to-all": 1},
    ),
    "V10-sequence-parallel-gather": (
        "b@model d, d f@model -> b f@model",
        [(8, 6), (6, 8)],
        [S("all-gather", 0, "model", 0)],
        [],
        {"all-gather": 1},
    ),
    "gather-to-replicated": (
        "b@model d, d f -> b f",
        [(8, 6), (6, 4)],
        [S("all-gather", 0, "model", 0)],
        [],
        {"all-gather": 1},
    ),
    "rule5-slice-batch": ("b@data x, b x -> b@data", [(8, 6), (8, 6)], [S("dynamic-slice", 1, "data", 0)], [], {}),
    "rule7-slice-contracted": (
        "b d@model, d f -> b f",
        [(4, 8), (8, 6)],
        [S("dynamic-slice", 1, "model", 0)],
        [S("all-reduce", "out", "model")],
        {"all-reduce": 1},
    ),
    "V5-case4-gather-one": (
        "b@model x, x y@model -> b@model y",
        [(8, 6), (6, 8)],
        [S("all-gather", 1, "model", 1)],
        [],
        {"all-gather": 1},
    ),
    "V9-misaligned-gather-both": (
        "b x@data, x@model y -> b y",
        [(4, 8), (8, 6)],
        [S("all-gather", 0, "data", 1), S("all-gather", 1, "model", 0)],
        [],
        {"all-gather": 2},
    ),
    "V9-misaligned-realign-then-psum": (
        "b x@data, x@model y -> b y",
        [(4, 8), (8, 6)],
        [S("all-gather", 0, "data", 1), S("dynamic-slice", 0, "model", 1)],
        [S("all-reduce", "out", "model")],
        {"all-gather": 1, "all-reduce": 1},
    ),
    "three-operands": (
        "b d@model, d@model f, f g -> b g",
        [(4, 8), (8, 6), (6, 2)],
        [],
        [S("all-reduce", "out", "model")],
        {"all-reduce": 1},
    ),
}


def _meshes():
    for kind in (AxisType.Auto, AxisType.Explicit):
        yield kind, jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind, kind))


MESHES = dict(_meshes())


def _count(hlo: str, op: str) -> int:
    return len(re.findall(rf"= [^=\n]*? {op}(-start)?\(", hlo))


def _padded(spec, ndim):
    parts = tuple(getattr(spec, "partitions", None) or spec)  # tuple(spec) refuses unreduced specs
    return parts + (None,) * (ndim - len(parts))


def _plain(expr: str) -> str:
    expr = re.sub(r"\s*\{U:[^}]*\}", "", expr)
    return re.sub(r"@(\([^)]*\)|\w+)", "", expr)


def _letters(expr: str) -> str:
    ins, out = _plain(expr).split("->")
    names: dict[str, str] = {}
    for name in re.findall(r"\w+", _plain(expr)):
        names.setdefault(name, "abcdefghijklmnop"[len(names)])
    sides = [" ".join(names[n] for n in s.split()) for s in ins.split(",")]
    return ",".join(s.replace(" ", "") for s in sides) + "->" + "".join(names[n] for n in out.split())


@pytest.mark.parametrize("mode", ["sync", "auto"])
@pytest.mark.parametrize("kind", list(MESHES), ids=lambda k: k.name)
@pytest.mark.parametrize("case", list(CASES))
def test_textbook_case(case, kind, mode):
    expr, shapes, before, after, expected = CASES[case]
    mesh = MESHES[kind]
    rng = np.random.default_rng(0)
    ops = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ins, out = einsum_layouts(expr, shapes, mesh)
    if mode == "auto":
        if out.unreduced:
            with pytest.raises(EinshardError, match="cannot leave pending sums"):
                einsum_shard_map(ins, out, mesh=mesh, mode="auto")
            return
        before, after, expected = [], [], None  # XLA picks the collectives: not part of the contract
    f = einsum_shard_map(ins, out, before, after, mesh=mesh, precision=HI, mode=mode)
    subs = _letters(expr)
    pending = bool(out.unreduced)
    native = pending and native_unreduced(mesh)  # a JAX unreduced array, not a leading partials axis

    def reduce(y):
        if native:
            return jax.sharding.reshard(y, NamedSharding(mesh, PartitionSpec(*out.spec_entries())))
        return y.sum(0) if pending else y

    ref = jnp.einsum(subs, *ops, precision=HI)
    g = rng.standard_normal(ref.shape).astype(np.float32)

    def loss(*xs):
        return jnp.sum(reduce(f(*xs)) * g)

    def ref_loss(*xs):
        return jnp.sum(jnp.einsum(subs, *xs, precision=HI) * g)

    with jax.set_mesh(mesh):
        y = jax.jit(f)(*ops)
        grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(ops)))))(*ops)
        hlo = jax.jit(f).lower(*ops).compile().as_text()
    np.testing.assert_allclose(reduce(y), ref, rtol=1e-5, atol=1e-5)
    want_spec = PartitionSpec(*out.spec_entries())
    if native:
        assert y.sharding.spec.unreduced == {"model"} and y.shape == ref.shape
    elif pending:
        want_spec = PartitionSpec("model", *out.spec_entries())
    assert _padded(y.sharding.spec, y.ndim) == _padded(want_spec, y.ndim)
    ref_grads = jax.grad(ref_loss, argnums=tuple(range(len(ops))))(*ops)
    for got, want in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for op in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
        if expected is None:
            break
        n = _count(hlo, op)
        if op == "reduce-scatter" and expected.get(op) and n == 0:
            # CPU lowers a reduce-scatter as all-reduce + dynamic-slice (docs/theory.md V2)
            assert _count(hlo, "all-reduce") == expected[op] and "dynamic-slice" in hlo
            continue
        if op == "all-reduce" and expected.get("reduce-scatter") and n:
            continue
        assert n == expected.get(op, 0), (op, n, hlo.count(op))


def test_program_lists_the_steps():
    mesh = MESHES[AxisType.Auto]
    ins, out = einsum_layouts("b d@model, d@model f -> b@model f", [(8, 8), (8, 6)], mesh)
    f = einsum_shard_map(ins, out, [], [S("reduce-scatter", "out", "model", 0)], mesh=mesh)
    assert f.program == ("einsum ab,bc->ac", "reduce-scatter[model](out dim 0)")


@pytest.mark.parametrize(
    "expr,shapes,before,after,message",
    [
        ("b d@model, d@model f -> b f", [(4, 8), (8, 6)], [], [], "not the requested"),
        ("b d@model, d f -> b f", [(4, 8), (8, 6)], [], [S("all-reduce", "out", "model")], "mix blocks"),
        ("b d, d f@model -> b f", [(4, 8), (8, 8)], [S("all-gather", 1, "model", 0)], [], "minor mesh axes"),
        ("b@model d, d f@model -> b f", [(8, 6), (6, 8)], [], [], "diagonal"),
        ("b d, d f -> b f", [(4, 8), (8, 6)], [S("dynamic-slice", 1, "model", 1)], [], "does not split"),
        ("b d, d f -> b f", [(4, 8), (8, 6)], [S("dynamic-slice", 1, "nope", 1)], [], "not a mesh axis"),
    ],
)
def test_wrong_plans_are_rejected(expr, shapes, before, after, message):
    mesh = MESHES[AxisType.Auto]
    ins, out = einsum_layouts(expr, shapes, mesh)
    with pytest.raises(EinshardError, match=message):
        einsum_shard_map(ins, out, before, after, mesh=mesh)


def test_step_validation():
    with pytest.raises(EinshardError, match="unknown step kind"):
        Step("all-scatter", 0, ("x",))
    with pytest.raises(EinshardError, match="needs dim"):
        Step("all-gather", 0, ("x",))
    with pytest.raises(EinshardError, match="to_dim"):
        Step("all-to-all", 0, ("x",), dim=0)
    assert Step("all-reduce", "out", "x").mesh_axes == ("x",)


def test_step_layout_tracks_two_axis_splits():
    mesh = MESHES[AxisType.Auto]
    (lay,), _ = einsum_layouts("a@(data,model) b -> a b", [(16, 4)], mesh)
    half = step_layout(lay, Step("all-gather", 0, ("model",), dim=0))
    assert half.dims == (("data",), ())
    with pytest.raises(EinshardError, match="minor"):
        step_layout(lay, Step("all-gather", 0, ("data",), dim=0))


def test_collective_permute_step_rotates_blocks():
    mesh = MESHES[AxisType.Auto]
    from einshard.lowering import apply_step

    shift = Step("collective-permute", 0, ("data", "model"), shift=1)
    f = jax.shard_map(
        lambda b: apply_step(b, shift),
        mesh=mesh,
        in_specs=PartitionSpec(("data", "model")),
        out_specs=PartitionSpec(("data", "model")),
    )
    x = np.arange(8.0)
    np.testing.assert_array_equal(f(x), np.roll(x, 1))


@pytest.mark.parametrize("two_way", [False, True])
@pytest.mark.parametrize(
    "expr,shapes,before,after,kind",
    [
        ("b@model d, d f@model -> b f@model", [(8, 6), (6, 8)], [S("all-gather", 0, "model", 0)], [], "ag"),
        ("m@model k, k@model n -> m@model n", [(8, 8), (8, 4)], [S("all-gather", 1, "model", 0)], [], "ag"),
        (  # the ring gathers only the minor of two mesh axes splitting b
            "b@(data,model) d, d f@model -> b@data f@model",
            [(16, 6), (6, 8)],
            [S("all-gather", 0, "model", 0)],
            [],
            "ag",
        ),
        ("b@model d, d f -> b f", [(8, 6), (6, 4)], [S("all-gather", 0, "model", 0)], [], "none"),
        ("b f@model, f@model d -> b@model d", [(8, 8), (8, 6)], [], [S("reduce-scatter", "out", "model", 0)], "rs"),
        ("b d@model, d@model f -> b f", [(4, 8), (8, 6)], [], [S("all-reduce", "out", "model")], "none"),
    ],
)
def test_async_mode_runs_rings(expr, shapes, before, after, kind, two_way):
    mesh = MESHES[AxisType.Auto]
    rng = np.random.default_rng(1)
    ops = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ins, out = einsum_layouts(expr, shapes, mesh)
    f = einsum_shard_map(ins, out, before, after, mesh=mesh, mode="async", two_way=two_way, precision=HI)
    both = jax.jit(lambda *xs: (f(*xs), jax.grad(lambda *xs: jnp.sum(f(*xs) ** 2), argnums=(0, 1))(*xs)))
    y, grads = both(*ops)
    np.testing.assert_allclose(y, jnp.einsum(_letters(expr), *ops, precision=HI), rtol=1e-5, atol=1e-5)
    want = jax.grad(lambda *xs: jnp.sum(jnp.einsum(_letters(expr), *xs, precision=HI) ** 2), argnums=(0, 1))(*ops)
    for got, w in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-4)
    hlo = jax.jit(f).lower(*ops).compile().as_text()
    permutes = _count(hlo, "collective-permute")
    if kind == "none":  # the ring axis does not split the result (or there is no gather): plain collectives
        assert permutes == 0 and not any("ring" in p for p in f.program)
    else:
        assert permutes == (2 if two_way else 1) * 3
        assert _count(hlo, "all-gather") == 0 and _count(hlo, "reduce-scatter") == 0 and _count(hlo, "all-reduce") == 0


@pytest.mark.parametrize(
    "before, after",
    [
        (("x", "y"), ("y", "x")),  # the same blocks on other devices
        (("x",), ("y",)),  # c@x (2 blocks) to c@y (4): each device sends a piece of its block
        (("x",), ("y", "x")),  # finer and reordered
    ],
)
def test_a_reorder_permute_gives_every_device_its_block(before, after):
    from einshard.lowering import apply_step

    mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
    step = Step("collective-permute", 0, tuple(dict.fromkeys((*before, *after))), reorder=((before,), (after,)))
    spec = lambda axes: axes[0] if len(axes) == 1 else axes  # noqa: E731
    # Every device's block comes back along a leading axis over every mesh axis: (devices, block).
    body = lambda b: apply_step(b, step)[None]  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec(spec(before)), out_specs=PartitionSpec(("x", "y")))
    got = np.asarray(f(np.arange(16.0)))
    n = int(np.prod([mesh.shape[m] for m in after]))
    for i, j in np.ndindex(2, 4):
        coords = {"x": i, "y": j}
        k = 0
        for m in after:
            k = k * mesh.shape[m] + coords[m]
        np.testing.assert_array_equal(got[i * 4 + j], np.arange(16.0).reshape(n, -1)[k])


def test_a_reorder_onto_fewer_devices_is_refused():
    from einshard._src.core.collectives import reorder_pairs

    with pytest.raises(ValueError, match="no permute"):
        reorder_pairs(("x", "y"), {"x": 2, "y": 4}, (("y",),), (("x",),))
    with pytest.raises(EinshardError, match="reorder="):
        Step("collective-permute", 0, ("x",), reorder=((("x",),), (("y",),)))
