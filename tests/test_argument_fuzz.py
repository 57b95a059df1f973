"""Every argument of every public function, fed bad values: each an EinshardError that names the argument.

The public surface is enumerated, not listed: everything in ``einshard.__all__`` and in the ``__all__`` of every
public submodule (found with ``pkgutil``), read with ``inspect.signature``.  Each callable needs an entry in
:data:`TABLE`: a valid call (``base``) and, per parameter, the *kind* of value it takes.  The kind generates the
bad values (wrong types, bytes for str, NaN/inf, zero, negative, empty, huge, duplicates) — only values that are
bad for *that* parameter, so the test is honest: a value a parameter legitimately takes is never in its list.
A new public function, or a new parameter, without an entry fails :func:`test_every_public_callable_has_an_entry`
with what to add.

The command line's value options are enumerated the same way from its argparse parsers (:data:`CLI_TABLE`).

The default run takes a fixed sample of the (function, parameter, bad value) cases; the full cross product is
``slow``.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import pathlib
import pkgutil
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import einshard
from einshard.errors import EinshardError
from einshard.placement import Layout, MeshAxis

MESH = jax.make_mesh((4, 2), ("data", "model"))  # JAX's default (Explicit) axis types
STAGES = jax.make_mesh((4, 2), ("stage", "data"))
X = np.ones((8, 4), np.float32)
W = np.ones((4, 6), np.float32)
LAY = Layout(("a", "b"), (8, 4), (MeshAxis("data", 4), MeshAxis("model", 2)), (("data",), ()))
PARAMS = {"w": np.ones((4, 4), np.float32)}
STACKED = {"w": np.ones((4, 8, 8), np.float32)}  # 4 layers
H = np.ones((8, 8), np.float32)


def _loss(p: Any, b: Any) -> Any:
    return jnp.mean((b @ p["w"]) ** 2)


def _layer(p: Any, h: Any) -> Any:
    return jnp.tanh(h @ p["w"])


def _step(p: Any, x: Any) -> Any:
    return jax.grad(lambda q: jnp.sum(jnp.tanh(x @ q["w"])))(p)


def _sds(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _duplicate_mesh() -> Any:
    return jax.sharding.Mesh(np.asarray(jax.devices()[:8]).reshape(4, 2), ("data", "data"))


# ---------------------------------------------------------------------------
# Kinds of values: each a function giving the values that are *bad* for a parameter of that kind.

NAN, INF = float("nan"), float("inf")
HUGE = 10**4000  # more digits than int(str) accepts: a count no mesh, shape or search can have


def _not_bool() -> list[Any]:
    return ["yes", None, 2, NAN, b"1"]


def _int(minimum: int, huge: bool = False) -> Callable[[], list[Any]]:
    def bad() -> list[Any]:
        out = [minimum - 1, -(10**9), 1.5, NAN, INF, str(minimum + 1), True, b"2", None]
        return out + ([HUGE] if huge else [])

    return bad


def _number(minimum: float, positive: bool = False, optional: bool = False) -> Callable[[], list[Any]]:
    def bad() -> list[Any]:
        out = [NAN, INF, -INF, minimum - 1, "1.0", b"1", True] + ([] if optional else [None])
        return out + ([0.0] if positive else [])

    return bad


def _expr() -> list[Any]:
    return [b"a b -> a b", 3, None, ["a b -> a b"], "", "a -> a" + "9" * 5000]


def _axis_name() -> list[Any]:
    return [b"data", 3, None, "", ("data", "data")]


def _names() -> list[Any]:
    return [3, b"a b", ["a", "b"]]


def _callable() -> list[Any]:
    return [3, "fn", None]


def _shape() -> list[Any]:
    return [(-1, 4), (8.0, 4), (NAN, 4), "84", (True, 4), None, 8, (b"8", 4)]


def _dtype() -> list[Any]:
    return ["bogus", b"f4", "U3", object, 3.5]


def _profile() -> list[Any]:
    return ["h999", 3, b"cpu", ("cpu",)]


def _mesh() -> list[Any]:
    return ["data", 3, {"data": 0}, {"data": NAN}, {b"data": 2}, {"data": True}, _duplicate_mesh()]


def _tree() -> list[Any]:
    return [np.array(["a", "b"]), np.array([object()] * 8), {"w": np.array(["x"] * 8)}]


def _array() -> list[Any]:
    return [np.array(["a", "b"]), np.array([object()] * 8), "x"]


def _rules() -> list[Any]:
    return [3, {b"w": "a b -> a b"}, {"(" * 2000 + "w" + ")" * 2000: "a b -> a b"}, {"(": "a b -> a b"}, {"w": 3}]


def _specs() -> list[Any]:
    return [1, "x", (1, 2), (b"data", None)]


def _spec() -> list[Any]:
    return ["data", 3, ("data",)]


def _precision() -> list[Any]:
    return ["bogus", 3, b"high", ("high",), NAN]


def _budget() -> list[Any]:
    return [NAN, INF, -1, 0, "lots", b"1GB", True, "9" * 5000 + "GB", "1.2.3GB"]


def _file() -> list[Any]:
    return ["out.txt", 3]


def _dims() -> list[Any]:
    return [3.5, b"a", [1.5], {"a": 1}]


def _layout() -> list[Any]:
    return ["a b -> a b", 3, None, P("data")]


def _sizes_map() -> list[Any]:
    return [
        [("a", 8)],
        "a=8",
        {"a": NAN, "b": 4, "c": 6},
        {"a": -8, "b": 4, "c": 6},
        {"a": "8", "b": 4, "c": 6},
        {"a": True, "b": 4, "c": 6},
    ]


def _one_of(*valid: str) -> Callable[[], list[Any]]:
    def bad() -> list[Any]:
        return ["not-" + valid[0], b"" + valid[0].encode(), 3, None, valid[0].upper() + "!"]

    return bad


def _int_pair() -> list[Any]:
    return [(0, 2), (3, 2), (1, NAN), "23", (1,), 3]


# ---------------------------------------------------------------------------
# The table


def _target() -> list[Any]:
    return [b"tpu:v5e:2x2", 3, "", "tpu", "tpu:v9:2x2", "tpu:v5p:2x2", "gpu:h100x0", ["tpu:v5e:2x2"], NAN]


def _refused_gpu(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
    """A GPU target describes no devices (no compiler without the device): the valid call's answer is that
    refusal, which names the target; a bad argument must be refused before it, naming itself."""
    try:
        return fn(**kw)
    except EinshardError as err:
        if "no compiler" in str(err) and kw.get("target") == "gpu:h100x8":
            return None
        raise


@dataclass(frozen=True)
class Entry:
    """A valid call and the kind of each parameter.

    base: the keyword arguments of a valid call (positional-only parameters by name too; a ``*args`` parameter's
        values under its name, as a tuple).
    kinds: parameter name -> the function giving its bad values.
    call: how to call (default ``fn(**base)`` with ``*args`` spread); a function that runs only inside
        ``jax.shard_map`` or ``jax.jit`` says so here.
    """

    base: Callable[[], dict[str, Any]]
    kinds: dict[str, Callable[[], list[Any]]]
    call: Callable[[Callable[..., Any], dict[str, Any]], Any] | None = None
    any_value: dict[str, str] = field(default_factory=dict)  # parameters that take any value: why
    # parameters whose errors name them as users write them elsewhere: einshard.axis_rules(table) is the table
    # of every call's axis_rules=, and its errors say "axis_rules=" wherever it came from
    named_as: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Record:
    """A result record the library builds and returns (read, not constructed, by users): not fuzzed."""

    why: str


@dataclass(frozen=True)
class Constant:
    why: str = "a constant"


def _in_mesh(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
    with jax.set_mesh(MESH):
        return _plain(fn, kw)


def _plain(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
    """``fn`` called with ``kw``: parameters before a ``*args`` go by position (as users write them)."""
    params = list(inspect.signature(fn).parameters.values())
    star = next((i for i, p in enumerate(params) if p.kind is p.VAR_POSITIONAL), None)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for i, p in enumerate(params):
        if p.name not in kw:
            continue
        if p.kind is p.VAR_POSITIONAL:
            args.extend(kw[p.name])
        elif p.kind is p.POSITIONAL_ONLY or (star is not None and i < star):
            args.append(kw[p.name])
        elif p.kind is p.VAR_KEYWORD:
            kwargs.update(kw[p.name])
        else:
            kwargs[p.name] = kw[p.name]
    return fn(*args, **kwargs)


def _then_step(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
    """A wrapper (data_parallel, fsdp) checks what it was given when it is built or first called."""
    return _plain(fn, kw)(PARAMS, X)


def _einsum_base() -> dict[str, Any]:
    return {"expr": "b k, k n -> b n", "operands": (X, W), "mesh": MESH}


_EINSUM_KINDS: dict[str, Callable[[], list[Any]]] = {
    "expr": _expr,
    "mode": _one_of("sync", "async", "auto"),
    "mesh": _mesh,
    "two_way": _not_bool,
    "profile": _profile,
    "precision": _precision,
    "preferred_element_type": _dtype,
}
_OPERANDS = {"operands": "arrays: shapes and non-arrays are fuzzed by tests/test_bad_input.py"}
_PRIMITIVE_KINDS: dict[str, Callable[[], list[Any]]] = {
    "lay": _layout,
    "itemsize": _int(1),
    "profile": lambda: ["h999", 3, b"cpu"],
    "tensor": lambda: [3, b"w"],
    "why": lambda: [3, b"w"],
}

TABLE: dict[str, Entry | Record | Constant] = {
    # ----------------------------------------------------------------- einshard (top level)
    "einshard.einshard": Entry(
        lambda: {"x": X, "expr": "a b -> a@data b", "mesh": MESH},
        {"x": _tree, "expr": _rules, "mesh": _mesh, "process_local": _not_bool},
    ),
    "einshard.sharding": Entry(
        lambda: {"expr": "a b -> a@data b", "shape": (8, 4), "mesh": MESH},
        {"expr": _expr, "shape": _shape, "mesh": _mesh},
    ),
    "einshard.spec": Entry(
        lambda: {"expr": "a b -> a@data b", "shape": (8, 4), "mesh": MESH},
        {"expr": _expr, "shape": lambda: [s for s in _shape() if s is not None], "mesh": _mesh},
    ),
    "einshard.layout": Entry(
        lambda: {"expr": "a b -> a@data b", "shape": (8, 4), "mesh": MESH},
        {"expr": _expr, "shape": _shape, "mesh": _mesh},
    ),
    "einshard.describe": Entry(
        lambda: {"x": einshard.einshard(X, "a b -> a@data b", mesh=MESH), "names": "b d"},
        {"x": lambda: ["x", 3, None], "names": _names},
    ),
    "einshard.show": Entry(
        lambda: {
            "x": einshard.einshard(X, "a b -> a@data b", mesh=MESH),
            "dims": "b",
            "names": "b d",
            "file": io.StringIO(),
        },
        {"x": lambda: ["x", 3, None], "dims": _dims, "names": _names, "file": _file},
    ),
    "einshard.Layout": Entry(
        lambda: {
            "axes": ("a", "b"),
            "shape": (8, 4),
            "mesh": (MeshAxis("data", 4),),
            "dims": (("data",), ()),
            "unreduced": frozenset(),
        },
        {
            "axes": lambda: ["ab", ("a", "a"), ("a", 3), None, (b"a", "b")],
            "shape": lambda: [(8, -4), (8, 4.0), (8, NAN), "84", (8, True), None, (8,)],
            "mesh": lambda: [("data",), (MeshAxis("data", 4), MeshAxis("data", 4)), {"data": 4}, None],
            "dims": lambda: [("data", ()), (("data",), ("data",)), (("nope",), ()), ((3,), ()), None],
            "unreduced": lambda: [{"data"}, "data", frozenset({"nope"}), frozenset({3}), None],
        },
    ),
    "einshard.analyze": Entry(
        lambda: {"expr": "a b, b c -> a c", "mesh": {"data": 4}, "sizes": {"a": 8, "b": 4, "c": 6}},
        {
            "expr": _expr,
            "mesh": _mesh,
            "sizes": _sizes_map,
            "dtype": _dtype,
            "profile": _profile,
            "in_specs": _specs,
            "out_spec": _spec,
        },
        any_value={"operands": "arrays or ShapeDtypeStructs, checked against the expression (test_analysis.py)"},
    ),
    "einshard.EinsumPlan": Record("analyze's answer"),
    "einshard.explain": Entry(
        lambda: {"fn": _step, "args": (PARAMS, X), "mesh": MESH},
        {
            "fn": _callable,
            "mesh": _mesh,
            "in_specs": lambda: [3, "data"],
            "out_specs": lambda: [3, "data", P("nope"), (None, None)],
            "profile": _profile,
            "target": _target,
        },
        any_value={"args": "the function's own arguments (any pytree)"},
    ),
    "einshard.plan": Entry(
        lambda: {"fn": _step, "args": (PARAMS, X), "mesh": {"data": 4, "model": 2}},
        {
            "fn": _callable,
            "mesh": _mesh,
            "profile": _profile,
            "memory_budget": _budget,
            "objective": _one_of("training", "inference", "memory", "communication"),
            "param_args": lambda: ["0", 0, (0, 0), (-1,), (5,), (1.0,), (NAN,)],
            "data_args": lambda: ["1", 1, (1, 1), (-1,), (5,), (0,)],  # (0,): argument 0 holds the parameters
            "optimizer_bytes_per_param": _number(0, optional=True),
            "presets": lambda: [3, "dp", {3: ("a", "b")}],
            "pipeline": lambda: [3, "gpipe", {"hidden": 8}],
            "search": lambda: [3, "exhaustive", {"max_evaluations": 4}, (256, 160)],
            # (None is the default; a count above the candidates compiles them all, as documented)
            "verify": lambda: [-1, -(10**9), 1.5, NAN, INF, "1", True, b"2"],
            "target": _target,
        },
        any_value={"args": "the function's own arguments (any pytree)"},
    ),
    "einshard.LayoutPlan": Record("plan's answer"),
    "einshard.Profile": Entry(
        lambda: {"name": "toy", "flops": 1e12, "bandwidth": 1e9, "latency": 1e-6},
        {
            "name": lambda: [3, b"toy", "", None],
            "flops": _number(0, positive=True),
            "bandwidth": _number(0, positive=True),
            "latency": _number(0),
            "topology": _one_of("switch", "ring"),
            "tiling": _one_of("dense", "tpu"),
            "narrow_floats": _one_of("native", "f32"),
            # (None is the default: each device on a core of its own)
            "host_cores": lambda: [0, -1, 1.5, True, "2", b"2"],
            "combined_latency": _one_of("once", "per_piece"),
            "reduce_scatter": _one_of("native", "all-reduce"),
            "latency_steps": _one_of("ring", "peers"),
            "op_overhead": _number(0),
            "element_time": _number(0),
            "collective_overhead": _number(0),
        },
    ),
    "einshard.einsum": Entry(_einsum_base, _EINSUM_KINDS, any_value=_OPERANDS),
    "einshard.lower": Entry(_einsum_base, _EINSUM_KINDS, any_value=_OPERANDS),
    "einshard.data_parallel": Entry(
        lambda: {"loss_fn": _loss, "mesh": MESH},
        {
            "loss_fn": _callable,
            "mesh": _mesh,
            "batch_axis": lambda: [3, b"data", "", ("data", "data"), "nope"],
            "param_layouts": _rules,
            "batch_layouts": _rules,
        },
        call=_then_step,
    ),
    "einshard.fsdp": Entry(
        lambda: {"loss_fn": _loss, "param_layouts": {"w": "a b -> a@data b"}, "mesh": MESH},
        {
            "loss_fn": _callable,
            "param_layouts": _rules,
            "mesh": _mesh,
            "batch_axis": lambda: [3, b"data", "", ("data", "data"), "nope"],
            "fsdp_axis": lambda: [3, b"data", "", ("data", "data"), "nope"],
            "batch_layouts": _rules,
            "remat": _not_bool,
        },
        call=_then_step,
    ),
    "einshard.fsdp_layouts": Entry(
        lambda: {"params": PARAMS, "axis": "data", "size": 4},
        # (a size no leaf divides, however large, leaves every leaf whole: documented, not an error)
        {"params": _tree, "axis": _axis_name, "size": _int(1), "min_elements": _int(0)},
    ),
    "einshard.pipeline": Entry(
        lambda: {"layer_fn": _layer, "params": STACKED, "x": H, "microbatches": 2, "mesh": STAGES},
        {
            "layer_fn": _callable,
            "params": _tree,
            "x": _array,
            "microbatches": _int(1, huge=True),
            "schedule": _one_of("gpipe", "circular", "1f1b", "interleaved"),
            "repeats": _int(1, huge=True),
            "mesh": _mesh,
            "stage_axis": _axis_name,
            "data_axis": lambda: [3, b"data", "", ("data", "data"), "nope"],
            "param_layouts": _rules,
            "layers_in_circular_order": _not_bool,
            "remat": _not_bool,
            "sanitize": _not_bool,
            "bubble_value": lambda: ["0", b"0", None, True],  # NaN is valid: tests poison the bubbles with it
            "first": lambda: [3, _layer],
            "last": lambda: [3, _layer],
        },
    ),
    "einshard.pipeline_info": Entry(
        lambda: {"params": STACKED, "x": H, "microbatches": 2, "mesh": STAGES},
        {
            "params": _tree,
            "x": _array,
            "microbatches": _int(1, huge=True),
            "schedule": _one_of("gpipe", "circular", "1f1b", "interleaved"),
            "repeats": _int(1, huge=True),
            "mesh": _mesh,
            "stage_axis": _axis_name,
            "data_axis": lambda: [3, b"data", "", ("data", "data"), "nope"],
            "remat": _not_bool,
        },
    ),
    "einshard.EinshardError": Record("the error type itself"),
    "einshard.clear_caches": Entry(dict, {}),
}


# ---------------------------------------------------------------------------
# Values and calls for the submodules' functions

MESH_AXES = (MeshAxis("data", 4), MeshAxis("model", 2))
LAY_WHOLE = Layout(("a", "b"), (8, 4), MESH_AXES, ((), ()))
LAY_PENDING = Layout(("a", "b"), (8, 4), MESH_AXES, ((), ()), frozenset({"model"}))
LAY_TWO = Layout(("a", "b"), (8, 4), MESH_AXES, (("data", "model"), ()))
LAY_BC = Layout(("b", "c"), (4, 6), MESH_AXES, ((), ()))
RING = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4])


def _shard_mapped(in_specs: tuple[Any, ...], out_specs: Any, names: tuple[str, ...]) -> Callable[..., Any]:
    """``fn(**kw)`` run inside ``jax.shard_map`` over the 4-device ring mesh ``x`` (where it runs), the arguments
    ``names`` passed in as its blocks."""

    def call(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
        rest = {k: v for k, v in kw.items() if k not in names}
        blocks = tuple(kw[n] for n in names)

        def body(*b: Any) -> Any:
            return _plain(fn, {**rest, **dict(zip(names, b))})

        return jax.shard_map(body, mesh=RING, in_specs=in_specs, out_specs=out_specs, check_vma=False)(*blocks)

    return call


def _then_call(*operands: Any) -> Callable[[Callable[..., Any], dict[str, Any]], Any]:
    """Functions that build a function (einsum_auto, einsum_shard_map): built, then called."""

    def call(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
        return _plain(fn, kw)(*operands)

    return call


def _mesh_axis_names() -> list[Any]:
    return ["data", ("nope",), ("data", "data"), (3,), None, (b"data",)]


def _layout_axis() -> list[Any]:
    return ["nope", 5, -9, 1.5, None, b"b", True]


def _strings(*extra: Any) -> Callable[[], list[Any]]:
    return lambda: [3, b"w", None, *extra]


def _layouts_tuple() -> list[Any]:
    return [3, "a b", (3,), (LAY,)]  # (LAY,): one layout for a two-operand einsum


def _shapes() -> list[Any]:
    return [3, "x", [(8, 4)], [(-8, 4), (4, 6)], [(8.5, 4), (4, 6)], [(8, 4), (4, NAN)]]


def _gather_step() -> Any:
    from einshard.lowering import Step

    return Step("all-gather", 0, ("x",), dim=0)


def _flax_model() -> Any:
    from flax import nnx

    return nnx.Linear(4, 8, rngs=nnx.Rngs(0))


def _pipeline_end() -> Any:
    from einshard.lowering import PipelineEnd

    return PipelineEnd(lambda p, h: h)


def _problem() -> Any:
    from einshard.analysis import PROFILES, Problem

    return Problem((LAY_WHOLE, LAY_BC), ("a", "c"), (("a", 8), ("b", 4), ("c", 6)), MESH_AXES, None, 4, PROFILES["cpu"])


def _padding() -> Any:
    from einshard.lowering import plan_padding

    return plan_padding("b x@model, x@model y -> b y", [(3, 10), (10, 5)], MESH)


def _test_fn(w: Any, x: Any) -> Any:
    return x @ w


SUBMODULE_TABLE: dict[str, Entry | Record | Constant] = {
    # ----------------------------------------------------------------- einshard.analysis
    "einshard.analysis.Collective": Record("a collective the analyzer found (plan.collectives)"),
    "einshard.analysis.OpReport": Record("one op of explain's report"),
    "einshard.analysis.ProgramReport": Record("explain's report"),
    "einshard.analysis.Problem": Record("an einsum resolved by analyze (plan.problem); analyze_layouts takes it"),
    "einshard.analysis.all_gather": Entry(
        lambda: {"lay": LAY, "axes": ("data",)}, {**_PRIMITIVE_KINDS, "axes": _mesh_axis_names}
    ),
    "einshard.analysis.all_reduce": Entry(
        lambda: {"lay": LAY_PENDING, "axes": ("model",)}, {**_PRIMITIVE_KINDS, "axes": _mesh_axis_names}
    ),
    "einshard.analysis.reduce_scatter": Entry(
        lambda: {"lay": LAY_PENDING, "axes": ("model",), "axis": "b"},
        {
            **_PRIMITIVE_KINDS,
            "axes": _mesh_axis_names,
            "axis": _layout_axis,
            "order": lambda: ["model", (3,), ("nope",)],
        },
    ),
    "einshard.analysis.all_to_all": Entry(
        lambda: {"lay": LAY, "axes": ("data",), "src": "a", "dst": "b"},
        {**_PRIMITIVE_KINDS, "axes": _mesh_axis_names, "src": _layout_axis, "dst": _layout_axis},
    ),
    "einshard.analysis.collective_permute": Entry(
        lambda: {"lay": LAY_TWO, "dims": (("model", "data"), ())},
        {**_PRIMITIVE_KINDS, "dims": lambda: [3, "model", (("model", "data"),), ((3,), ()), (("nope",), ())]},
    ),
    "einshard.analysis.dynamic_slice": Entry(
        lambda: {"lay": LAY, "axes": ("model",), "axis": "b"},
        {"lay": _layout, "axes": _mesh_axis_names, "axis": _layout_axis},
    ),
    "einshard.analysis.regroup": Entry(
        lambda: {"lay": LAY, "axis": "a", "gone": ("data",), "new": ("model",)},
        {
            **{k: v for k, v in _PRIMITIVE_KINDS.items() if k != "why"},
            "axis": _layout_axis,
            "gone": _mesh_axis_names,
            "new": _mesh_axis_names,
        },
    ),
    "einshard.analysis.transition": Entry(
        lambda: {"src": LAY, "dst": LAY_WHOLE},
        {
            **{k: v for k, v in _PRIMITIVE_KINDS.items() if k not in ("lay", "why")},
            "src": _layout,
            "dst": lambda: [3, "a b", LAY_BC],
        },
    ),
    "einshard.analysis.analyze_layouts": Entry(
        lambda: {"problem": _problem()}, {"problem": lambda: [3, None, "a b, b c -> a c"], "dtype": _dtype}
    ),
    "einshard.analysis.classify": Entry(
        lambda: {"operand_axes": (("a", "b"), ("b", "c")), "out_axes": ("a", "c")},
        {
            "operand_axes": lambda: ["ab", 3, ((3,),), (("a", "a"),), None],
            "out_axes": lambda: ["ac", 3, ("a", "a"), (3,), None],
        },
    ),
    "einshard.analysis.dtype_info": Entry(lambda: {"dtype": "f32"}, {"dtype": _dtype}),
    "einshard.analysis.get_profile": Entry(lambda: {"profile": "h100"}, {"profile": _profile}),
    "einshard.analysis.plan_einsum": Entry(
        lambda: {"operands": (LAY_WHOLE, LAY_BC), "out_axes": ("a", "c")},
        {
            "operands": lambda: [3, "a b", (3, LAY_BC), (LAY_WHOLE,)],
            "out_axes": lambda: ["ac", 3, ("a", "a"), (3,), None],
            "out": lambda: [3, "a c", LAY_BC],
            "dtype": _dtype,
            "profile": _profile,
        },
    ),
    "einshard.analysis.spec_partitions": Entry(lambda: {"spec": P("data")}, {"spec": lambda: [3, "data", None]}),
    # ----------------------------------------------------------------- einshard.placement (from core)
    "einshard.placement.MeshAxis": Entry(
        lambda: {"name": "data", "size": 4}, {"name": lambda: [3, b"data", "", None], "size": _int(1)}
    ),
    "einshard.placement.resolve_mesh": Entry(
        lambda: {"mesh": MESH},
        {
            "mesh": _mesh,
            "operands": lambda: [3, None],
            "what": lambda: [3, b"x", None],
            "check_operands": _not_bool,
            "required": _not_bool,
        },
    ),
    # ----------------------------------------------------------------- einshard.placement (from drawing)
    "einshard.placement.render": Entry(
        lambda: {"x": einshard.einshard(X, "a b -> a@data b", mesh=MESH), "dims": "b", "names": "b d"},
        {"x": lambda: ["x", 3, None], "dims": _dims, "names": _names},
    ),
    # ----------------------------------------------------------------- einshard.lowering
    "einshard.lowering.Padding": Record("plan_padding's answer"),
    "einshard.lowering.PipelineInfo": Record("pipeline_info's answer"),
    "einshard.lowering.PipelineEnd": Entry(
        lambda: {"fn": lambda p, h: h},
        {"fn": _callable, "layouts": _rules, "args": lambda: [3, "x", [X]]},
        any_value={"params": "any pytree of arrays (checked where it runs)"},
    ),
    "einshard.lowering.pad_operands": Entry(
        lambda: {"padding": _padding(), "operands": [np.ones((3, 10)), np.ones((10, 5))]},
        {
            "padding": lambda: [3, None, "x"],
            "operands": lambda: [3, [np.ones((3, 10))], [np.ones((3, 9)), np.ones((10, 5))]],
        },
    ),
    "einshard.lowering.unpad_result": Entry(
        lambda: {"padding": _padding(), "y": np.ones((3, 5))},
        {"padding": lambda: [3, None, "x"], "y": lambda: ["x", 3, np.ones((4, 5)), np.array(["a"] * 15).reshape(3, 5)]},
    ),
    "einshard.lowering.plan_padding": Entry(
        lambda: {"expr": "b x@model, x@model y -> b y", "shapes": [(3, 10), (10, 5)], "mesh": MESH},
        {"expr": _expr, "shapes": _shapes, "mesh": _mesh},
    ),
    "einshard.lowering.einsum_layouts": Entry(
        lambda: {"expr": "b x@model, x@model y -> b y", "shapes": [(4, 6), (6, 8)], "mesh": MESH},
        {"expr": _expr, "shapes": _shapes, "mesh": _mesh},
    ),
    "einshard.lowering.circular_layer_order": Entry(
        lambda: {"params": np.arange(8), "stages": 2, "repeats": 2},
        {"params": _tree, "stages": _int(1, huge=True), "repeats": _int(1, huge=True)},
    ),
    "einshard.lowering.Step": Entry(
        lambda: {"kind": "all-gather", "operand": 0, "mesh_axes": ("x",), "dim": 0},
        {
            "kind": _one_of("all-gather", "all-reduce"),
            "operand": lambda: [-1, "in", 1.5, None, True],
            "mesh_axes": lambda: [(3,), None, ("x", "x"), ()],  # ('x' alone is a one-axis tuple)
            "dim": lambda: [-1, 1.5, "0", True],
            "to_dim": lambda: [-1, 1.5, "0", True],
            "shift": lambda: [1.5, "1", None, True],
            "reorder": lambda: [3, "x"],
        },
    ),
    "einshard.lowering.step_layout": Entry(
        lambda: {
            "lay": LAY_WHOLE,
            "step": __import__("einshard.lowering", fromlist=["Step"]).Step("dynamic-slice", 0, ("data",), dim=0),
        },
        {"lay": _layout, "step": lambda: [3, "all-gather", None]},
    ),
    "einshard.lowering.apply_step": Entry(
        lambda: {"block": np.arange(8.0), "step": _gather_step(), "invariant": True},
        {"step": lambda: [3, "all-gather", None], "invariant": lambda: [3, None, "x", NAN]},
        call=_shard_mapped((P("x"),), P(), ("block",)),
        any_value={"block": "the block in hand (checked by JAX as an array)"},
    ),
    "einshard.lowering.ring_shift": Entry(
        lambda: {"v": np.arange(8.0), "axis_name": "x", "shift": 1},
        {"axis_name": lambda: [3, None, "nope", b"x"], "shift": lambda: [1.5, "1", None, True, NAN]},
        call=_shard_mapped((P("x"),), P("x"), ("v",)),
        any_value={"v": "the block in hand (an array)"},
    ),
    "einshard.lowering.allgather_einsum": Entry(
        lambda: {
            "subscripts": "bd,df->bf",
            "x": np.ones((8, 3)),
            "y": np.ones((3, 4)),
            "axis_name": "x",
            "gathered": 0,
            "dim": 0,
        },
        {
            "subscripts": lambda: [3, b"bd,df->bf", "bd,df", None],
            "axis_name": lambda: [3, None, b"x"],
            "gathered": lambda: [2, -1, 1.5, "0", True],
            "dim": lambda: [5, -9, 1.5, "0", True],
            "schedule": _one_of("one-way", "two-way"),
            "two_way": lambda: ["yes", 2, NAN],
            "precision": _precision,
            "preferred_element_type": _dtype,
        },
        call=_shard_mapped((P("x"), P(None, "x")), P(None, "x"), ("x", "y")),
        any_value={"x": "a block (an array)", "y": "a block (an array)"},
    ),
    "einshard.lowering.einsum_reduce_scatter": Entry(
        lambda: {"subscripts": "bd,df->bf", "x": np.ones((8, 4)), "y": np.ones((4, 4)), "axis_name": "x", "dim": 0},
        {
            "subscripts": lambda: [3, b"bd,df->bf", "bd,df", None],
            "axis_name": lambda: [3, None, b"x"],
            "dim": lambda: [5, -9, 1.5, "0", True],
            "schedule": _one_of("one-way", "two-way"),
            "two_way": lambda: ["yes", 2, NAN],
            "precision": _precision,
            "preferred_element_type": _dtype,
        },
        call=_shard_mapped((P(None, "x"), P("x")), P("x"), ("x", "y")),
        any_value={"x": "a block (an array)", "y": "a block (an array)"},
    ),
    "einshard.lowering.einsum_auto": Entry(
        lambda: dict(
            zip(
                ("layouts_in", "layout_out"),
                einshard.lowering.einsum_layouts("b x@model, x@model y -> b y", [(4, 6), (6, 8)], MESH),
            ),
            mesh=MESH,
        ),
        {
            "layouts_in": _layouts_tuple,
            "layout_out": lambda: [3, "b y", LAY],
            "mesh": _mesh,
            "precision": _precision,
            "preferred_element_type": _dtype,
        },
        call=_then_call(np.ones((4, 6), np.float32), np.ones((6, 8), np.float32)),
    ),
    "einshard.lowering.einsum_shard_map": Entry(
        lambda: dict(
            zip(
                ("layouts_in", "layout_out"),
                einshard.lowering.einsum_layouts("b x, x y@model -> b y@model", [(4, 6), (6, 8)], MESH),
            ),
            mesh=MESH,
        ),
        {
            "layouts_in": _layouts_tuple,
            "layout_out": lambda: [3, "b y", LAY],
            "steps_before": lambda: [3, "all-gather", [3]],
            "steps_after": lambda: [3, "all-gather", [3]],
            "local_sums": lambda: [3, {"x": LAY}, {0: 3}],
            "mesh": _mesh,
            "mode": _one_of("sync", "async"),
            "two_way": _not_bool,
            "precision": _precision,
            "preferred_element_type": _dtype,
        },
        call=_then_call(np.ones((4, 6), np.float32), np.ones((6, 8), np.float32)),
    ),
    "einshard.lowering.gather_params": Entry(
        lambda: {"blocks": {"w": np.ones((8, 4))}, "specs": {"w": P("x")}, "axis": "x"},
        {
            "specs": lambda: [3, {"w": 3}, {"w": "x"}],
            "axis": lambda: [3, None, b"x", ("x", "x")],
            "name": lambda: [3, b"n"],
        },
        call=_shard_mapped((P("x"),), P(), ("blocks",)),
        any_value={"blocks": "the blocks in hand (arrays)"},
    ),
    "einshard.lowering.vocab_parallel_cross_entropy": Entry(
        lambda: {"logits": np.ones((2, 8)), "targets": np.zeros((2,), np.int32), "axis": "x"},
        {"axis": lambda: [3, None, b"x", ("x", "x")]},
        call=_shard_mapped((P(None, "x"), P()), P(), ("logits", "targets")),
        any_value={"logits": "a block (an array)", "targets": "token ids (an array)"},
    ),
    "einshard.lowering.vocab_parallel_embed": Entry(
        lambda: {"table": np.ones((8, 3)), "tokens": np.zeros((2,), np.int32), "axis": "x"},
        {"axis": lambda: [3, None, b"x", ("x", "x")]},
        call=_shard_mapped((P("x"), P()), P(), ("table", "tokens")),
        any_value={"table": "a block (an array)", "tokens": "token ids (an array)"},
    ),
    # ----------------------------------------------------------------- einshard.nnx
    "einshard.nnx.with_layout": Entry(
        lambda: {"initializer": jax.nn.initializers.ones, "expr": "a b -> a b@model"},
        {"initializer": _callable, "expr": _expr},
    ),
    "einshard.nnx.layout_of": Entry(lambda: {"variable": _flax_model().kernel}, {"variable": lambda: [3, "kernel"]}),
    "einshard.nnx.state_shardings": Entry(
        lambda: {"state": __import__("flax.nnx", fromlist=["state"]).state(_flax_model()), "mesh": MESH},
        {"mesh": lambda: ["data", 3, None, _duplicate_mesh()], "rules": _rules, "default": lambda: [3, b"... -> ..."]},
        any_value={"state": "an nnx.State (its leaves are checked as placement checks them)"},
    ),
    "einshard.nnx.init_function": Entry(
        lambda: {"make_model": _flax_model, "mesh": MESH},
        {
            "make_model": _callable,
            "mesh": lambda: ["data", 3, None, _duplicate_mesh()],
            "rules": _rules,
            "default": lambda: [3, b"... -> ..."],
        },
    ),
    "einshard.nnx.init_sharded": Entry(
        lambda: {"make_model": _flax_model, "mesh": MESH},
        {
            "make_model": _callable,
            "mesh": lambda: ["data", 3, None, _duplicate_mesh()],
            "rules": _rules,
            "default": lambda: [3, b"... -> ..."],
        },
    ),
    # ----------------------------------------------------------------- einshard.placement (from parsing)
    "einshard.placement.AxisItem": Record("the parser's output (parse(...).inputs[k].items)"),
    "einshard.placement.ReplicaItem": Record("the parser's output"),
    "einshard.placement.EllipsisItem": Record("the parser's output"),
    "einshard.placement.Side": Record("the parser's output"),
    "einshard.placement.Expression": Record("the parser's output (parse(text))"),
    "einshard.placement.parse": Entry(lambda: {"text": "a b -> a b"}, {"text": _expr}),
    "einshard.placement.parse_placement": Entry(lambda: {"text": "a b -> a b"}, {"text": _expr}),
    "einshard.placement.parse_einsum": Entry(lambda: {"text": "a b, b c -> a c"}, {"text": _expr}),
    "einshard.placement.format_name": Entry(lambda: {"name": "layer1"}, {"name": lambda: [3, b"a", None, ""]}),
    "einshard.placement.is_count_item": Entry(
        lambda: {"item": einshard.placement.parse("a -> a4").output.items[0]}, {"item": lambda: [3, "a4", None]}
    ),
    # ----------------------------------------------------------------- einshard.placement
    "einshard.placement.anonymous_mesh": Entry(
        lambda: {"shape": (4, 2)}, {"shape": lambda: [(0,), (-1,), (3, 5), (16,), (2.0, 4), "42", None]}
    ),
    "einshard.placement.is_anonymous": Entry(
        lambda: {"mesh": MESH}, {}, any_value={"mesh": "a predicate: anything but an anonymous mesh is False"}
    ),
    # ----------------------------------------------------------------- einshard.planner
    "einshard.planner.Alternative": Record("one of plan's alternatives"),
    "einshard.planner.Candidate": Record("a layout the planner considered"),
    "einshard.planner.Group": Record("a group of parameters the planner laid out together"),
    "einshard.planner.PipelineCost": Record("a pipeline layout the planner costed"),
    "einshard.planner.PipelineSearch": Entry(
        lambda: {"hidden": _sds(8, 8)},
        {
            "hidden": lambda: [3, "8", (8, 8), None],
            "schedules": lambda: ["gpipe", ("nope",), (), (3,)],
            "microbatches": lambda: [(0,), (-1,), (1.5,), 4, (), ("2",)],
            "repeats": _int(2),
        },
    ),
    "einshard.planner.SearchOptions": Entry(
        dict,
        {
            "exhaustive_limit": _int(0),
            "max_evaluations": _int(1),
            "restarts": _int(0),
            "pair_limit": _int(0),
            "seed": lambda: [1.5, NAN, "0", b"0", None, True],
            "n_alternatives": _int(0),
        },
    ),
    "einshard.planner.parse_bytes": Entry(
        lambda: {"budget": "1GiB"}, {"budget": _budget, "name": lambda: [3, None, b"x"]}
    ),
    # ----------------------------------------------------------------- einshard.testing
    "einshard.testing.EinsumCase": Record("what einsums() draws"),
    "einshard.testing.assert_collectives": Entry(
        lambda: {
            "fn": _test_fn,
            "args": (W, X),
            "expected": {},
            "layouts": ("a b -> a b", "b d -> b@data d"),
            "mesh": MESH,
        },
        {
            "fn": _callable,
            "expected": lambda: [3, {"all-gather": -1}, {"nope": 1}, {"all-reduce": NAN}, "all-reduce"],
            "layouts": lambda: [3, (3, 3)],
            "mesh": _mesh,
            "out_shardings": lambda: [3, "x"],
        },
        any_value={"args": "the function's own arguments"},
    ),
    "einshard.testing.assert_explained": Entry(
        lambda: {"fn": _test_fn, "args": (W, X), "layouts": ("a b -> a b", "b d -> b@data d"), "mesh": MESH},
        {"fn": _callable, "layouts": lambda: [3, (3, 3)], "mesh": _mesh, "out_shardings": lambda: [3, "x"]},
        any_value={"args": "the function's own arguments"},
    ),
    "einshard.testing.assert_fits": Entry(
        lambda: {
            "fn": _test_fn,
            "args": (W, X),
            "budget": "1GiB",
            "layouts": ("a b -> a b", "b d -> b@data d"),
            "mesh": MESH,
        },
        {"fn": _callable, "budget": _budget, "layouts": lambda: [3, (3, 3)], "mesh": _mesh},
        any_value={"args": "the function's own arguments"},
    ),
    "einshard.testing.assert_layout_invariant": Entry(
        lambda: {"fn": _test_fn, "args": (W, X), "layouts": ("a b -> a b", "b d -> b@data d"), "mesh": MESH},
        {
            "fn": _callable,
            "layouts": lambda: [3, (3, 3)],
            "mesh": _mesh,
            "rtol": _number(0),
            "atol": _number(0),
            "grad": _not_bool,
        },
        any_value={"args": "the function's own arguments"},
    ),
    "einshard.testing.place_args": Entry(
        lambda: {"args": (W, X), "layouts": ("a b -> a b", "b d -> b@data d"), "mesh": MESH},
        {"args": lambda: [3, "x"], "layouts": lambda: [3, (3, 3)], "mesh": _mesh},
    ),
    "einshard.testing.meshes": Entry(
        dict,
        {
            "devices": lambda: [3, [], "cpu"],
            "max_axes": _int(1, huge=True),
            "axis_names": lambda: ["data", ("data", "data"), (3,), ()],
            "axis_types": lambda: ["explicit", ("nope",), ()],
        },
    ),
    "einshard.testing.expressions": Entry(
        lambda: {"shape": (8, 4), "mesh": MESH},
        {"shape": _shape, "mesh": _mesh, "axes": lambda: ["data", ("nope",), (3,)]},
    ),
    "einshard.testing.layouts": Entry(
        lambda: {"tree": PARAMS, "mesh": MESH},
        {"mesh": _mesh, "rules": _rules, "sharing": lambda: [s for s in _one_of("any", "disjoint")() if s is not None]},
        any_value={"tree": "any pytree (non-array leaves get None)"},
    ),
    "einshard.testing.einsums": Entry(
        lambda: {"mesh": MESH},
        {
            "mesh": _mesh,
            "operands": _int_pair,
            "max_axes": _int(1, huge=True),
            "max_rank": _int(1, huge=True),
            "sizes": lambda: [(), (0,), (-8,), (8.5,), {"a": 0}, 8, "8"],
            "annotate_output": lambda: ["yes", 2, NAN],
            "max_per_axis": lambda: [0, -1, 1.5, "2", True],
        },
    ),
    # ----------------------------------------------------------------- einshard.placement (from tree_rules)
    "einshard.placement.compile_rules": Entry(
        lambda: {"rules": {"w": "a b -> a b"}}, {"rules": lambda: [r for r in _rules() if r != 3] + ["w", 3]}
    ),
    "einshard.placement.leaf_expressions": Entry(
        lambda: {"tree": PARAMS, "rules": {"w": "a b -> a b"}},
        {"rules": _rules},
        any_value={"tree": "any pytree", "is_leaf": "as jax.tree_util takes it", "unmatched": "any marker value"},
    ),
}
TABLE.update(SUBMODULE_TABLE)


# ----------------------------------------------------------------- logical axes, rule sets and their audit (issue 24)
SHAPES = {"w": _sds(4, 4)}
LOGICAL_RULES = [["embed", None], ["mlp", "model"]]
LOGICAL_NAMES = {"w": ["embed", "mlp"]}


def _axis_rules() -> list[Any]:
    """Bad logical-axis tables (``axis_rules=`` of every function taking a mesh, and the readers' rule lists)."""
    return [
        3,
        "batch",
        b"batch",
        {"batch": 3},
        {"": "data"},
        {b"batch": "data"},
        {"batch": b"data"},
        {"batch": ""},
        {"batch": ("data", "data")},
        {"batch": NAN},
        [("batch",)],
        [("batch", "data", "model")],
    ]


def _reader_axis_rules() -> list[Any]:
    """The readers check a table against the mesh (documented): a rule naming an axis it lacks is an error."""
    return [*_axis_rules(), [["embed", "nope"], ["mlp", "model"]], [["embed", None], ["mlp", ("model", "nope")]]]


def _in_axis_rules(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
    """``einshard.axis_rules`` is a context manager: the table is read when the block is entered."""
    with fn(**kw):
        return einshard.spec("b d -> b@batch d", (8, 4), mesh=MESH)


def _keras_map() -> dict[str, Any]:
    return {"w": (None, "model")}


def _keras_call(fn: Callable[..., Any], kw: dict[str, Any]) -> Any:
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")  # Keras reads it once, at import
    pytest.importorskip("keras")
    return _plain(fn, kw)


def _keras_model() -> Any:
    import os

    os.environ.setdefault("KERAS_BACKEND", "jax")
    keras = pytest.importorskip("keras")
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="up")])


