"""Checks for users' sharded code: same values under every layout, the collectives expected, memory under budget.

None of these needs hypothesis: they take concrete layouts (from
:func:`einshard.testing.layouts` under ``@given``, or written by hand).

Example:
    >>> import jax, jax.numpy as jnp, numpy as np, einshard.testing as et
    >>> mesh = jax.make_mesh((4, 2), ('data', 'model'))
    >>> w, x = np.ones((16, 8), np.float32), np.ones((4, 16), np.float32)
    >>> et.assert_layout_invariant(lambda w, x: jnp.sum(x @ w), w, x, mesh=mesh,
    ...                            layouts=('a b -> a b@model', 'a b -> a@data b'), grad=True)
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from .. import _checks
from ..core.mesh import current_concrete_mesh
from ..errors import EinshardError
from ..placement import einshard as place
from ..planner import parse_bytes
from . import hlo

__all__ = ["assert_layout_invariant", "assert_collectives", "assert_explained", "assert_fits", "place_args"]

Layouts = Any  # a pytree prefix of the arguments with expressions / None, or rules mappings, per argument


# ---------------------------------------------------------------------------
# Placing arguments


def _is_layout_leaf(x: Any) -> bool:
    return x is None or isinstance(x, str)


def _place_arg(arg: Any, entry: Any, mesh: Mesh | None, where: str) -> tuple[Any, list[tuple[str, str]]]:
    """(arg laid out as ``entry`` says, [(leaf path, expression)] of the leaves placed)."""
    if entry is None:
        return arg, []
    if isinstance(entry, str):
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(arg)[0]]
        return place(arg, entry, mesh=mesh), [(where + p, entry) for p in paths]
    treedef: Any = jax.tree_util.tree_structure(entry, is_leaf=_is_layout_leaf)
    try:
        subtrees = treedef.flatten_up_to(arg)
    except (ValueError, TypeError) as err:
        if isinstance(entry, Mapping):  # not the argument's structure: path-pattern rules, as einshard takes
            return place(arg, entry, mesh=mesh), [(where, f"rules {dict(entry)}")]
        raise EinshardError(
            f"layouts for {where or 'the arguments'} do not match the argument's structure: {err}"
        ) from None
    exprs = jax.tree_util.tree_flatten_with_path(entry, is_leaf=_is_layout_leaf)[0]
    out, used = [], []
    for (path, expr), sub in zip(exprs, subtrees):
        placed, names = _place_arg(sub, expr, mesh, where + jax.tree_util.keystr(path))
        out.append(placed)
        used += names
    return jax.tree_util.tree_unflatten(treedef, out), used


def place_args(args: tuple[Any, ...], layouts: Layouts, mesh: Mesh | None = None) -> tuple[tuple[Any, ...], list]:
    """Lay ``args`` out: ``layouts`` has one entry per argument (or one for a single argument).

    An entry is an expression (every leaf of that argument), None (left as
    is), a pytree of expressions shaped like the argument (what
    :func:`einshard.testing.layouts` draws), or path-pattern rules as
    ``einshard.einshard`` takes.  Returns (placed args, [(leaf path, expression)]).
    """
    mesh = mesh if mesh is not None else current_concrete_mesh()
    if isinstance(layouts, str) or layouts is None:
        entries: Sequence[Any] = [layouts] * len(args)
    elif isinstance(layouts, (tuple, list)) and len(layouts) == len(args) and len(args) != 1:
        entries = layouts
    elif len(args) == 1:
        entries = [layouts[0] if isinstance(layouts, (tuple, list)) and len(layouts) == 1 else layouts]
    else:
        raise EinshardError(
            f"layouts= takes one entry per argument ({len(args)} arguments), got {type(layouts).__name__} "
            f"of {len(layouts) if isinstance(layouts, (tuple, list)) else 1}"
        )
    placed, used = [], []
    for i, (arg, entry) in enumerate(zip(args, entries)):
        p, names = _place_arg(arg, entry, mesh, f"args[{i}]")
        placed.append(p)
        used += names
    return tuple(placed), used


# ---------------------------------------------------------------------------
# Running a function on arrays and non-array leaves alike


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


# fn -> {(treedef, static leaves): jitted runner}; weak so users' functions are not kept alive.
_RUNNERS: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _runner(fn: Callable[..., Any], args: tuple[Any, ...], grad: bool) -> tuple[Callable[..., Any], list[Any]]:
    """A jitted ``leaves -> (fn(*args), grad of arg 0)`` taking the array leaves; non-arrays are static.

    Users' models hold functions and ints next to arrays (an Equinox module's
    activation): they become compile-time constants, as ``equinox.filter_jit`` does.
    One runner per (fn, structure, static leaves), so each layout reuses the jit cache.
    """
    leaves, treedef = jax.tree_util.tree_flatten(args)
    is_arr = tuple(_is_array(x) for x in leaves)
    static = tuple(None if a else x for a, x in zip(is_arr, leaves))
    n0 = len(jax.tree_util.tree_leaves(args[0])) if args else 0
    diff = tuple(
        i < n0 and a and jax.numpy.issubdtype(leaves[i].dtype, jax.numpy.inexact) for i, a in enumerate(is_arr)
    )
    key: tuple[Any, ...] = (treedef, is_arr, grad, diff, static)
    try:
        hash(key)
        cache = _RUNNERS.setdefault(fn, {})
    except TypeError:  # unhashable static leaves or an unweakrefable fn: no cache
        cache = {}
    if key in cache:
        return cache[key], [x for x, a in zip(leaves, is_arr) if a]

    def rebuild(dyn: Sequence[Any]) -> tuple[Any, ...]:
        it = iter(dyn)
        return tuple(jax.tree_util.tree_unflatten(treedef, [next(it) if a else s for a, s in zip(is_arr, static)]))

    def run(*dyn: Any) -> Any:
        out = fn(*rebuild(dyn))
        if not grad:
            return out, None
        idx = [i for i, d in enumerate(diff) if d]
        pos = {i: k for k, i in enumerate(j for j, a in enumerate(is_arr) if a)}

        def scalar(d: Any) -> Any:
            full = list(dyn)
            for i, v in zip(idx, d):
                full[pos[i]] = v
            return fn(*rebuild(full))

        return out, jax.grad(scalar)([dyn[pos[i]] for i in idx])

    runner = jax.jit(run)
    try:
        cache[key] = runner
    except TypeError:
        pass
    return runner, [x for x, a in zip(leaves, is_arr) if a]


def _host(x: Any) -> Any:
    return np.asarray(x) if isinstance(x, jax.Array) else x


# ---------------------------------------------------------------------------
# assert_layout_invariant


def assert_layout_invariant(
    fn: Callable[..., Any],
    *args: Any,
    layouts: Layouts,
    mesh: Mesh | None = None,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    grad: bool = False,
) -> None:
    """Assert that ``fn(*args)`` (jitted) gives the same values with ``args`` laid out by ``layouts`` as unsharded.

    Args:
        fn: the function under test: arrays or pytrees (Equinox / Flax modules, dicts) in, a pytree of arrays out.
        args: its arguments; non-array leaves are compile-time constants.
        layouts: one entry per argument (see :func:`place_args`): expressions, pytrees of
            expressions (what :func:`einshard.testing.layouts` draws), rules, or None.
        mesh: the mesh for ``@`` expressions (default: the current mesh).
        rtol, atol: tolerances, as ``numpy.testing.assert_allclose``'s.
        grad: also compare ``jax.grad(fn)`` with respect to the first argument's floating leaves
            (``fn`` must then return a scalar).

    Raises:
        AssertionError: naming the output (or gradient) leaf that differs, the largest error, and the
            expression of every argument leaf that was sharded.
    """
    reference_args = jax.tree_util.tree_map(_host, args)
    placed, used = place_args(args, layouts, mesh)
    where = "\n".join(f"  {p}: {e!r}" for p, e in used if _sharded(e))
    layout_note = f"with the arguments laid out as\n{where}" if where else "with every argument replicated"
    run, ref_leaves = _runner(fn, reference_args, grad)
    with _mesh_context(mesh):  # the unsharded run sees the mesh too: fn may shard_map over its axes
        want = run(*ref_leaves)
        run, leaves = _runner(fn, placed, grad)
        try:
            got = run(*leaves)
        except Exception as err:
            if type(err).__name__ == "ShardingTypeError":
                _reject_in_hypothesis(f"JAX's sharding types reject fn {layout_note}: {err}")
            raise AssertionError(  # a ShardingTypeError outside hypothesis, or any other error: the finding
                f"fn raised {type(err).__name__} sharded (not unsharded) {layout_note}\n{err}"
            ) from err
    _compare("fn(*args)", got[0], want[0], rtol, atol, layout_note)
    if grad:
        _compare("grad(fn)(args[0])", got[1], want[1], rtol, atol, layout_note)


def _reject_in_hypothesis(why: str) -> None:
    """Under a hypothesis test, a layout JAX itself refuses to trace (a ShardingTypeError on Explicit axes: an
    ambiguous contraction, two operands split over one mesh axis) is not a finding about ``fn`` but an example
    that does not apply: reject it (``hypothesis.reject``), as ``assume`` would, and let hypothesis draw
    another.  Outside hypothesis (or without it) the caller raises."""
    try:
        from hypothesis import note, reject
        from hypothesis.control import currently_in_test_context
    except ImportError:  # pragma: no cover - without hypothesis there is no example to reject
        return
    if currently_in_test_context():
        note(why)
        reject()


def _sharded(expr: str) -> bool:
    """Whether a leaf's expression splits it (the right side says more than the left)."""
    left, _, right = expr.partition("->")
    return left.split() != right.split()


