"""``einshard.analyze``: from an annotated einsum to a :class:`EinsumPlan`.

Example:
    >>> import einshard
    >>> plan = einshard.analyze("b@data x, x y@model -> b? y?", mesh={"data": 4, "model": 2},
    ...                         sizes={"b": 1024, "x": 4096, "y": 16384}, dtype="bf16", profile="h100")
    >>> plan.strategy, plan.collectives, tuple(plan.out_spec)
    ('hybrid DP×TP', (), ('data', 'model'))
    >>> plan = einshard.analyze("b x@model, x@model y -> b? y?", mesh={"model": 4}, sizes={"b": 64, "x": 128, "y": 256})
    >>> [(c.kind, c.axes, c.bytes) for c in plan.collectives]   # row-parallel TP: sum the partial products
    [('reduce-scatter', ('model',), 49152)]
    >>> str(plan.out_layout)          # the cheapest complete result: summed and split, half an all-reduce's bytes
    '[b:64@model y:256]'
    >>> [(str(a.out_layout), [c.kind for c in a.collectives]) for a in plan.alternatives[:3]]
    [('[b:64 y:256 {U:model}]', []), ('[b:64 y:256@model]', ['reduce-scatter']), ('[b:64 y:256]', ['all-reduce'])]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from ..._caches import cached, register
from ..._checks import describe_value
from ...core.layout import Layout, MeshAxis
from ...core.logical import AxisRules, AxisRulesLike, current_axis_rules, resolve_text
from ...core.moves import remember_mesh
from ...errors import EinshardError
from ..cost import Profile, get_profile
from .model import Problem, classify, pick_weight
from .plan import EinsumPlan, side_string
from .read import (
    WrittenSide,
    analysis_mesh,
    check_rank,
    dtype_info,
    expand_ellipsis,
    prepare,
    prepare_text,
    prepared_of,
    side_layout,
    spec_dims,
    spec_partitions,
    trusted_mesh_axis,
)
from .search import Enumeration, best_candidate, rank, total_time

__all__ = [
    "Operand",
    "analyze",
    "analyze_layouts",
    "clear_analysis_caches",
    "dtype_info",
    "plan_einsum",
    "spec_partitions",
]


def analyze(
    expr: str,
    *operands: Any,
    mesh: Any = None,
    sizes: dict[str, int] | None = None,
    dtype: Any = None,
    profile: Profile | str | None = None,
    in_specs: tuple[Any, ...] | None = None,
    out_spec: Any = None,
    axis_rules: AxisRulesLike | None = None,
) -> EinsumPlan:
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
        axis_rules: a table from logical axis names to mesh axes, for ``@batch``-style names in ``expr``;
            default the table made current by ``with einshard.axis_rules(...)`` (docs/logical-axes.md).

    Raises:
        EinshardError: unknown mesh axes, missing or mismatched sizes, an
            operand whose rank does not match its side, indivisible splits.
    """
    # The containers are checked before they are read into the caches' keys (two class tests on the common
    # call); what they hold is checked by _analyze, once per distinct call: the caches remember only answers.
    if sizes is not None and sizes.__class__ is not dict:
        _check_container(sizes, "sizes", "a dict of axis sizes like {'b': 1024, 'x': 4096}", dict)
    if in_specs is not None and in_specs.__class__ is not tuple:
        _check_container(in_specs, "in_specs", "a tuple of PartitionSpecs, one per operand", (tuple, list))
    rules = AxisRules.of(axis_rules) if axis_rules is not None else current_axis_rules()
    if rules is not None and isinstance(expr, str) and "@" in expr:
        # Logical names are resolved once, here, into the mesh axes the rest of the analysis (and its caches,
        # keyed on the text) sees.
        axes = analysis_mesh(mesh, operands)
        expr = resolve_text(expr, None if axes is None else [m.name for m in axes], rules)
    # The common call (sizes and a dict mesh, no arrays) is answered by one dict lookup on the arguments
    # as given: a model's repeated layers cost a hash of a few small tuples.
    if not operands and mesh.__class__ is dict:
        size_items = tuple(sizes.items()) if sizes else None
        try:
            fast = (
                expr,
                tuple(mesh.items()),
                size_items,
                dtype,
                profile,
                None if in_specs is None else tuple(in_specs),
                out_spec,
            )
            hit = _PLANS.get(fast)
        except TypeError:  # an unhashable argument: analysed every time
            fast, hit = None, None
        if hit is not None:
            for v in mesh.values():
                if v.__class__ is bool:  # True == 1 as a key: let the checks refuse it
                    break
            else:
                return _replay_warning(hit)
        plan = None
        if in_specs is None and out_spec is None and sizes.__class__ is dict:
            plan = _analyze_plain(expr, mesh, sizes, dtype, profile)  # type: ignore[arg-type]
        if plan is None:
            plan = _analyze(expr, (), analysis_mesh(mesh, ()), size_items, dtype, profile, in_specs, out_spec)
        if fast is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[fast] = plan
        return _replay_warning(plan)
    # Otherwise everything is reduced to hashable facts first (shapes, dtypes, specs, mesh sizes).
    stand_ins = tuple(Operand.of(x) for x in operands)
    mesh_axes = analysis_mesh(mesh, operands)
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
        return _replay_warning(_analyze(*key))
    return _replay_warning(_analyze_cached(*key))