def _nnx_model_with_names() -> Any:
    """An NNX layer whose kernel carries logical names (Flax places it: it needs the mesh and the rules)."""
    from flax import linen, nnx

    init = nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp"))
    with jax.set_mesh(MESH), linen.logical_axis_rules([("embed", None), ("mlp", "model")]):
        return nnx.Linear(4, 8, kernel_init=init, rngs=nnx.Rngs(0))


def _path_rules() -> list[Any]:
    """Bad einshard path rules where a function takes them as ``rules`` (no matching leaf is not an error)."""
    return [r for r in _rules() if r != 3] + [3, b"w"]


def _model() -> list[Any]:
    return [3, "model", None, b"m", {"w": 3}]


def _rules_path() -> list[Any]:
    return [3, None, b"rules.json", "", "/nonexistent/rules.json", "\x00"]


LOGICAL_TABLE: dict[str, Entry | Record | Constant] = {
    "einshard.axis_rules": Entry(
        lambda: {"table": {"batch": "data"}},
        {"table": _axis_rules},
        call=_in_axis_rules,
        named_as={"table": "axis_rules"},
    ),
    "einshard.audit": Entry(
        lambda: {"step": _step, "args": (SHAPES, _sds(8, 4)), "rules": {"w": "a b -> a b@model"}, "mesh": MESH},
        {
            "step": _callable,
            "rules": lambda: [3, b"w", {b"w": "a b -> a b"}, {"(": "a b -> a b"}, {"w": 3}, None],
            "mesh": _mesh,
            "budget": _budget,
            "data_rules": lambda: [3, b"x", {"(": "a b -> a b"}, ("a b -> a b", "a b -> a b")],
            "batch_axis": lambda: [3, b"data", "", ("data", "data"), "nope"],
            "profile": _profile,
            "objective": _one_of("training", "inference", "memory", "communication"),
            "axis_rules": _axis_rules,
        },
        any_value={"args": "the step's own arguments (any pytree of arrays or ShapeDtypeStructs)"},
    ),
    "einshard.analysis.AuditReport": Record("audit's answer"),
    "einshard.analysis.ExplicitReport": Record("check_explicit's answer"),
    "einshard.analysis.Finding": Record("one finding of check_explicit's answer"),
    "einshard.analysis.Fix": Record("one fix of a check_explicit finding"),
    "einshard.lowering.EinsumProgram": Record("lower's answer"),
    "einshard.analysis.RuleUse": Record("one rule of audit's answer"),
    "einshard.analysis.LayoutDifference": Record("one leaf where audit's plan differs"),
    "einshard.check_explicit": Entry(
        lambda: {
            "fn": _test_fn,
            "args": (_sds(4, 6), _sds(8, 4)),
            "mesh": {"data": 4, "model": 2},
            "in_specs": (P(None, "model"), P("data", None)),
        },
        {"fn": _callable, "mesh": _mesh, "in_specs": lambda: [3, "data", (1, 2), (b"data", None)], "profile": _profile},
        any_value={"args": "the function's own arguments", "kwargs": "the function's own keyword arguments"},
    ),
    "einshard.errors.EinshardWarning": Record("the warning category itself"),
    "einshard.interop.ImportedRules": Record("what every reader returns"),
    "einshard.interop.Leaf": Record("one leaf of ImportedRules"),
    "einshard.interop.LeafMatch": Record("one leaf's matched rule in ImportedRules"),
    "einshard.interop.LogicalLayout": Record("to_logical's answer"),
    "einshard.interop.from_keras": Entry(
        lambda: {"layout_map": _keras_map(), "params": SHAPES, "mesh": MESH},
        {
            "layout_map": lambda: [
                3,
                "w",
                None,
                {b"w": (None,)},
                {"w": 3},
                {"(": (None,)},
                {"w": (b"model",)},
                {"w": ("nope", None)},
                {"w": (None, None, None)},
                {"(" * 2000 + "w" + ")" * 2000: (None,)},
                {"w": ("model", "model")},
            ],
            "params": _tree,
            "mesh": _mesh,
        },
    ),
    "einshard.interop.to_keras": Entry(
        lambda: {"rules": {"w": "a b -> a b@model"}, "params": SHAPES, "mesh": MESH},
        {"rules": _path_rules, "params": _tree, "mesh": lambda: ["data", 3, None, {"data": 4}, _duplicate_mesh()]},
        call=_keras_call,
    ),
    "einshard.interop.keras_params": Entry(lambda: {"model": _keras_model()}, {"model": _model}),
    "einshard.interop.from_nnx": Entry(
        lambda: {"model_or_state": _nnx_model_with_names(), "axis_rules": LOGICAL_RULES, "mesh": MESH},
        {"model_or_state": _model, "axis_rules": _reader_axis_rules, "mesh": _mesh},
    ),
    "einshard.interop.nnx_names": Entry(
        lambda: {"model_or_state": _nnx_model_with_names()}, {"model_or_state": _model}
    ),
    "einshard.interop.from_logical": Entry(
        lambda: {"axis_rules": LOGICAL_RULES, "logical_axes": LOGICAL_NAMES, "params": SHAPES, "mesh": MESH},
        {
            "axis_rules": _reader_axis_rules,
            "logical_axes": lambda: [3, "w", b"w", {"w": 3}, {"w": [b"embed", "mlp"]}, {"w": ["embed"] * 3}],
            "params": _tree,
            "mesh": _mesh,
            "fmt": _one_of("maxtext", "flax", "keras", "einshard"),
        },
    ),
    "einshard.interop.from_maxtext": Entry(
        lambda: {"logical_axis_rules": LOGICAL_RULES, "logical_axes": LOGICAL_NAMES, "params": SHAPES, "mesh": MESH},
        {
            "logical_axis_rules": _reader_axis_rules,
            "logical_axes": lambda: [3, "w", b"w", {"w": 3}, {"w": [b"embed", "mlp"]}, {"w": ["embed"] * 3}],
            "params": _tree,
            "mesh": _mesh,
        },
    ),
    "einshard.interop.to_logical": Entry(
        lambda: {"rules": {"w": "a b -> a b@model"}, "params": SHAPES, "mesh": MESH},
        {"rules": _path_rules, "params": _tree, "mesh": _mesh},
    ),
    "einshard.placement.RulesFile": Record("read_rules_file's answer"),
    "einshard.placement.read_rules_file": Entry(
        lambda: {"path": _rules_file()},
        {"path": _rules_path},
        # the file's own errors (unreadable, not rules) name it by its path: "rules file '/x/rules.json': ..."
        named_as={"path": "rules file"},
    ),
    "einshard.planner.Verified": Record("one compiled candidate of plan(verify=...)"),
}
TABLE.update(LOGICAL_TABLE)

