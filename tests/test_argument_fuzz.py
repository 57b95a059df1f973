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
from einshard.core.layout import Layout, MeshAxis
from einshard.errors import EinshardError

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
        {"fn": _callable, "mesh": _mesh, "in_specs": lambda: [3, "data"], "profile": _profile},
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
            "exhaustive_limit": _int(0),
            "max_evaluations": _int(1),
            "restarts": _int(0),
            "pair_limit": _int(0),
            "seed": lambda: [1.5, NAN, "0", b"0", None, True],
            "presets": lambda: [3, "dp", {3: ("a", "b")}],
            "n_alternatives": _int(0),
            "pipeline": lambda: [3, "gpipe", {"hidden": 8}],
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


def _public_callables() -> dict[str, Any]:
    """Every callable in ``einshard.__all__`` and in the ``__all__`` of each public submodule."""
    found: dict[str, Any] = {}
    modules = ["einshard"]
    for info in pkgutil.iter_modules(einshard.__path__):
        if not info.name.startswith("_"):
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
    # An expression's own errors quote it with a caret under the column: that names the argument.
    quoted = isinstance(bad, str) and info.expression == bad
    assert param in str(info) or quoted, (
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