def _replay_warning(plan: EinsumPlan) -> EinsumPlan:
    """Warn, on every call, what the plan's analysis found to say: a bare output's FutureWarning, and operands
    laid out otherwise than written (EinshardWarning).  A cached plan is returned without being analysed
    again, and its warnings are part of the answer (a repeated call used to be silent)."""
    message = plan.__dict__.get("_bare_output_warning")
    notes = plan.__dict__.get("_layout_notes", ())
    if message is not None or notes:
        import warnings

        from ...errors import EinshardWarning

        for note in notes:
            warnings.warn(note, EinshardWarning, stacklevel=3)
        if message is not None:
            warnings.warn(message, FutureWarning, stacklevel=3)
    return plan


def _check_container(value: Any, name: str, wants: str, kinds: type | tuple[type, ...]) -> None:
    from collections.abc import Mapping

    ok = isinstance(value, Mapping) if kinds is dict else isinstance(value, kinds)
    if not ok:
        raise EinshardError(f"einshard.analyze: {name}= takes {wants}, got {describe_value(value)}")


def _check_arguments(sizes: dict[Any, Any] | None, in_specs: Any, out_spec: Any) -> None:
    """What ``sizes=``, ``in_specs=`` and ``out_spec=`` hold: each wrong entry an error naming its argument."""
    from jax.sharding import PartitionSpec

    for name, size in (sizes or {}).items():
        if not isinstance(name, str) or not name:
            raise EinshardError(
                f"einshard.analyze: sizes= maps axis names to sizes, got the key {describe_value(name)}"
            )
        if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 0:
            raise EinshardError(
                f"einshard.analyze: sizes= gives axis {name!r} the size {describe_value(size)}; sizes are integers >= 0"
            )
    for k, spec in enumerate(in_specs or ()):
        if spec is not None and not isinstance(spec, PartitionSpec):
            raise EinshardError(
                f"einshard.analyze: in_specs[{k}] is {describe_value(spec)}; in_specs= holds PartitionSpecs or None"
            )
    if out_spec is not None and not isinstance(out_spec, PartitionSpec):
        raise EinshardError(
            f"einshard.analyze: out_spec= takes a PartitionSpec or None, got {describe_value(out_spec)}"
        )


_MAX_PLANS = 4096
_PLANS: dict[tuple[Any, ...], EinsumPlan] = {}
register(_PLANS.clear)


class Operand(NamedTuple):
    """What analyze needs of an operand: its shape, dtype and PartitionSpec (if it has one)."""

    shape: tuple[int, ...]
    dtype: Any
    spec: Any

    @staticmethod
    def of(x: Any) -> Operand:
        spec = getattr(getattr(x, "sharding", None), "spec", None)
        return Operand(tuple(int(s) for s in getattr(x, "shape", ())), getattr(x, "dtype", None), spec)


@cached(maxsize=4096)
def _analyze_cached(*key: Any) -> EinsumPlan:
    return _analyze(*key)


def clear_analysis_caches() -> None:
    """Empty the analyzer's caches of plans, leaving the parser's warm (with what is read from each parsed
    text: its axes, annotations, axis classes and splits as written, which depend on the text alone).

    ``einshard.clear_caches()`` empties these and every other einshard cache.
    """
    _PLANS.clear()
    _analyze_cached.cache_clear()  # type: ignore[attr-defined]
    analyze_layouts.cache_clear()  # type: ignore[attr-defined]


