"""``einshard.analyze``: from an annotated einsum to a :class:`Plan`.

Example:
    >>> import einshard
    >>> plan = einshard.analyze("b@data x, x y@model -> b? y?", mesh={"data": 4, "model": 2},
    ...                         sizes={"b": 1024, "x": 4096, "y": 16384}, dtype="bf16", profile="h100")
    >>> plan.strategy, plan.collectives, tuple(plan.out_spec)
    ('hybrid DP×TP', (), ('data', 'model'))
    >>> plan = einshard.analyze("b x@model, x@model y -> b? y?", mesh={"model": 4}, sizes={"b": 64, "x": 128, "y": 256})
    >>> [(c.kind, c.axes, c.bytes) for c in plan.collectives]          # row-parallel TP: sum the partial products
    [('all-reduce', ('model',), 98304)]
    >>> [(str(a.out_layout), [c.kind for c in a.collectives]) for a in plan.alternatives[:3]]
    [('[b:64 y:256 {U:model}]', []), ('[b:64@model y:256]', ['reduce-scatter']), ('[b:64 y:256@model]', ['reduce-scatter'])]
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from ..core.layout import Layout, MeshAxis
from ..errors import EinshardError
from ..parsing import parse_einsum
from .cost import Profile, get_profile
from .inputs import (
    _check_rank,
    _einsum_text,
    _expand_ellipsis,
    _layout_of,
    _mesh_axes,
    _spec_dims,
    dtype_info,
    spec_partitions,
)
from .plan import Plan, explain_choice, side_string
from .rule import Problem, classify, enumerate_candidates, rank
from .strategy import pick_weight, roles, strategy_name, tutorial_view

__all__ = ["analyze", "analyze_layouts", "dtype_info", "plan_einsum", "spec_partitions"]


def analyze(
    expr: str,
    *operands: Any,
    mesh: Any = None,
    sizes: dict[str, int] | None = None,
    dtype: Any = None,
    profile: Profile | str | None = None,
    in_specs: tuple[Any, ...] | None = None,
    out_spec: Any = None,
) -> Plan:
    """Analyse one einsum on a mesh: the strategy, its collectives and cost, and the alternatives.

    Args:
        expr: an einshard einsum, its operands' axes optionally annotated with
            mesh axes (``'b x@data, x y@model -> b y'``), or a ``jnp.einsum``
            string (``'bx,xy->by'``) with layouts from ``in_specs`` or the
            operands' shardings.  The output side is the layout to deliver:
            ``-> b y@model`` (bare names are whole, as in a placement;
            ``{U:model}`` for pending sums); ``-> b? y?`` lets the analyzer
            choose (as does a ``jnp.einsum`` string).  A bare output where the
            analyzer would choose another layout warns (FutureWarning): before
            0.3 it meant "choose".
        *operands: arrays or ``jax.ShapeDtypeStruct``s (for sizes, dtype and,
            without annotations, shardings); or none, with ``sizes``.
        mesh: a ``Mesh``/``AbstractMesh``, a dict of axis sizes
            (``{'data': 4, 'model': 2}``), or None for the operands' or the current mesh.
        sizes: axis sizes, e.g. ``{'b': 1024, 'x': 4096}`` (checked against the operands).
        dtype: the element type (default: the first operand's, else f32).
        profile: a :class:`Profile` or ``'cpu'``, ``'h100'``, ``'tpu-v5p'`` (default ``'cpu'``).
        in_specs: ``PartitionSpec``s of the operands (instead of ``@`` annotations).
        out_spec: the ``PartitionSpec`` to deliver the result in (instead of annotating the output).

    Raises:
        EinshardError: unknown mesh axes, missing or mismatched sizes, an
            operand whose rank does not match its side, indivisible splits.
    """
    # Everything is reduced to hashable facts first (shapes, dtypes, specs, mesh sizes), so repeated
    # einsums (a model's layers) are answered from a cache.
    stand_ins = tuple(_Operand.of(x) for x in operands)
    mesh_axes = _mesh_axes(mesh, operands)
    key = (
        expr,
        stand_ins,
        mesh_axes,
        tuple(sizes.items()) if sizes else None,
        dtype,
        profile,
        tuple(in_specs) if in_specs is not None else None,
        out_spec,
    )
    try:
        hash(key)
    except TypeError:
        return _analyze(*key)
    return _analyze_cached(*key)


class _Operand(NamedTuple):
    """What analyze needs of an operand: its shape, dtype and PartitionSpec (if it has one)."""

    shape: tuple[int, ...]
    dtype: Any
    spec: Any

    @staticmethod
    def of(x: Any) -> _Operand:
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        return _Operand(tuple(int(s) for s in getattr(x, "shape", ())), getattr(x, "dtype", None), spec)


@functools.lru_cache(maxsize=4096)
def _analyze_cached(*key: Any) -> Plan:
    return _analyze(*key)


def _analyze(
    expr: str,
    ops: tuple[_Operand, ...],
    mesh_axes: tuple[MeshAxis, ...] | None,
    size_items: tuple[tuple[str, int], ...] | None,
    dtype: Any,
    profile: Profile | str | None,
    in_specs: tuple[Any, ...] | None,
    out_spec: Any,
) -> Plan:
    sizes = dict(size_items) if size_items else None
    text = _einsum_text(expr)
    jnp_style = text != expr
    parsed = parse_einsum(text)
    chosen = parsed.output_chosen
    if ops and len(ops) != len(parsed.inputs):
        raise parsed.fail(f"the expression has {len(parsed.inputs)} operands but {len(ops)} arrays were given")
    if in_specs is not None and len(in_specs) != len(parsed.inputs):
        raise parsed.fail(f"the expression has {len(parsed.inputs)} operands but in_specs has {len(in_specs)} entries")
    if any(side.has_ellipsis for side in parsed.sides):
        parsed = _expand_ellipsis(parsed, ops)

    # Sizes: from the operands, then the mapping; every disagreement is an error naming both sizes.
    known: dict[str, int] = {}
    where: dict[str, str] = {}
    for k, (side, x) in enumerate(zip(parsed.inputs, ops, strict=False)):
        shape = tuple(int(s) for s in getattr(x, "shape", ()))
        _check_rank(parsed, side, k, shape)
        for item, s in zip(side.axes, shape, strict=False):
            if item.name in known and known[item.name] != s:
                raise parsed.fail(
                    f"axis {item.name!r} has size {s} in operand {k + 1} but {known[item.name]} in {where[item.name]}",
                    item.column,
                )
            known[item.name] = s
            where[item.name] = f"operand {k + 1}"
    for name, s in (sizes or {}).items():
        if name in known and known[name] != s:
            raise parsed.fail(f"axis {name!r} has size {known[name]} in {where[name]} but sizes={{{name!r}: {s}}}")
        known[name] = int(s)
        where.setdefault(name, "sizes")
    all_axes = [n for side in parsed.inputs for n in side.names]
    missing = sorted({n for n in all_axes if n not in known}, key=all_axes.index)
    if missing:
        raise parsed.fail(
            "no size for axis " + ", ".join(repr(n) for n in missing),
            hint="Pass arrays or jax.ShapeDtypeStructs, or sizes={" + ", ".join(f"{n!r}: ..." for n in missing) + "}.",
        )
    unused = [n for n in (sizes or {}) if n not in all_axes]
    if unused:
        raise parsed.fail(f"sizes names {unused[0]!r}, which is not an axis of the einsum")

    # The mesh (only needed if something is sharded).
    annotated = parsed.uses_mesh_axes
    if mesh_axes is None:
        if annotated or in_specs is not None or out_spec is not None:
            raise parsed.fail(
                "the einsum names mesh axes but there is no mesh",
                hint="Pass mesh={'data': 4, ...} or a jax Mesh, or call inside jax.set_mesh(mesh).",
            )
        mesh_axes = ()

    # Operand layouts: '@' annotations, else in_specs, else the operands' own shardings.
    layouts = []
    for k, side in enumerate(parsed.inputs):
        dims = tuple(item.mesh_axes or () for item in side.axes)
        unreduced = frozenset(side.unreduced)
        has_own = any(dims) or unreduced
        if in_specs is not None:
            if has_own:
                raise parsed.fail("operand layouts come from '@' annotations or in_specs, not both", side.column)
            dims, unreduced = _spec_dims(in_specs[k], len(side.axes), f"in_specs[{k}]")
        elif not has_own and k < len(ops):
            spec = ops[k].spec
            if spec is not None:
                dims, unreduced = _spec_dims(spec, len(side.axes), f"operand {k + 1}'s sharding")
        layouts.append(_layout_of(parsed, side, dims, unreduced, known, mesh_axes, f"operand {k + 1}"))

    # The output side (README "Syntax"): 'b? y?' lets the analyzer choose; 'b y@model' / '{U:model}' asks for
    # that layout; bare names are whole (replicated), as in a placement.  A jnp.einsum string ('bx,xy->by')
    # has no layouts of its own: its result is chosen, as jnp.einsum's is.
    out_side = parsed.output
    out_dims = tuple(item.mesh_axes or () for item in out_side.axes)
    requested: Layout | None = None
    bare = False
    if out_spec is not None:
        if any(out_dims) or out_side.unreduced or chosen:
            raise parsed.fail("the output layout comes from its annotation or out_spec, not both", out_side.column)
        d, u = _spec_dims(out_spec, len(out_side.axes), "out_spec")
        requested = _layout_of(parsed, out_side, d, u, known, mesh_axes, "the output")
    elif chosen or jnp_style or not out_side.axes:  # a scalar result is whole either way
        requested = None
    else:
        requested = _layout_of(
            parsed, out_side, out_dims, frozenset(out_side.unreduced), known, mesh_axes, "the output"
        )
        bare = not any(out_dims) and not out_side.unreduced

    if dtype is None and ops:
        dtype = getattr(ops[0], "dtype", None)
    dname, itemsize = dtype_info(dtype)
    prof = get_profile(profile)
    problem = Problem(
        tuple(layouts),
        tuple(out_side.names),
        tuple((n, known[n]) for n in dict.fromkeys(all_axes)),
        mesh_axes,
        requested,
        itemsize,
        prof,
    )
    plan = analyze_layouts(problem, dname)
    if bare and any(any(d) or op.unreduced for op in layouts for d in op.dims):
        _warn_if_meaning_changed(text, plan, problem, dname)
    return plan


def _warn_if_meaning_changed(text: str, plan: Plan, problem: Problem, dname: str) -> None:
    """Before 0.3 a bare output ('-> b y') on an einsum meant "infer"; it now means whole, as in a placement.

    A FutureWarning (not an error: the result is the same values, laid out whole) when that changes the
    answer: the analyzer, left to choose, would deliver another layout.
    """
    import dataclasses
    import warnings

    inferred = analyze_layouts(dataclasses.replace(problem, requested=None), dname)
    if inferred.out_layout == plan.out_layout:
        return
    out = " ".join(f"{_axis_label(a)}?" for a in problem.out_axes)
    warnings.warn(
        f"einsum {text!r}: a bare output side now means a whole (replicated) result, as in a placement "
        f"(einshard < 0.3 let the analyzer choose: it would deliver {side_string(inferred.out_layout)}). "
        f"Write '-> {out}' to let it choose, or annotate the layout you want ('-> {side_string(inferred.out_layout)}').",
        FutureWarning,
        stacklevel=4,
    )


def _axis_label(name: str) -> str:
    from ..parsing import format_name

    return format_name(name)


def plan_einsum(
    operands: tuple[Layout, ...],
    out_axes: tuple[str, ...],
    *,
    out: Layout | None = None,
    dtype: Any = None,
    profile: Profile | str | None = None,
) -> Plan:
    """The :class:`Plan` for operands already laid out (the entry point for whole-program analysis).

    ``operands`` are Layouts (:class:`~einshard.core.layout.Layout`) on one mesh, named by
    einsum axis; ``out_axes`` the result's axes; ``out`` the layout to deliver
    (None: inferred).  Cached: a model's repeated layers cost one analysis.

    Example:
        >>> from einshard.core.layout import Layout, MeshAxis
        >>> mesh = (MeshAxis("data", 4), MeshAxis("model", 2))
        >>> x = Layout(("b", "d"), (64, 128), mesh, (("data",), ()))
        >>> w = Layout(("d", "f"), (128, 256), mesh, ((), ("model",)))
        >>> plan_einsum((x, w), ("b", "f"), dtype="bf16").strategy
        'hybrid DP×TP'
    """
    if not operands:
        raise EinshardError("plan_einsum needs at least one operand")
    mesh = operands[0].mesh
    sizes: dict[str, int] = {}
    for k, op in enumerate(operands):
        if op.mesh != mesh:
            raise EinshardError(f"operand {k + 1} is laid out on another mesh: {op.mesh} vs {mesh}")
        for a, s in zip(op.axes, op.shape, strict=True):
            if sizes.setdefault(a, s) != s:
                raise EinshardError(f"axis {a!r} has size {s} in operand {k + 1} but {sizes[a]} before")
    missing = [a for a in out_axes if a not in sizes]
    if missing:
        raise EinshardError(f"output axis {missing[0]!r} is not an axis of any operand")
    if out is not None and (out.axes != tuple(out_axes) or out.mesh != mesh):
        raise EinshardError(
            f"the requested result {out} does not have the axes {tuple(out_axes)} on the operands' mesh"
        )
    dname, itemsize = dtype_info(dtype)
    problem = Problem(operands, tuple(out_axes), tuple(sizes.items()), mesh, out, itemsize, get_profile(profile))
    return analyze_layouts(problem, dname)


@functools.lru_cache(maxsize=1024)
def analyze_layouts(problem: Problem, dtype: str = "f32") -> Plan:
    """The :class:`Plan` for a resolved :class:`~einshard.analysis.rule.Problem` (cached: layers repeat)."""
    ranked = rank(enumerate_candidates(problem))
    if problem.requested is None:
        best = next(c for c in ranked if c.resolution == "complete")
    else:
        if not ranked:
            raise EinshardError(
                f"no way to deliver the result as {side_string(problem.requested)}: "
                "pending sums {U:...} can only come from a contraction split over that mesh axis"
            )
        best = ranked[0]
    classes = classify(tuple(op.axes for op in problem.operands), problem.out_axes)
    weight = pick_weight(problem.operands, classes)
    sizes = {m.name: m.size for m in problem.mesh}
    total = 2 * math.prod(s for _, s in problem.sizes)

    def build(c: Any, more: Any = None) -> Plan:
        role_of = roles(problem.operands, c, classes, weight)
        comm = sum(s.time for s in c.steps)
        return Plan(
            expression=", ".join(side_string(o) for o in problem.operands) + " -> " + side_string(c.out),
            mesh=problem.mesh,
            dtype=dtype,
            itemsize=problem.itemsize,
            profile=problem.profile,
            operands=problem.operands,
            operands_used=c.targets,
            out_layout=c.out,
            computed_layout=c.computed,
            collectives=c.steps,
            flops=c.flops,
            total_flops=total,
            compute_time=problem.profile.compute_time(c.flops),
            comm_time=comm,
            time=c.time,
            classes=classes,
            choice=c.choice,
            strategy=strategy_name(role_of),
            roles=role_of,
            tutorial_view=tutorial_view(c, classes),
            why=explain_choice(problem.operands, c, classes, sizes),
            resolution=c.resolution,
            weight=weight,
            more=more,
        )

    return build(best, lambda: tuple(build(c) for c in ranked if c is not best))