# Targets: hardware to plan for (einshard.targets).
TABLE.update(
    {
        "einshard.targets.parse_target": Entry(
            lambda: {"spec": "tpu:v5e:2x2"}, {"spec": _target}, named_as={"spec": "target"}
        ),
        "einshard.targets.libtpu_available": Entry(dict, {}),
        "einshard.targets.target_devices": Entry(
            lambda: {"target": "gpu:h100x8"}, {"target": _target}, call=_refused_gpu
        ),
        "einshard.targets.target_mesh": Entry(
            lambda: {"target": "gpu:h100x8", "sizes": {"data": 8}},
            {
                "target": _target,
                "sizes": lambda: [
                    None,
                    "data=8",
                    {"data": 0},
                    {"data": -8},
                    {"data": 8.0},
                    {b"d": 8},
                    {"data": True},
                    {"data": 3},
                ],
            },
            call=_refused_gpu,
        ),
        "einshard.targets.on_target": Entry(
            lambda: {"target": "tpu:v5e:2x2", "mesh": None, "profile": None, "what": "explain()"},
            {"target": _target, "mesh": lambda: ["data=4", 3, {"data": 0}, {"data": 3}, {"data": 4.5}, {b"d": 4}]},
            any_value={"profile": "given back as it is (checked where it is used)", "what": "a label for messages"},
        ),
        "einshard.targets.Chip": Record("a row of the chip registry"),
        "einshard.targets.Target": Record("parse_target's answer"),
    }
)