def _analyze_plain(
    expr: str, mesh: dict[str, int], sizes: dict[str, int], dtype: Any, profile: Profile | str | None
) -> EinsumPlan | None:
    """:func:`_analyze` of the common call (layouts from the text's annotations, a dict mesh, ``sizes`` only),
    or None when anything is not as that call usually is (the general path then answers, or raises with its
    messages).  The same checks as the general path's, on facts read once from the text (``WrittenSide``)."""
    if expr.__class__ is not str:
        return None
    prep = prepare_text(expr)
    if not prep.plain or sizes.keys() != prep.unique_set:
        return None
    values = sizes.values()
    if values and (set(map(type, values)) != _INT or min(values) < 0):
        return None
    if not mesh or set(map(type, mesh.values())) != _INT or set(map(type, mesh)) != _STR:
        return None
    smallest = min(mesh.values())
    if smallest < 1 or "" in mesh or not mesh.keys() >= prep.mesh_names:
        return None  # (a mesh axis the text names that the mesh lacks: the general path says which)
    mesh_axes = tuple(map(trusted_mesh_axis, mesh, mesh.values()))
    # its sizes by name, shared with the primitives (one dict per mesh, as _mesh_facts would build it)
    mesh_sizes = dict(mesh)
    remember_mesh(
        mesh_axes, mesh_sizes, _NO_AXES if smallest > 1 else frozenset([n for n, k in mesh.items() if k == 1])
    )
    get = sizes.__getitem__
    layouts = []
    for side in prep.sides:
        lay = _side_layout(side, get, mesh_axes, mesh_sizes)
        if lay is None:
            return None
        layouts.append(lay)
    requested: Layout | None = None
    if not (prep.chosen or prep.jnp_style or not prep.out_dims):
        requested = _side_layout(prep.out_side, get, mesh_axes, mesh_sizes)
        if requested is None:
            return None
    dname, itemsize = dtype_info(dtype)
    problem = Problem.trusted(
        tuple(layouts),
        prep.out_names,
        tuple(zip(prep.unique, map(get, prep.unique))),
        mesh_axes,
        requested,
        itemsize,
        get_profile(profile).walking(),  # XLA's alternatives ranked as explain's walk ranks them (Profile.walking)
        scatter_chosen=requested is None,  # the user's '?' (or a jnp string): the cheapest complete result
    )
    # options.options from the text's splits: each mesh axis's einsum axes as written (none for a size of 1)
    kept = prep.kept if requested is None else prep.kept_out
    if smallest > 1:  # (the common mesh: no axis of size 1; zip and map, without a comprehension's frame)
        per_axis = list(zip(mesh, map(kept.get, mesh, itertools.repeat(_NONE))))
    else:
        per_axis = [(n, kept.get(n, _NONE) if k > 1 else _NONE) for n, k in mesh.items()]
    at = prep.at if requested is None else prep.at_out
    plan = _plan(problem, dname, prep.classes, prep.weight, at, mesh_sizes, per_axis)
    if prep.bare and requested is not None and prep.any_own:
        _warn_if_meaning_changed(prep.text, plan, problem, dname)
    return plan


_INT = {int}
_STR = {str}
_NO_AXES: frozenset[str] = frozenset()
_NONE: tuple[str | None, ...] = (None,)


def _side_layout(side: WrittenSide, size: Any, mesh: tuple[MeshAxis, ...], mesh_sizes: dict[str, int]) -> Layout | None:
    """:func:`~einshard.analysis.einsum.read.side_layout` of a side as written (``size``: its axes' sizes by name; the side names no mesh axis
    twice, and only axes of the mesh): the layout, or None when a split does not divide its axis."""
    shape = tuple(map(size, side.names))
    for i, d in side.split:
        if shape[i] % math.prod(map(mesh_sizes.__getitem__, d)):
            return None
    return Layout._derive(side.names, shape, mesh, side.dims, side.unreduced)


