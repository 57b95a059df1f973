"""The context matrix: every public function x mesh kind x where the mesh comes from x call context.

Each cell runs one public function on a (4, 2) mesh whose axes are Explicit
(``jax.make_mesh``'s default), Auto, or mixed (Explicit 'data', Auto 'model');
the mesh comes from ``mesh=``, from ``with jax.set_mesh(mesh):``, or from the
operands (laid out first, no mesh given); and the call is eager, under
``jax.jit``, under ``jax.grad`` (of a scalar of the result) or under
``jax.vmap``.  A cell either equals the unsharded reference (values,
gradients, the result's layout, or the metadata computed eagerly with
``mesh=``), or raises the documented refusal: an EinshardError that says what
to write instead.  The refusals are listed in :func:`refusal`, each with the
reason; :func:`test_plain_jax_refuses_the_same` shows that plain JAX cannot do
those cells either.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import einshard
from einshard.errors import EinshardError

E, A = AxisType.Explicit, AxisType.Auto
# Built once: every cell of one kind shares its mesh (and JAX's caches keyed on it).
MESHES = {
    "explicit": jax.make_mesh((4, 2), ("data", "model")),  # JAX's default axis types
    "auto": jax.make_mesh((4, 2), ("data", "model"), axis_types=(A, A)),
    "mixed": jax.make_mesh((4, 2), ("data", "model"), axis_types=(E, A)),
}
SOURCES = ("mesh=", "set_mesh", "operands")
CONTEXTS = ("eager", "jit", "grad", "vmap")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 4)).astype(np.float32)  # b k
W = RNG.standard_normal((4, 6)).astype(np.float32)  # k n
COT = RNG.standard_normal((8, 6)).astype(np.float32)  # fixed cotangent of the einsum's result
Y = RNG.standard_normal((8, 6)).astype(np.float32)  # regression targets for DP/FSDP
LAYERS = (RNG.standard_normal((4, 4, 4)) / 2).astype(np.float32)  # pipeline: 4 layers of d d

EINSUM = "b@data k@model, k@model n -> b@data n@model"  # a reduce-scatter over model: async runs a ring
EINSUM_SPEC = P("data", "model")
X_EXPR, W_EXPR = "b k -> b@data k@model", "k n -> k@model n"
HI = jax.lax.Precision.HIGHEST


def _place(x: Any, expr: str, mesh: Any) -> Any:
    return einshard.einshard(x, expr, mesh=mesh)


@dataclass(frozen=True)
class Cell:
    """How one function is called and checked.

    ``make(mesh, placed)`` gives the positional arguments (laid out on ``mesh``
    when ``placed``); ``call(*args, **mesh_kw)`` runs the function and returns
    arrays (metadata functions record what they return in ``seen`` and pass
    their first argument through); ``ref(*args)`` is the unsharded reference
    written with plain jnp (differentiated for the grad context); ``spec`` the
    result's expected PartitionSpec (None: not checked); ``vmapped``: which
    arguments get a leading batch axis of 2 under vmap, and how to lay it out.
    """

    make: Callable[[Any, bool], tuple[Any, ...]]
    call: Callable[..., Any]
    ref: Callable[..., Any]
    spec: P | None = None
    vmapped: tuple[str | None, ...] = ()
    meta: bool = False  # a metadata function: compare what it returned, not the values
    reads_types: bool = False  # reads layouts from its operands (blind to Auto axes under a trace)


# ---------------------------------------------------------------------------
# The functions


def _einsum_args(mesh: Any, placed: bool) -> tuple[Any, ...]:
    return (_place(X, X_EXPR, mesh), _place(W, W_EXPR, mesh)) if placed else (X, W)


def _einsum_ref(x: Any, w: Any) -> Any:
    return jnp.einsum("bk,kn->bn", x, w, precision=HI)


def _einsum_cell(mode: str, two_way: bool = False) -> Cell:
    return Cell(
        _einsum_args,
        lambda x, w, **kw: einshard.einsum(EINSUM, x, w, mode=mode, two_way=two_way, precision=HI, **kw),
        _einsum_ref,
        EINSUM_SPEC,
        ("v b k -> v b@data k@model", None),
    )


def _lower_call(x: Any, w: Any, **kw: Any) -> Any:
    return einshard.lower(EINSUM, x, w, precision=HI, **kw)(x, w)


def _params_batch(fsdp: bool) -> Callable[[Any, bool], tuple[Any, ...]]:
    def make(mesh: Any, placed: bool) -> tuple[Any, ...]:
        params, batch = {"w": W}, {"x": X, "y": Y}
        if not placed:
            return params, batch
        p_expr = {"w": "d f -> d@data f"} if fsdp else {"w": "d f -> d f"}
        return _place(params, p_expr, mesh), _place(batch, "b ... -> b@data ...", mesh)

    return make


def _loss(p: Any, b: Any) -> Any:
    return jnp.mean((jnp.einsum("bk,kn->bn", b["x"], p["w"], precision=HI) - b["y"]) ** 2)


def _pipeline_args(mesh: Any, placed: bool) -> tuple[Any, ...]:
    params, x = {"w": LAYERS}, X
    if placed:
        return _place(params, "l d f -> l@model d f", mesh), _place(x, "b d -> b@data d", mesh)
    return params, x


def _layer(p: Any, h: Any) -> Any:
    return jnp.tanh(jnp.einsum("bd,df->bf", h, p["w"], precision=HI))


def _pipeline_ref(params: Any, x: Any) -> Any:
    h = x
    for i in range(LAYERS.shape[0]):
        h = _layer({"w": params["w"][i]}, h)
    return h


def _pipeline_call(params: Any, x: Any, **kw: Any) -> Any:
    return einshard.pipeline(_layer, params, x, microbatches=2, stage_axis="model", data_axis="data", **kw)


def _x_args(mesh: Any, placed: bool) -> tuple[Any, ...]:
    return (_place(X, "b k -> b k", mesh),) if placed else (X,)


def _placed_x(mesh: Any, placed: bool) -> tuple[Any, ...]:
    return (_place(X, X_EXPR, mesh), _place(W, W_EXPR, mesh))


def _placed_for_explain(mesh: Any, placed: bool) -> tuple[Any, ...]:
    # The contraction is not split: plain jnp code on Explicit axes needs no out_sharding then.
    return (_place(X, "b k -> b@data k", mesh), _place(W, "k n -> k n@model", mesh))


def _explained(x: Any, w: Any) -> Any:
    return jnp.einsum("bk,kn->bn", x, w)


SEEN: list[Any] = []


def _record(value: Any, *passthrough: Any) -> Any:
    SEEN.append(value)
    return passthrough[0]


def _summary(plan_or_report: Any) -> Any:
    if hasattr(plan_or_report, "collectives"):  # a EinsumPlan
        return (str(plan_or_report.out_layout), tuple(c.kind for c in plan_or_report.collectives))
    return (plan_or_report.comm_count, round(plan_or_report.comm_bytes), round(plan_or_report.flops))


FUNCTIONS: dict[str, Cell] = {
    "einshard": Cell(
        _x_args, lambda x, **kw: einshard.einshard(x, X_EXPR, **kw), lambda x: x, EINSUM_SPEC, ("v b k -> v b k",)
    ),
    "sharding": Cell(
        _x_args,
        lambda x, **kw: _record(einshard.sharding(X_EXPR, (8, 4), **kw).spec, x),
        lambda x: x,
        meta=True,
        vmapped=("v b k -> v b k",),
    ),
    "spec": Cell(
        _x_args,
        lambda x, **kw: _record(einshard.spec(X_EXPR, (8, 4), **kw), x),
        lambda x: x,
        meta=True,
        vmapped=("v b k -> v b k",),
    ),
    "layout": Cell(
        _x_args,
        lambda x, **kw: _record(str(einshard.layout(X_EXPR, (8, 4), **kw)), x),
        lambda x: x,
        meta=True,
        vmapped=("v b k -> v b k",),
    ),
    "describe": Cell(
        _placed_x,
        lambda x, w, **kw: _record(einshard.describe(x), x),
        lambda x, w: x,
        meta=True,
        reads_types=True,
        vmapped=("v b k -> v b@data k@model", None),
    ),
    "analyze": Cell(
        _einsum_args,
        lambda x, w, **kw: _record(_summary(einshard.analyze(EINSUM, x, w, **kw)), x),
        lambda x, w: x,
        meta=True,
        vmapped=("v b k -> v b@data k@model", None),
    ),
    "explain": Cell(
        _placed_for_explain,
        lambda x, w, **kw: _record(_summary(einshard.explain(_explained, x, w, **kw)), x),
        lambda x, w: x,
        meta=True,
        reads_types=True,
        vmapped=("v b k -> v b@data k", None),
    ),
    "einsum-sync": _einsum_cell("sync"),
    "einsum-async": _einsum_cell("async"),
    "einsum-two-way": _einsum_cell("async", two_way=True),
    "einsum-auto": _einsum_cell("auto"),
    "lower": Cell(_einsum_args, _lower_call, _einsum_ref, EINSUM_SPEC, ("v b k -> v b@data k@model", None)),
    "data_parallel": Cell(
        _params_batch(False),
        lambda p, b, **kw: einshard.data_parallel(_loss, **kw)(p, b),
        _loss,
        P(),
        ("v d f -> v d f", None),
    ),
    "fsdp": Cell(
        _params_batch(True),
        lambda p, b, **kw: einshard.fsdp(_loss, {"w": "d f -> d@data f"}, **kw)(p, b),
        _loss,
        P(),
        ("v d f -> v d f", None),
    ),
    "pipeline": Cell(_pipeline_args, _pipeline_call, _pipeline_ref, P("data", None), (None, "v b d -> v b@data d")),
}


# ---------------------------------------------------------------------------
# The documented refusals


def refusal(fn: str, kind: str, source: str, context: str) -> str | None:
    """The EinshardError message (a regex) a cell must raise, or None if it must compute the reference."""
    cell = FUNCTIONS[fn]
    if source == "operands" and fn in ("sharding", "layout"):
        # No operands to read a mesh from, no mesh= and no mesh context: the error says how to give one.
        return "mesh"
    if cell.reads_types and kind != "explicit" and context != "eager" and not (fn == "describe" and context == "grad"):
        # A traced value's type carries only its Explicit axes: its Auto layout cannot be read back.  (Under
        # eager jax.grad describe() reads the concrete value under the tracer, which carries its whole layout.)
        return "Auto"
    if context == "grad" and kind != "auto" and source != "set_mesh" and not cell.meta:
        # Plain JAX cannot differentiate a value typed on a mesh with Explicit axes eagerly outside
        # a mesh context (test_plain_jax_refuses_the_same): einshard says what to write instead.
        return "jax.set_mesh"
    return None


# ---------------------------------------------------------------------------
# Running one cell


def _batched(args: tuple[Any, ...], exprs: tuple[str | None, ...], mesh: Any, placed: bool) -> tuple[Any, ...]:
    out = []
    for a, expr in zip(args, exprs, strict=True):
        if expr is None:
            out.append(a)
            continue
        stacked = jax.tree.map(lambda v: np.stack([np.asarray(v), 2 * np.asarray(v)]), a)
        out.append(_place(stacked, expr, mesh) if placed else stacked)
    return tuple(out)


def _in_axes(exprs: tuple[str | None, ...]) -> tuple[int | None, ...]:
    return tuple(None if e is None else 0 for e in exprs)


def _scalar(out: Any) -> Any:
    if out.shape == COT.shape:
        return jnp.sum(out * COT)
    return jnp.sum(out)


def _check_spec(out: Any, mesh: Any, spec: P | None) -> None:
    if spec is None:
        return
    want = NamedSharding(mesh, spec)
    assert out.sharding.is_equivalent_to(want, out.ndim), (out.sharding, want)


def _reference_meta(fn: str, mesh: Any) -> list[Any]:
    cell = FUNCTIONS[fn]
    del SEEN[:]
    cell.call(*cell.make(mesh, True), mesh=mesh)
    return list(SEEN)


def _run(fn: str, kind: str, source: str, context: str) -> None:
    cell = FUNCTIONS[fn]
    mesh = MESHES[kind]
    placed = source == "operands"
    args = cell.make(mesh, placed)
    kw = {"mesh": mesh} if source == "mesh=" else {}
    scope = jax.set_mesh(mesh) if source == "set_mesh" else contextlib.nullcontext()
    f = functools.partial(cell.call, **kw)
    want_meta = _reference_meta(fn, mesh) if cell.meta else None
    del SEEN[:]
    with scope:
        if context in ("eager", "jit"):
            out = (jax.jit(f) if context == "jit" else f)(*args)
            if not cell.meta:
                want = cell.ref(*jax.tree.map(np.asarray, args))  # the unsharded reference, on host copies
                np.testing.assert_allclose(np.asarray(jax.tree.leaves(out)[0]), np.asarray(want), rtol=2e-5, atol=2e-5)
                spec = cell.spec
                if fn == "einsum-auto" and kind == "mixed" and context == "jit" and source != "mesh=" and spec:
                    # Documented gap (docs/lowering.md, mode='auto'): under a trace on a mixed mesh with no
                    # concrete mesh, the result's split over the Auto axis ('model') is XLA's choice.
                    spec = P(*[None if e == "model" else e for e in spec])
                _check_spec(out, mesh, spec)
        elif context == "grad" and cell.meta:
            # The forward half of jax.grad (the metadata function runs on linearize tracers); the
            # backward of a pass-through is not the metadata function's business.
            jax.linearize(f, *args)
        elif context == "grad":
            argnums = tuple(range(len(args)))
            got = jax.grad(lambda *a: _scalar(f(*a)), argnums)(*args)
            want = jax.grad(lambda *a: _scalar(cell.ref(*a)), argnums)(*jax.tree.map(np.asarray, args))
            for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
            if fn == "fsdp":  # gradients arrive laid out like the stored weights
                _check_spec(got[0]["w"], mesh, P("data", None))
        else:  # vmap
            vargs = _batched(args, cell.vmapped, mesh, placed or cell.reads_types)
            out = jax.vmap(f, in_axes=_in_axes(cell.vmapped))(*vargs)
            if not cell.meta:
                host = [jax.tree.map(np.asarray, a) for a in vargs]
                for i in range(2):
                    one = [jax.tree.map(lambda v, i=i: v[i], a) if e else a for a, e in zip(host, cell.vmapped)]
                    np.testing.assert_allclose(
                        np.asarray(out)[i], np.asarray(cell.ref(*one)), rtol=2e-5, atol=2e-5, err_msg=f"batch {i}"
                    )
    if cell.meta:
        assert SEEN, "the metadata function was not called"
        assert all(s == want_meta[0] for s in SEEN), (SEEN, want_meta)


def _in_default_run(fn: str, kind: str, source: str, context: str) -> bool:
    """The cells of the default run: a covering array over the functions, plus grad inside set_mesh on Explicit axes.

    Function ``f`` meets context ``c`` on mesh kind ``(f + c) mod 3`` from source ``(f + 2c) mod 3``: every
    function meets every kind, every source and every context, and across functions every (kind, source),
    (kind, context) and (source, context) pair occurs.  The other cells of the full product are marked slow
    (CI runs all 540; the default run stays short).
    """
    f, k = list(FUNCTIONS).index(fn), list(MESHES).index(kind)
    s, c = SOURCES.index(source), CONTEXTS.index(context)
    n = len(SOURCES)
    # Plus jax.grad inside jax.set_mesh on the Explicit mesh: the covering array alone would meet most
    # Explicit-axis grad cells only as the refused ones (eager grad outside a mesh context).  Auto and mixed
    # meshes meet grad in the covering array itself.
    return (k == (f + c) % n and s == (f + 2 * c) % n) or (kind, source, context) == ("explicit", "set_mesh", "grad")


def _cells() -> list[Any]:
    cells = []
    for fn in FUNCTIONS:
        for kind in MESHES:
            for source in SOURCES:
                for context in CONTEXTS:
                    marks = () if _in_default_run(fn, kind, source, context) else (pytest.mark.slow,)
                    cells.append(
                        pytest.param(fn, kind, source, context, marks=marks, id=f"{fn}-{kind}-{source}-{context}")
                    )
    return cells


@pytest.mark.parametrize(("fn", "kind", "source", "context"), _cells())
def test_cell(fn: str, kind: str, source: str, context: str) -> None:
    expected_error = refusal(fn, kind, source, context)
    if expected_error is None:
        _run(fn, kind, source, context)
        return
    with pytest.raises(EinshardError, match=expected_error) as err:
        _run(fn, kind, source, context)
    # A documented refusal says what to write instead.
    assert err.value.hint or "pass" in str(err.value).lower() or "write" in str(err.value).lower(), str(err.value)


def test_plain_jax_refuses_the_same() -> None:
    """The refused grad cells: plain jnp code on arrays on an Explicit mesh cannot be differentiated eagerly
    outside a mesh context either (inside `jax.set_mesh` it can)."""
    for kind in ("explicit", "mixed"):
        mesh = MESHES[kind]
        x = jax.device_put(X, NamedSharding(mesh, P("data")))
        with pytest.raises(Exception):  # noqa: B017, PT011 - JAX's own error, which differs by kind and release
            jax.grad(lambda a: jnp.sum(a * 2))(x)
        with jax.set_mesh(mesh):
            np.testing.assert_allclose(np.asarray(jax.grad(lambda a: jnp.sum(a * 2))(x)), 2 * np.ones_like(X))
            np.testing.assert_allclose(np.asarray(jax.jit(jax.grad(lambda a: jnp.sum(a * 2)))(x)), 2 * np.ones_like(X))


def test_the_default_cells_cover_every_value_and_pair() -> None:
    cells = [
        (fn, kind, source, context)
        for fn in FUNCTIONS
        for kind in MESHES
        for source in SOURCES
        for context in CONTEXTS
        if _in_default_run(fn, kind, source, context)
    ]
    for fn in FUNCTIONS:  # each function meets every kind, source and context
        mine = [c for c in cells if c[0] == fn]
        assert [len({c[i] for c in mine}) for i in (1, 2, 3)] == [len(MESHES), len(SOURCES), len(CONTEXTS)], fn
    for i, j in ((1, 2), (1, 3), (2, 3)):  # and across functions every pair of values occurs
        assert len({(c[i], c[j]) for c in cells}) == len((MESHES, SOURCES, CONTEXTS)[i - 1]) * len(
            (MESHES, SOURCES, CONTEXTS)[j - 1]
        )
    assert len(cells) <= 75  # the default run's share of the 540 (the rest are slow)
    assert all((fn, "explicit", "set_mesh", "grad") in cells for fn in FUNCTIONS)