def _mesh_context(mesh: Mesh | None) -> Any:
    import contextlib

    return jax.set_mesh(mesh) if mesh is not None and current_concrete_mesh() is None else contextlib.nullcontext()


def _compare(what: str, got: Any, want: Any, rtol: float, atol: float, layout_note: str) -> None:
    got_leaves = jax.tree_util.tree_flatten_with_path(got)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    if len(got_leaves) != len(want_leaves):
        raise AssertionError(f"{what} returned {len(got_leaves)} leaves sharded, {len(want_leaves)} unsharded")
    for (path, g), (_, w) in zip(got_leaves, want_leaves):
        g64, w64 = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g64.shape != w64.shape:
            raise AssertionError(
                f"{what}{jax.tree_util.keystr(path)} has shape {g64.shape} sharded, {w64.shape} unsharded, "
                f"{layout_note}"
            )
        bad = ~np.isclose(g64, w64, rtol=rtol, atol=atol, equal_nan=True)
        if bad.any():
            err = np.abs(g64 - w64)
            i = np.unravel_index(int(np.argmax(np.where(bad, err, -1))), g64.shape) if g64.ndim else ()
            raise AssertionError(
                f"{what}{jax.tree_util.keystr(path)} differs from the unsharded run at {int(bad.sum())} of "
                f"{max(bad.size, 1)} elements (at index {tuple(int(k) for k in i)}: sharded {g64[i]!r}, "
                f"unsharded {w64[i]!r}; rtol={rtol}, atol={atol}) {layout_note}"
            )