def _analyze(
    expr: str,
    ops: tuple[Operand, ...],
    mesh_axes: tuple[MeshAxis, ...] | None,
    size_items: tuple[tuple[str, int], ...] | None,
    dtype: Any,
    profile: Profile | str | None,
    in_specs: tuple[Any, ...] | None,
    out_spec: Any,
) -> EinsumPlan:
    sizes = dict(size_items) if size_items else None
    _check_arguments(sizes, in_specs, out_spec)
    prep = prepare(expr)
    parsed = prep.parsed
    chosen = prep.chosen
    if ops and len(ops) != len(parsed.inputs):
        raise parsed.fail(f"the expression has {len(parsed.inputs)} operands but {len(ops)} arrays were given")
    if in_specs is not None and len(in_specs) != len(parsed.inputs):
        raise parsed.fail(f"the expression has {len(parsed.inputs)} operands but in_specs has {len(in_specs)} entries")
    if "..." in prep.text and any(side.has_ellipsis for side in parsed.sides):
        parsed = expand_ellipsis(parsed, ops)
        prep = prepared_of(parsed, prep.text, prep.jnp_style)

    # Sizes: from the operands, then the mapping; every disagreement is an error naming both sizes.
    known: dict[str, int] = {}
    where: dict[str, str] = {}
    for k, (side, x) in enumerate(zip(parsed.inputs, ops, strict=False)):
        shape = tuple(int(s) for s in getattr(x, "shape", ()))
        check_rank(parsed, side, k, shape)
        for item, s in zip(side.axes, shape, strict=False):
            if item.name in known and known[item.name] != s:
                raise parsed.fail(
                    f"axis {item.name!r} has size {s} in operand {k + 1} but {known[item.name]} in {where[item.name]}",
                    item.column,
                )
            known[item.name] = s
            where[item.name] = f"operand {k + 1}"
    if not known and sizes:  # the common call: sizes only
        known = {name: int(s) for name, s in sizes.items()}
    else:
        for name, s in (sizes or {}).items():
            if name in known and known[name] != s:
                raise parsed.fail(f"axis {name!r} has size {known[name]} in {where[name]} but sizes={{{name!r}: {s}}}")
            known[name] = int(s)
    if not prep.unique_set <= known.keys():
        missing = [n for n in prep.unique if n not in known]
        raise parsed.fail(
            "no size for axis " + ", ".join(repr(n) for n in missing),
            hint="Pass arrays or jax.ShapeDtypeStructs, or sizes={" + ", ".join(f"{n!r}: ..." for n in missing) + "}.",
        )
    if sizes and len(known) > len(prep.unique):
        unused = [n for n in sizes if n not in prep.unique]
        raise parsed.fail(f"sizes names {unused[0]!r}, which is not an axis of the einsum")

    # The mesh (only needed if something is sharded).
    if mesh_axes is None:
        if parsed.uses_mesh_axes or in_specs is not None or out_spec is not None:
            raise parsed.fail(
                "the einsum names mesh axes but there is no mesh",
                hint="Pass mesh={'data': 4, ...} or a jax Mesh, or call inside jax.set_mesh(mesh).",
            )
        mesh_axes = ()
    mesh: tuple[MeshAxis, ...] = mesh_axes

    def layout(k: int | None, dims: Any, unreduced: frozenset[str]) -> Layout:
        side = parsed.output if k is None else parsed.inputs[k]
        return side_layout(
            parsed, side, dims, unreduced, known, mesh, "the output" if k is None else f"operand {k + 1}"
        )

    # Operand layouts: '@' annotations, else in_specs, else the operands' own shardings.
    layouts = []
    notes: list[str] = []  # where the annotations differ from the operands' own layouts (warned on each call)
    for k in range(len(prep.names)):
        dims, unreduced = prep.dims[k], prep.unreduced[k]
        has_own = prep.has_own[k]
        if in_specs is not None:
            if has_own:
                raise parsed.fail(
                    "operand layouts come from '@' annotations or in_specs, not both", parsed.inputs[k].column
                )
            dims, unreduced = spec_dims(in_specs[k], len(dims), f"in_specs[{k}]")
        elif not has_own and k < len(ops):
            spec = ops[k].spec
            if spec is not None:
                dims, unreduced = spec_dims(spec, len(dims), f"operand {k + 1}'s sharding")
        layouts.append(layout(k, dims, unreduced))
        if has_own and in_specs is None and k < len(ops) and ops[k].spec is not None:
            note = _written_differs(prep.text, k, layouts[-1], ops[k].spec, layout)
            if note is not None:
                notes.append(note)

    # The output side (docs/syntax.md): 'b? y?' lets the analyzer choose; 'b y@model' / '{U:model}' asks for
    # that layout; bare names are whole (replicated), as in a placement.  A jnp.einsum string ('bx,xy->by')
    # has no layouts of its own: its result is chosen, as jnp.einsum's is.
    out_dims, out_unreduced = prep.out_dims, prep.out_unreduced
    requested: Layout | None = None
    bare = False
    if out_spec is not None:
        if any(out_dims) or out_unreduced or chosen:
            raise parsed.fail("the output layout comes from its annotation or out_spec, not both", parsed.output.column)
        d, u = spec_dims(out_spec, len(out_dims), "out_spec")
        requested = layout(None, d, u)
    elif chosen or prep.jnp_style or not out_dims:  # a scalar result is whole either way
        requested = None
    else:
        requested = layout(None, out_dims, out_unreduced)
        bare = not any(out_dims) and not out_unreduced

    if dtype is None and ops:
        dtype = getattr(ops[0], "dtype", None)
    dname, itemsize = dtype_info(dtype)
    problem = Problem.trusted(
        tuple(layouts),
        prep.out_names,
        tuple([(n, known[n]) for n in prep.unique]),
        mesh_axes,
        requested,
        itemsize,
        get_profile(profile).walking(),  # XLA's alternatives ranked as explain's walk ranks them (Profile.walking)
        scatter_chosen=requested is None,  # the user's '?' (or a jnp string): the cheapest complete result
    )
    plan = _plan(problem, dname, prep.classes, prep.weight)
    if notes:  # (a fresh plan: _plan is not cached)
        plan.__dict__["_layout_notes"] = tuple(notes)
    if bare and any([any(d) or op.unreduced for op in layouts for d in op.dims]):
        _warn_if_meaning_changed(prep.text, plan, problem, dname)
    return plan