# Multi-process agreement settings (einshard.multihost).
TABLE.update(
    {
        "einshard.multihost.set_peer_timeout": Entry(lambda: {"seconds": 60.0}, {"seconds": _number(0, positive=True)}),
        "einshard.multihost.peer_timeout": Entry(dict, {}),
        "einshard.multihost.unchecked": Entry(dict, {}),
    }
)


def _rules_file() -> str:
    import tempfile

    path = pathlib.Path(tempfile.gettempdir()) / "einshard-fuzz-rules.json"
    path.write_text('{"params": {"w": "a b -> a b@model"}}')
    return str(path)


# einshard.checkpoint is issue 25's checkpoint part (another change): its arguments are that work's to check.
OWNED_ELSEWHERE = {"einshard.checkpoint"}


def _public_callables() -> dict[str, Any]:
    """Every callable in ``einshard.__all__`` and in the ``__all__`` of each public submodule."""
    found: dict[str, Any] = {}
    modules = ["einshard"]
    for info in pkgutil.iter_modules(einshard.__path__):
        if not info.name.startswith("_") and f"einshard.{info.name}" not in OWNED_ELSEWHERE:
            modules.append(f"einshard.{info.name}")
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError:  # an optional extra (flax for einshard.nnx) not installed
            continue
        for attr in getattr(module, "__all__", ()):
            obj = getattr(module, attr)
            if inspect.ismodule(obj):
                continue
            found[f"{name}.{attr}"] = obj
    return found