# ---------------------------------------------------------------------------
# Collectives: compiled HLO against an expectation / against einshard.explain


def _compiled(fn: Callable[..., Any], args: tuple[Any, ...], mesh: Mesh | None, out_shardings: Any) -> Any:
    kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
    with _mesh_context(mesh):
        return jax.jit(fn, **kwargs).lower(*args).compile()


def _kind_counts(expected: Mapping[str, int] | Sequence[str]) -> Counter[str]:
    if isinstance(expected, str):
        raise EinshardError(f"expected= takes kinds and counts like {{'all-reduce': 1}} or a list, got {expected!r}")
    counts = Counter(expected) if not isinstance(expected, Mapping) else Counter(dict(expected))
    bad = [k for k in counts if k not in hlo.KINDS]
    if bad:
        raise EinshardError(f"expected= names {bad}: the collective kinds are {list(hlo.KINDS)}")
    return +counts


def _diff_message(what: str, want: Counter[str], got: list[hlo.HloCollective], other: str) -> str | None:
    have = Counter(c.kind for c in got)
    if have == want:
        return None
    lines = [f"{what}: {other} {dict(sorted(want.items()))}, XLA compiled {dict(sorted(have.items()))}"]
    for kind in sorted(set(want) | set(have)):
        if have[kind] > want[kind]:
            extra = [c for c in got if c.kind == kind]
            lines.append(f"  {have[kind] - want[kind]} more {kind} than {other}, e.g. {extra[-1].line}")
        elif have[kind] < want[kind]:
            lines.append(f"  {want[kind] - have[kind]} {kind} {other} but not compiled")
    return "\n".join(lines)