def _written_differs(text: str, k: int, written: Layout, spec: Any, layout: Any) -> str | None:
    """What to say when operand ``k``'s '@' annotations lay it out otherwise than the array is (issue 22: the
    README placed x 'b@data x' and analysed 'b x@data' without a word), or None when they agree.

    The annotation wins (it is what the user asks to analyse, and what einshard.einsum lays the operand out as
    on the way in), but the reshard that takes the array there is not in the plan's cost, so it is said."""
    try:
        dims, unreduced = spec_dims(spec, len(written.dims), f"operand {k + 1}'s sharding")
        actual = layout(k, dims, unreduced)
    except EinshardError:
        return None  # the array's own layout does not fit this mesh: the annotation is all there is
    sizes = {m.name: m.size for m in written.mesh}

    def real(lay: Layout) -> tuple[object, ...]:  # mesh axes of size 1 split nothing
        return tuple(tuple(m for m in d if sizes[m] > 1) for d in lay.dims), lay.unreduced

    if real(actual) == real(written):
        return None
    left = " ".join(map(_axis_label, written.axes))
    return (
        f"einsum {text!r}: operand {k + 1} is laid out {side_string(actual)} ({spec}), but the expression "
        f"writes {side_string(written)}: analysed as written. Running it (einshard.einsum/lower) reshards the "
        "operand on the way in, which this plan does not price. Write the operand as it is laid out, or place "
        f"it as written first (einshard.einshard(x, '{left} -> {side_string(written)}'))."
    )


def _warn_if_meaning_changed(text: str, plan: EinsumPlan, problem: Problem, dname: str) -> None:
    """Before 0.3 a bare output ('-> b y') on an einsum meant "infer"; it now means whole, as in a placement.

    A FutureWarning (not an error: the result is the same values, laid out whole) when that changes the
    answer: the analyzer, left to choose, would deliver another layout.
    """
    import dataclasses

    # (what einshard < 0.3 delivered: the result as computed, its sums all-reduced; no reduce-scatter)
    inferred = analyze_layouts(dataclasses.replace(problem, requested=None, scatter_chosen=False), dname)
    if inferred.out_layout == plan.out_layout:
        return
    out = " ".join(f"{_axis_label(a)}?" for a in problem.out_axes)
    # Recorded on the plan (a frozen dataclass without slots: its __dict__), and warned by analyze() on every
    # call that returns it, cached or not (_replay_warning).
    plan.__dict__["_bare_output_warning"] = (
        f"einsum {text!r}: a bare output side now means a whole (replicated) result, as in a placement "
        f"(einshard < 0.3 let the analyzer choose: it would deliver {side_string(inferred.out_layout)}). "
        f"Write '-> {out}' to let it choose, or annotate the layout you want ('-> {side_string(inferred.out_layout)}')."
    )