PUBLIC = _public_callables()


def _entry(qualname: str) -> Entry | Record | Constant | None:
    """The table's entry for a public name; a re-export (``einshard.placement.einshard``) shares its home's."""
    if qualname in TABLE:
        return TABLE[qualname]
    obj = PUBLIC[qualname]
    for other, entry in TABLE.items():
        if other in PUBLIC and PUBLIC[other] is obj:
            return entry
    return None


# Every function taking a mesh takes axis_rules= (a logical-axis table for the call): one kind for all of them.
for _qualname, _obj in PUBLIC.items():
    _e = _entry(_qualname)
    if isinstance(_e, Entry) and "axis_rules" in inspect.signature(_obj).parameters:
        _e.kinds.setdefault("axis_rules", _axis_rules)


def _cases() -> list[tuple[str, str, int]]:
    out = []
    for qualname in sorted(PUBLIC):
        entry = _entry(qualname)
        if not isinstance(entry, Entry) or PUBLIC[qualname] is not _home(qualname):
            continue
        for param, kind in entry.kinds.items():
            for k in range(len(kind())):
                out.append((qualname, param, k))
    return out


def _home(qualname: str) -> Any:
    """The object, counted once: a re-export under another module is the same case."""
    obj = PUBLIC[qualname]
    first = next(q for q in sorted(PUBLIC, key=lambda q: (q.count("."), q)) if PUBLIC[q] is obj)
    return obj if first == qualname else None