def assert_collectives(
    fn: Callable[..., Any],
    *args: Any,
    expected: Mapping[str, int] | Sequence[str],
    layouts: Layouts = None,
    mesh: Mesh | None = None,
    out_shardings: Any = None,
) -> list[hlo.HloCollective]:
    """Assert that the compiled ``fn(*args)`` has exactly the ``expected`` collectives, by kind and count.

    ``expected`` is a mapping like ``{'all-reduce': 1}`` or a list of kinds. The HLO is read by
    :func:`einshard.testing.hlo.normalized`: async pairs once, combined tuples once per piece,
    CPU's all-reduce + dynamic-slice as a reduce-scatter, groups of one device dropped.
    ``args`` may be placed arrays or ``jax.ShapeDtypeStruct``s with shardings, or laid out by ``layouts=``.

    Returns the compiled collectives; raises AssertionError naming the op kinds that differ.
    """
    placed = place_args(args, layouts, mesh)[0] if layouts is not None else args
    found = hlo.normalized(_compiled(fn, placed, mesh, out_shardings).as_text())
    msg = _diff_message("collectives", _kind_counts(expected), found, "expected")
    if msg:
        raise AssertionError(msg)
    return found


def _predicted(report: Any) -> Counter[str]:
    counts: Counter[str] = Counter()
    for op in report.ops:
        for c in op.collectives:
            if c.group_size > 1:
                counts[c.kind] += op.repeat
    return counts


def assert_explained(
    fn: Callable[..., Any],
    *args: Any,
    layouts: Layouts = None,
    mesh: Mesh | None = None,
    out_shardings: Any = None,
) -> Any:
    """Assert that ``einshard.explain``'s predicted collectives are those XLA compiled (kinds and counts).

    On CPU, XLA writes a reduce-scatter as an all-reduce whose result is
    dynamic-sliced (and may fuse the slice away), so there all-reduces and
    reduce-scatters are compared by their total number.

    Returns explain's report; raises AssertionError naming the op kinds that differ, with explain's ops.
    """
    from ..analysis import explain

    placed = place_args(args, layouts, mesh)[0] if layouts is not None else args
    with _mesh_context(_mesh_of(placed, mesh)):  # fn may name mesh axes (out_sharding=P(...), shard_map)
        report = explain(fn, *placed, mesh=_mesh_of(placed, mesh))
    predicted = _predicted(report)
    found = hlo.normalized(_compiled(fn, placed, mesh, out_shardings).as_text())
    if jax.default_backend() == "cpu":
        found = _cpu_reductions_as_predicted(found, predicted)
    msg = _diff_message("collectives", +predicted, found, "einshard.explain predicted")
    if msg:
        ops = [f"  #{op.index} {op.expression}: {[c.kind for c in op.collectives]}" for op in report.ops]
        raise AssertionError(msg + "\nexplain's ops:\n" + "\n".join(ops or ["  (none)"]))
    return report