def _axis_label(name: str) -> str:
    from ...parsing import format_name

    return format_name(name)


def plan_einsum(
    operands: tuple[Layout, ...],
    out_axes: tuple[str, ...],
    *,
    out: Layout | None = None,
    dtype: Any = None,
    profile: Profile | str | None = None,
) -> EinsumPlan:
    """The :class:`EinsumPlan` for operands already laid out (the entry point for whole-program analysis).

    ``operands`` are Layouts (:class:`~einshard.core.layout.Layout`) on one mesh, named by
    einsum axis; ``out_axes`` the result's axes; ``out`` the layout to deliver
    (None: inferred).  Cached: a model's repeated layers cost one analysis.

    Example:
        >>> from einshard.placement import Layout, MeshAxis
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
    problem = Problem(
        operands, tuple(out_axes), tuple(sizes.items()), mesh, out, itemsize, get_profile(profile).walking()
    )
    return analyze_layouts(problem, dname)


_UNKNOWN: Any = object()


@cached(maxsize=1024)
def analyze_layouts(problem: Problem, dtype: str = "f32") -> EinsumPlan:
    """The :class:`EinsumPlan` for a resolved :class:`~einshard.analysis.einsum.model.Problem` (cached: layers repeat)."""
    return _plan(problem, dtype)


def _plan(
    problem: Problem,
    dtype: str,
    classes: dict[str, str] | None = None,
    weight: Any = _UNKNOWN,
    where: Sequence[dict[str, str]] | None = None,
    mesh_sizes: dict[str, int] | None = None,
    per_axis: list[tuple[str, tuple[str | None, ...]]] | None = None,
) -> EinsumPlan:
    """:func:`analyze_layouts` without its cache (``analyze`` caches its own answers).

    ``classes``, ``weight``, ``where``, ``mesh_sizes``, ``per_axis``: :func:`classify`, :func:`pick_weight`,
    ``options.splits_of`` of the problem, its mesh's axis sizes by name and ``options.options``, if the caller has them."""
    if classes is None:
        classes = classify(tuple([op.axes for op in problem.operands]), problem.out_axes)
    if weight is _UNKNOWN:
        weight = pick_weight(problem.operands, classes)
    en = Enumeration(problem, classes, where, mesh_sizes, per_axis)
    # The best way is found without pricing every way to deliver the result; the other ways are priced
    # and ranked when the plan's alternatives are first read.
    best = best_candidate(en, complete=problem.requested is None)
    if best is None:
        if problem.requested is None:  # pragma: no cover - a complete result is always reachable (all-reduce)
            raise EinshardError(f"no way to compute {problem.operands} -> {problem.out_axes}")
        raise EinshardError(
            f"no way to deliver the result as {side_string(problem.requested)}: "
            "pending sums {U:...} can only come from a contraction split over that mesh axis"
        )
    total = 2 * math.prod(en.size_of.values())  # (the sizes of problem.sizes, an exact product of ints)

    def build(c: Any, more: Any = None) -> EinsumPlan:
        return EinsumPlan.trusted(  # one per plan and per alternative, from a candidate valid by construction
            problem.mesh,
            dtype,
            problem.itemsize,
            problem.profile,
            problem.operands,
            c.targets,
            c.out,
            c.computed,
            c.steps,
            c.flops,
            total,
            problem.profile.compute_time(c.flops),
            total_time(c.steps) if c.steps else 0,  # (sum([]) is 0)
            c.time,
            dict(classes),  # the plan's own: the one given may be a cached expression's
            c.choice,
            c.resolution,
            weight,
            more,
            c,
        )

    chosen_from = ("complete", "reduce-scatter") if problem.scatter_chosen else ("complete",)

    def alternatives() -> tuple[EinsumPlan, ...]:
        ranked = rank([c for part in en.parts() for c in en.candidates(part)])
        first = next(c for c in ranked if c.resolution in chosen_from) if problem.requested is None else ranked[0]
        return tuple(build(c) for c in ranked if c is not first)  # `first` is `best`, priced again

    return build(best, alternatives)