def test_every_public_callable_has_an_entry() -> None:
    missing = []
    for qualname, obj in sorted(PUBLIC.items()):
        entry = _entry(qualname)
        if entry is None:
            if callable(obj):
                missing.append(f"{qualname}{_signature(obj)}")
            continue
        if isinstance(entry, Entry):
            params = _parameters(obj)
            uncovered = [p for p in params if p not in entry.kinds and p not in entry.any_value]
            if uncovered:
                missing.append(f"{qualname}: parameters {uncovered} have no kind in the table")
    assert not missing, (
        "public callables or parameters without an entry in tests/test_argument_fuzz.py TABLE "
        "(add the valid call and each parameter's kind; see the module docstring):\n  " + "\n  ".join(missing)
    )


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def _parameters(obj: Any) -> list[str]:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    return [n for n, p in sig.parameters.items() if p.kind not in (p.VAR_KEYWORD,) and not n.startswith("_")]


def _run(qualname: str, kw: dict[str, Any]) -> Any:
    entry = _entry(qualname)
    assert isinstance(entry, Entry)
    fn = PUBLIC[qualname]
    with contextlib.redirect_stdout(io.StringIO()):
        return (entry.call or _plain)(fn, kw)


def _check_case(qualname: str, param: str, k: int) -> None:
    entry = _entry(qualname)
    assert isinstance(entry, Entry)
    bad = entry.kinds[param]()[k]
    kw = entry.base()
    kw[param] = bad
    try:
        _run(qualname, kw)
    except EinshardError as err:
        info = err
    except Exception as err:  # noqa: BLE001 - the failure names what was raised instead
        raise AssertionError(f"{qualname}({param}={bad!r:.60}) raised {type(err).__name__}: {str(err)[:300]}") from err
    else:
        raise AssertionError(f"{qualname}({param}={bad!r:.60}) was accepted")
    # An expression's own errors quote it with a caret under the column, or say "an einshard expression is ...":
    # either names the argument when the argument is the expression.
    quoted = isinstance(bad, str) and info.expression == bad
    is_expression = entry.kinds[param] is _expr and "expression" in str(info)
    named = entry.named_as.get(param, param)
    assert named in str(info) or quoted or is_expression, (
        f"{qualname}({param}={bad!r:.60}) raised an EinshardError that does not name {param!r}: {str(info)[:300]}"
    )