def _cpu_reductions_as_predicted(found: list[hlo.HloCollective], predicted: Counter[str]) -> list[hlo.HloCollective]:
    """CPU's reductions relabelled as explain's, when there are as many of them as predicted.

    XLA's CPU backend has no reduce-scatter: it emits an all-reduce whose
    result is dynamic-sliced, and the slice may be fused away from it.  So on
    CPU an all-reduce and a reduce-scatter are the same HLO, and only their
    number can be checked; the kinds are then read as explain's.
    """
    reductions = [i for i, c in enumerate(found) if c.kind in ("all-reduce", "reduce-scatter")]
    if len(reductions) != predicted["all-reduce"] + predicted["reduce-scatter"]:
        return found
    out = list(found)
    for n, i in enumerate(reductions):
        kind = "reduce-scatter" if n < predicted["reduce-scatter"] else "all-reduce"
        out[i] = dataclasses.replace(found[i], kind=kind)
    return out


def _mesh_of(args: tuple[Any, ...], mesh: Mesh | None) -> Mesh | None:
    if mesh is not None:
        return mesh
    for leaf in jax.tree_util.tree_leaves(args):
        own = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if own is not None and not getattr(own, "empty", False) and own.size > 1:
            return own
    return current_concrete_mesh()


# ---------------------------------------------------------------------------
# Memory


def assert_fits(
    fn: Callable[..., Any],
    *args: Any,
    budget: int | float | str,
    layouts: Layouts = None,
    mesh: Mesh | None = None,
) -> int:
    """Assert that XLA's ``compiled.memory_analysis()`` of ``fn(*args)`` fits ``budget`` bytes per device.

    The footprint is arguments + outputs + temporaries - aliased bytes (donated buffers counted once).
    ``budget`` is bytes or a string like ``'16GiB'``, ``'512MB'`` (as ``einshard.plan`` takes).
    Returns the footprint in bytes.
    """
    limit = parse_bytes(budget, "budget")
    if limit is None:
        raise EinshardError("assert_fits() needs budget=: bytes, or a string like '16GiB'")
    placed = place_args(args, layouts, mesh)[0] if layouts is not None else args
    mem = _compiled(fn, placed, mesh, None).memory_analysis()
    if mem is None:
        raise EinshardError(f"XLA gives no memory analysis on this backend ({jax.default_backend()})")
    parts = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "temporaries": int(mem.temp_size_in_bytes),
        "aliased": -int(mem.alias_size_in_bytes),
    }
    total = sum(parts.values())
    if total > limit:
        shown = ", ".join(f"{k} {v:,}" for k, v in parts.items())
        raise AssertionError(f"fn needs {total:,} bytes per device ({shown}), over the budget of {limit:,} bytes")
    return total


# The public names check their arguments by name (einshard._checks.RULES) before tracing anything.
def _expected_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from ..core.collectives import KINDS

    pairs: list[tuple[Any, Any]]
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(k, str) for k in value):
        return _checks.fail(where, name, "{kind: count} or a sequence of collective kinds", value)
    else:
        pairs = [(k, 1) for k in value]
    for kind, count in pairs:
        if kind not in KINDS:
            raise EinshardError(
                f"{where}: {name}= names {kind!r}, not one of the collective kinds ({', '.join(KINDS)})"
            )
        _checks.check_int(count, where, name, minimum=0)
    return value


assert_collectives = _checks.checked(assert_collectives, "einshard.testing.assert_collectives", expected=_expected_rule)
assert_explained = _checks.checked(assert_explained, "einshard.testing.assert_explained")
assert_fits = _checks.checked(assert_fits, "einshard.testing.assert_fits")
assert_layout_invariant = _checks.checked(assert_layout_invariant, "einshard.testing.assert_layout_invariant")
place_args = _checks.checked(
    place_args,
    "einshard.testing.place_args",
    args=lambda v, where, name, a: v if isinstance(v, tuple) else _checks.fail(where, name, "a tuple of arguments", v),
)