ALL_CASES = _cases()
_SAMPLE = sorted(random.Random(25).sample(ALL_CASES, min(len(ALL_CASES), 120)))


@pytest.mark.parametrize(("qualname", "param", "k"), _SAMPLE)
def test_a_bad_argument_is_an_einshard_error_naming_it(qualname: str, param: str, k: int) -> None:
    _check_case(qualname, param, k)


@pytest.mark.slow
@pytest.mark.parametrize(("qualname", "param", "k"), ALL_CASES)
def test_every_bad_argument_is_an_einshard_error_naming_it(qualname: str, param: str, k: int) -> None:
    _check_case(qualname, param, k)


@pytest.mark.parametrize("qualname", sorted(q for q in PUBLIC if isinstance(_entry(q), Entry) and _home(q) is not None))
def test_the_valid_call_is_valid(qualname: str) -> None:
    """The table's base call works: a bad value's error is then about that value alone."""
    entry = _entry(qualname)
    assert isinstance(entry, Entry)
    _run(qualname, entry.base())


# ---------------------------------------------------------------------------
# The command line: every value option of every command, enumerated from its argparse parser.

CLI_BASE: dict[str, list[str]] = {
    "analyze": ["analyze", "b x@data, x y -> b? y?", "--mesh", "data=4", "--sizes", "b=8,x=4,y=6"],
    "show": ["show", "b d -> b@data d", "--shape", "8,4", "--mesh", "data=4"],
    "plan": ["plan", "--width", "8", "--batch", "16"],
    # (the demo trains: its bad values must be refused before any training, so no valid run is needed here)
    "demo": ["demo", "--steps", "0", "--layout", "dp"],
    "audit": ["audit", "--rules", _rules_file(), "--width", "8", "--batch", "16"],
    "check-explicit": ["check-explicit", "--layout", "dp", "--mesh", "data=4,model=2", "--batch", "8", "--exit-zero"],
}

_BAD_SIZE_LISTS = ["data=0", "data=-2", "data", "=4", "data=nan", "data=4,data=2", "data=" + "9" * 5000, "data=²"]
_BAD_POSITIVE = ["0", "-1", "1.5", "nan", "", "9" * 5000]
_BAD_NON_NEGATIVE = ["-1", "1.5", "nan", "", "9" * 5000]

CLI_TABLE: dict[str, dict[str, list[str] | str]] = {
    "analyze": {
        "--mesh": _BAD_SIZE_LISTS,
        "--sizes": ["b,x=4,y=6", "b=8,b=4,x=4,y=6", "b=nan,x=4,y=6", "b=" + "9" * 5000 + ",x=4,y=6"],
        "--dtype": ["bogus", "U3", "", "object"],
        "--profile": ["h999", ""],
        "--alternatives": _BAD_NON_NEGATIVE,
    },
    "show": {
        "--shape": ["8,-4", "8,4.5", "", "8,nan", "8," + "9" * 5000, "8,²"],
        "--mesh": _BAD_SIZE_LISTS,
        "--dims": ["z", "9", "b,b"],
        "--dtype": ["bogus", "U3", "object"],
        "--devices": [*_BAD_POSITIVE, "100000"],
    },
    "plan": {
        "--model": ["gpt", ""],
        "--mesh": _BAD_SIZE_LISTS,
        "--budget": ["nan", "inf", "-1", "0", "lots", "1.2.3GB"],
        "--profile": ["h999", ""],
        "--objective": ["speed", ""],
        "--batch": _BAD_POSITIVE,
        "--width": _BAD_POSITIVE,
        "--rules-out": "any path: written after planning (an unwritable one is the OS's error, reported as such)",
        "--verify": ["-1", "1.5", "nan", "x", "9" * 5000],
        "--target": ["tpu", "tpu:v9:2x2", "tpu:v5p:2x2", "gpu:h100x0", "", "tpu:v5e:" + "9" * 5000],
        "--layers": _BAD_POSITIVE,
        "--seq": _BAD_POSITIVE,
    },
    "audit": {
        "--rules": ["/nonexistent/rules.json", "", "/"],
        "--model": ["gpt", ""],
        "--mesh": _BAD_SIZE_LISTS,
        "--budget": ["nan", "inf", "-1", "0", "lots", "1.2.3GB"],
        "--profile": ["h999", ""],
        "--batch": _BAD_POSITIVE,
        "--width": _BAD_POSITIVE,
    },
    "check-explicit": {
        "--function": ["/nonexistent/step.py:make", "no_such_module_xyz:make", "", "step.py"],
        "--layout": ["bogus", ""],
        "--rules": ["/nonexistent/rules.json", "", "/"],
        "--mesh": _BAD_SIZE_LISTS,
        "--batch": _BAD_POSITIVE,
        "--profile": ["h999", ""],
    },
    "demo": {
        "--layout": ["bogus", ""],
        "--rules": "a file, read and checked by the demo's preflight (tests/test_cli_dead_ends.py)",
        "--mesh": _BAD_SIZE_LISTS,
        "--devices": _BAD_POSITIVE,
        "--processes": _BAD_POSITIVE,
        "--data": "a text file, read and checked by the demo's preflight (tests/test_cli_dead_ends.py)",
        "--steps": _BAD_NON_NEGATIVE,
        "--batch": _BAD_POSITIVE,
        "--seq": _BAD_POSITIVE,
        "--layers": _BAD_POSITIVE,
        "--width": _BAD_POSITIVE,
        "--heads": _BAD_POSITIVE,
        "--ffn": _BAD_POSITIVE,
        "--lr": ["nan", "inf", "-1", "0", "x"],
        "--seed": ["1.5", "x", ""],
        "--ring": ["both", ""],
        "--microbatches": _BAD_POSITIVE,
        "--schedule": ["zigzag", ""],
        "--checkpoint": "a directory, written at the end (tests/test_checkpoint.py)",
        "--resume": "a checkpoint directory, read and checked by the demo (tests/test_checkpoint.py)",
        "--plot": "a path, written at the end",
        "--process-id": "internal: set by --processes for its workers",
        "--coordinator": "internal: set by --processes for its workers",
    },
}


def _cli_options(command: str) -> list[str]:
    """The value options (not flags) of one command, from its argparse parser."""
    import argparse

    from einshard_apps import arguments

    parser = argparse.ArgumentParser()
    getattr(arguments, command.replace("-", "_"))(parser)
    return [
        a.option_strings[-1]
        for a in parser._actions
        if a.option_strings
        and a.nargs != 0
        and not isinstance(a, argparse._HelpAction)
        and not isinstance(a, argparse.BooleanOptionalAction)
    ]


def test_every_cli_option_has_an_entry() -> None:
    from einshard_apps.cli import COMMANDS

    missing = [f"{c} {o}" for c in COMMANDS for o in _cli_options(c) if o not in CLI_TABLE.get(c, {})]
    assert not missing, "command-line options without bad values in CLI_TABLE: " + ", ".join(missing)


def _cli_cases() -> list[tuple[str, str, str]]:
    return [
        (command, option, value)
        for command, options in CLI_TABLE.items()
        for option, values in options.items()
        if not isinstance(values, str)
        for value in values
    ]


def _run_cli(argv: list[str]) -> tuple[int, str]:
    from einshard_apps import cli

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except SystemExit as exit_:  # argparse's own errors exit 2
            code = int(exit_.code or 0)
    return code, err.getvalue()


def _with_option(base: list[str], option: str, value: str) -> list[str]:
    argv = list(base)
    if option in argv:  # replace the base's own value (a value option may be given once)
        argv[argv.index(option) + 1] = value
    else:
        argv += [option, value]
    return argv


CLI_CASES = _cli_cases()


@pytest.mark.parametrize(("command", "option", "value"), CLI_CASES)
def test_a_bad_cli_value_is_an_error_naming_the_option(command: str, option: str, value: str) -> None:
    code, err = _run_cli(_with_option(CLI_BASE[command], option, value))
    assert code == 2, f"einshard {command} {option} {value[:40]!r}: exit {code}\n{err[-800:]}"
    assert option in err or option.lstrip("-") in err, f"{option} not named:\n{err[-800:]}"


@pytest.mark.parametrize("command", [c for c in CLI_BASE if c != "demo"])
def test_the_cli_base_lines_run(command: str) -> None:
    code, err = _run_cli(CLI_BASE[command])
    assert code == 0, err[-2000:]
