"""The entry points: ``explain(fn, *args)`` and ``trace`` (trace once, cost under many layouts)."""

from __future__ import annotations

import bisect
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from ..._checks import check_callable, naming
from ...core.layout import Layout, MeshAxis
from ...core.logical import AxisRulesLike, scoped_axis_rules
from ...core.mesh import auto_axes, explicit_axes, mesh_axes, resolve_mesh
from ...errors import EinshardError
from .alternatives import widen
from .costing import OpCosts, is_free
from .inline import inlined_calls, sole_call
from .memory import PeakCache, peak_caveat
from .memory import peak_bytes as _peak_bytes
from .open_values import MAX_WALKS, Reopened, found_splits, open_values, settled_in_place, spread_back
from .oplog import CostTerms
from .report import OpReport, ProgramReport
from .walker import Walker

__all__ = ["explain", "trace", "TracedProgram"]


def _sharding_of(x: Any) -> Any:
    """A leaf's sharding: a concrete array's own, a traced value's from its type (``jax.typeof``)."""
    if isinstance(x, jax.core.Tracer):
        return getattr(jax.typeof(x), "sharding", None)
    return getattr(x, "sharding", None)


def _unknown_axes(x: Any) -> frozenset[str]:
    """The Auto mesh axes of a traced value's type: its layout over them is not known while tracing."""
    if not isinstance(x, jax.core.Tracer):
        return frozenset()
    m = getattr(_sharding_of(x), "mesh", None)
    return frozenset() if m is None or getattr(m, "empty", True) else auto_axes(m)


def arg_layouts(args: Sequence[Any], in_specs: Any, mesh: tuple[MeshAxis, ...]) -> list[Layout]:
    leaves = jax.tree_util.tree_leaves(args)
    if in_specs is None:
        for i, x in enumerate(leaves):
            unknown = _unknown_axes(x)
            if unknown:
                # A traced value's type carries only its Explicit axes' layout: reading it as replicated over
                # the Auto axes would price the program silently wrong.
                raise EinshardError(
                    f"explain(): argument {i + 1} is a traced value on a mesh with Auto axes {sorted(unknown)}, "
                    "whose layout XLA chooses after tracing (the value's type does not carry it)",
                    hint="Call einshard.explain outside jax.jit/jax.grad on the arrays themselves, pass in_specs=, "
                    "or use a mesh with Explicit axes (jax.make_mesh's default).",
                )
        specs: list[Any] = [getattr(_sharding_of(x), "spec", None) for x in leaves]
    else:
        specs = _broadcast_specs(args, in_specs)
    out = []
    for x, spec in zip(leaves, specs):
        shape = tuple(int(s) for s in np.shape(x))
        if isinstance(spec, str):
            from ...core.layout import resolve_named
            from ...parsing import parse_placement

            lay = resolve_named(parse_placement(spec), shape, mesh)
            out.append(lay)
            continue
        # An in_specs= PartitionSpec, or the argument's own sharding's (already valid for its mesh, checked the same).
        source = "in_specs=" if in_specs is not None else "an argument's sharding"
        _spec_entries(spec, f"explain(): {source}")
        spec = jax.sharding.PartitionSpec() if spec is None else spec
        out.append(Layout.from_spec(spec, shape, mesh, source=f"explain(): {source}", noun="argument"))
    return out


def _spec_entries(spec: Any, source: str = "in_specs=") -> list[Any]:
    """An argument's layout as PartitionSpec entries: each None, a mesh axis name or a tuple of them (anything
    else, an int or bytes, is refused here rather than failing deep inside as a raw TypeError)."""
    if spec is None:
        return []
    if not isinstance(spec, (jax.sharding.PartitionSpec, tuple, list)):
        raise EinshardError(
            f"{source}: a layout is an expression, a PartitionSpec or None, got {type(spec).__name__} {spec!r:.60}"
        )
    entries = list(spec)
    for e in entries:
        axes = (e,) if isinstance(e, str) else e if isinstance(e, (tuple, list)) else None
        if e is not None and (axes is None or not all(isinstance(a, str) for a in axes)):
            raise EinshardError(
                f"{source}: a PartitionSpec entry is None, a mesh axis name or a tuple of them, got {e!r:.60} "
                f"(in {spec!r:.60})"
            )
    return entries


def _rules_to_tree(arg: Any, spec: Any) -> Any:
    """One argument's ``in_specs`` entry as a tree of its leaves' layouts.

    A mapping whose keys are exactly a dict argument's keys is a pytree prefix (``{'w1': expr, 'w2': expr}`` for
    ``{'w1': ..., 'w2': ...}``); any other mapping is path rules, ``{pattern: expression}`` as
    ``einshard(tree, rules)`` takes them (:mod:`einshard.tree_rules`: the pattern searched in each leaf's
    ``jax.tree_util.keystr`` path, the first match wins, a leaf no pattern matches is an error naming it).  An
    ``nnx.State`` is read by its paths the same way.
    """
    if not isinstance(spec, Mapping):
        return spec
    if isinstance(arg, Mapping) and set(arg) == set(spec):
        if type(arg) is dict and type(spec) is dict:
            return {k: _rules_to_tree(arg[k], v) for k, v in spec.items()}
        return spec  # a mapping shaped like the argument (an nnx.State of expressions): a prefix as it is
    from ...tree_rules import leaf_expressions

    texts = leaf_expressions(arg, spec)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(arg), list(texts))


def _broadcast_specs(args: Sequence[Any], in_specs: Any) -> list[Any]:
    def is_leaf(s: Any) -> bool:
        return s is None or isinstance(s, (str, jax.sharding.PartitionSpec))

    if isinstance(in_specs, (tuple, list)) and len(in_specs) == len(args):
        in_specs = type(in_specs)(_rules_to_tree(a, s) for a, s in zip(args, in_specs))
    elif isinstance(in_specs, Mapping) and len(args) == 1:
        in_specs = (_rules_to_tree(args[0], in_specs),)
    specs_flat, spec_tree = jax.tree_util.tree_flatten(in_specs, is_leaf=is_leaf)
    try:
        per_arg = spec_tree.flatten_up_to(args)  # type: ignore[attr-defined]
    except (ValueError, TypeError):
        # (JAX's own message prints the arguments' arrays whole: the two structures say what differs)
        given = jax.tree_util.tree_structure(in_specs, is_leaf=is_leaf)
        wanted = jax.tree_util.tree_structure(tuple(args))
        raise EinshardError(
            f"explain(): in_specs does not match the arguments' structure: in_specs is {str(given)[:300]}, "
            f"the arguments are {str(wanted)[:300]}"
        ) from None
    out = []
    for spec, sub in zip(specs_flat, per_arg):
        out.extend([spec] * len(jax.tree_util.tree_leaves(sub)))
    return out


def _is_out_entry(s: Any) -> bool:
    return s is None or isinstance(s, (str, jax.sharding.PartitionSpec, jax.sharding.NamedSharding))


def output_specs(out_shape: Any, out_specs: Any, mesh: tuple[MeshAxis, ...]) -> list[Any] | None:
    """``explain(out_specs=...)`` as :meth:`TracedProgram.report` takes it: one PartitionSpec (or None) per output
    leaf, in flatten order.

    ``out_specs`` is a pytree prefix of the outputs, as ``jax.jit(out_shardings=...)`` takes one (a single entry
    covers every output below it), each entry an einshard expression, a PartitionSpec, a NamedSharding, or None:
    that output as the walk computes it.  Anything else, a structure that does not match, a mesh axis the mesh
    lacks or a split that does not divide its dimension is an EinshardError naming ``out_specs``."""
    if out_specs is None:
        return None
    specs_flat, tree = jax.tree_util.tree_flatten(out_specs, is_leaf=_is_out_entry)
    try:
        per_entry = tree.flatten_up_to(out_shape)  # type: ignore[attr-defined]
    except (ValueError, TypeError) as err:
        raise EinshardError(
            f"explain(): out_specs= does not match the structure of fn's outputs "
            f"({jax.tree_util.tree_structure(out_shape)}): {err}"
        ) from None
    out: list[Any] = []
    for spec, sub in zip(specs_flat, per_entry):
        for leaf in jax.tree_util.tree_leaves(sub):
            out.append(_output_spec(spec, tuple(int(n) for n in leaf.shape), mesh))
    return out


def _output_spec(spec: Any, shape: tuple[int, ...], mesh: tuple[MeshAxis, ...]) -> Any:
    """One output leaf's asked layout as PartitionSpec entries (None: as computed), checked against the mesh."""
    if spec is None:
        return None
    if isinstance(spec, str):
        from ...core.layout import resolve_named
        from ...parsing import parse_placement

        with naming("einshard.explain", "out_specs"):
            lay = resolve_named(parse_placement(spec), shape, mesh)
        return jax.sharding.PartitionSpec(*(d or None for d in lay.dims))
    if isinstance(spec, jax.sharding.NamedSharding):
        spec = spec.spec
    if not isinstance(spec, jax.sharding.PartitionSpec):
        raise EinshardError(
            "explain(): out_specs= takes an expression, a PartitionSpec, a NamedSharding or None per output (a "
            f"pytree prefix of the outputs), got {type(spec).__name__} {spec!r:.60}"
        )
    _spec_entries(spec, "explain(): out_specs=")
    Layout.from_spec(spec, shape, mesh, source="explain(): out_specs=", noun="output")
    return spec


def _mesh_of(mesh: Any, args: Sequence[Any]) -> tuple[MeshAxis, ...]:
    """The mesh by einshard's one precedence (einshard.core.mesh.resolve_mesh): ``mesh=``, the current mesh,
    the arguments' own (concrete arrays, and traced values through their types)."""
    return mesh_axes(resolve_mesh(mesh, args, what="explain()"))


def explain(
    fn: Callable[..., Any],
    *args: Any,
    mesh: Any = None,
    in_specs: Any = None,
    profile: Any = None,
    axis_rules: AxisRulesLike | None = None,
    target: Any = None,
    out_specs: Any = None,
    **kwargs: Any,
) -> ProgramReport:
    """Explain what running ``fn(*args, **kwargs)`` costs under the arguments' layouts.

    Args:
        fn: any JAX function (a forward pass, a loss, ``jax.grad`` of one, a whole train step).
        args: arrays, ``jax.ShapeDtypeStruct``s (with ``sharding=`` or not) or pytrees of them.
        mesh: a Mesh, or axis sizes ``{'data': 4, 'model': 2}`` to analyse without devices;
            default the arguments' mesh, else the current mesh.
        in_specs: layouts for the arguments (they replace the arguments' own): one entry per argument, each a
            PartitionSpec, an einshard expression (``'b d -> b@data d'``), None (replicated), a pytree prefix of
            that argument with those, or path rules ``{pattern: expression}`` as ``einshard(tree, rules)`` takes
            them (the same matcher: the first pattern found in the leaf's ``keystr`` path wins; an
            ``nnx.State`` is read by its paths).  A single entry for a single argument needs no tuple.  On a
            mesh with Explicit axes the arguments are typed by them before tracing, as arrays placed so would be
            (JAX then types every op from them; shapes only, nothing is placed).
        profile: the hardware profile for time estimates (see ``einshard.analyze``).
        axis_rules: a table from logical axis names to mesh axes, read while ``fn`` is traced (by the
            einshard calls inside it) and by ``in_specs`` expressions; default the table made current by
            ``with einshard.axis_rules(...)`` (docs/logical-axes.md).
        target: hardware to explain for (:mod:`einshard.targets`: ``'tpu:v5p:4x4x4'``, ``'gpu:h100x8'``):
            its chip's profile (unless ``profile=``) and, without ``mesh=``, its default mesh; the mesh's
            sizes must multiply to its chips.  Nothing compiles (``einshard.plan(target=..., verify=k)`` does).
        out_specs: layouts asked of the outputs, as ``jax.jit(out_shardings=...)`` asks them: a pytree prefix of
            ``fn``'s outputs (one entry covers every output below it) of einshard expressions, PartitionSpecs,
            NamedShardings, or None (that output as the walk computes it; the default for all).  Each output is
            brought there (the collective counted, FSDP's gradient reduce-scattered to its parameter's split) and
            held that way (peak bytes).

    Returns:
        A :class:`ProgramReport`: op-by-op collectives, bytes, FLOPs per device, peak
        bytes per device and estimated step time, for forward and backward phases.

    Example:
        >>> import jax, jax.numpy as jnp, einshard
        >>> def loss(w, x):
        ...     return jnp.mean(jnp.tanh(x @ w) ** 2)
        >>> w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        >>> r = einshard.explain(jax.grad(loss), w, x, mesh={'data': 4, 'model': 2},
        ...                      in_specs=('d f -> d f@model', 'b d -> b@data d'))
        >>> r.comm_count > 0 and r.flops > 0
        True
    """
    check_callable(fn, "einshard.explain", "fn")
    if target is not None:
        from ...targets import on_target

        mesh, profile = on_target(target, mesh, profile, "explain()")
    with scoped_axis_rules(axis_rules):
        typed = args
        if in_specs is not None:
            with naming("einshard.explain", "in_specs"):
                typed = _typed_by_specs(args, in_specs, mesh)
        if typed is args:
            traced = trace(fn, *args, mesh=mesh, profile=profile, **kwargs)
        else:
            traced = _trace_typed(fn, typed, args, mesh, profile, kwargs)
        outs = output_specs(traced.out_shape, out_specs, traced.mesh)
        with naming("einshard.explain", "in_specs"):
            return traced.report(in_specs, outs)


def _typed_by_specs(args: tuple[Any, ...], in_specs: Any, mesh: Any) -> tuple[Any, ...]:
    """The arguments typed by ``in_specs`` where the mesh has Explicit axes (JAX's default), else as given.

    On Explicit axes an array's type carries its layout and JAX types every op from it: arrays placed so
    (``jax.device_put`` or ``einshard``) trace as that typed program, and so must ``explain(in_specs=)``, or it would
    price the untyped program (one XLA lays out by propagation, as on Auto axes).  Shapes only: nothing is placed.
    """
    found = resolve_mesh(mesh, args, what="explain()", check_operands=False, required=False)
    if not isinstance(found, jax.sharding.Mesh) or not explicit_axes(found):
        return args
    leaves, tree = jax.tree_util.tree_flatten(args)
    layouts = arg_layouts(args, in_specs, mesh_axes(found))
    typed = [
        jax.ShapeDtypeStruct(lay.shape, leaf.dtype, sharding=jax.sharding.NamedSharding(found, lay.to_spec()))
        if hasattr(leaf, "dtype") and hasattr(leaf, "shape")
        else leaf
        for leaf, lay in zip(leaves, layouts, strict=True)
    ]
    return tuple(jax.tree_util.tree_unflatten(tree, typed))


def _trace_typed(
    fn: Callable[..., Any],
    typed: tuple[Any, ...],
    untyped: tuple[Any, ...],
    mesh: Any,
    profile: Any,
    kwargs: dict[str, Any],
) -> TracedProgram:
    """``fn`` traced on arguments typed by in_specs; where JAX refuses that typed program but runs the untyped
    one, an error that says so (JAX's own refusal is what running it with arrays placed so would raise)."""
    try:
        return trace(fn, *typed, mesh=mesh, profile=profile, **kwargs)
    except PlacementRefused as refused:
        err = refused.jax_error  # the typed arguments are placed as in_specs= asks: say it of in_specs=
    except EinshardError:
        raise
    except Exception as raised:
        try:
            trace(fn, *untyped, mesh=mesh, profile=profile, **kwargs)
        except Exception:
            raise raised from None  # fn fails whatever the layout: the user's own error, as JAX raised it
        err = raised
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    raise EinshardError(
        "explain(): on this mesh's Explicit axes JAX refuses fn with its arguments typed by in_specs= (as "
        f"arrays placed so would be typed): {type(err).__name__}: {first}",
        hint="Fix the op JAX names (reshard inside fn, or wrap it in jax.sharding.auto_axes), or explain it "
        "on a mesh with Auto axes (jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n)).",
    ) from None


class TracedProgram:
    """A function traced once, to be costed under many argument layouts (what the planner needs).

    ``explain(fn, *args, in_specs=s)`` is ``trace(fn, *args).report(s)``; a
    TracedProgram also remembers what each einsum and each layout change cost,
    so re-costing under thousands of layouts walks the jaxpr without
    re-analysing the einsums it has already seen.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from einshard._src.analysis.program import trace
        >>> w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
        >>> x = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        >>> t = trace(lambda w, x: x @ w, w, x, mesh={'data': 4, 'model': 2})
        >>> dp = t.report(('d f -> d f', 'b d -> b@data d'))
        >>> tp = t.report(('d f -> d f@model', 'b d -> b d'))
        >>> dp.comm_bytes == tp.comm_bytes == 0 and tp.flops == 2 * dp.flops
        True
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        mesh_axes: tuple[MeshAxis, ...],
        costs: OpCosts,
        kwargs: dict[str, Any],
    ) -> None:
        start = time.perf_counter()
        self.args = args
        self.mesh = mesh_axes
        self.costs = costs
        self.explicit: Any = None  # an ExplicitReport where JAX refused the program as written
        try:
            closed, self.out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        except Exception as err:
            if not _is_sharding_type_error(err):
                _raise_if_refused_for_placement(fn, args, kwargs, err)
                raise
            # On Explicit axes JAX refuses an ambiguous op while tracing: cost the program as JAX types it once
            # the check's fixes are applied, and carry the check's findings (each op, its line, its fixes).
            from ..explicit import explicit_check

            self.explicit, typed, self.out_shape = explicit_check(
                fn,
                args,
                kwargs,
                mesh={m.name: m.size for m in mesh_axes} if _no_devices(args) else None,
                profile=costs.profile,
            )
            if typed is None:
                raise EinshardError(f"explain(): {self.explicit}") from None
            closed = typed
        # The program that is one jit call (the user's jitted step): its body, its shardings the program's own
        # argument and output layouts (:func:`.inline.sole_call`).
        jaxpr = closed.jaxpr
        sole = sole_call(jaxpr)
        self.call_specs: tuple[tuple[Any, ...], tuple[Any, ...]] = ((), ())
        if sole is not None:
            jaxpr, *specs = sole
            self.call_specs = (specs[0], specs[1])
        # (nested jit calls inlined, as XLA inlines them before its propagation: :mod:`.inline`)
        self.jaxpr = _dead_code_eliminated(inlined_calls(jaxpr))
        self._fn, self._kwargs = fn, kwargs
        self._naming: tuple[dict[Any, str], dict[int, tuple[str, str]]] | None = None
        # Peak memory's flattening and liveness, reused between costings (None: each costing makes its own).
        self.peak_cache: PeakCache | None = PeakCache()
        self.trace_s = time.perf_counter() - start

    @functools.cached_property
    def peak_note(self) -> str:
        """What peak memory cannot bound tightly in this program (:func:`.memory.peak_caveat`): the same in
        every costing, so found once."""
        return peak_caveat(self.jaxpr)

    @property
    def naming(self) -> tuple[dict[Any, str], dict[int, tuple[str, str]]]:
        """Each value's name in the user's words (argument paths) and each equation's source line: what the
        report's ops say they read and where they are (computed once, on the first report)."""
        if self._naming is None:
            from ..explicit import value_names

            self._naming = value_names(self.jaxpr, self._fn, self.args, self._kwargs, self.mesh)
        return self._naming

    @property
    def rules(self) -> OpCosts:
        """The memoised per-op costs (the name the planner reads)."""
        return self.costs

    def report(
        self,
        in_specs: Any = None,
        out_specs: Sequence[Any] | None = None,
        walker: Walker | None = None,
        forks: int | None = None,
    ) -> ProgramReport:
        """The :class:`ProgramReport` under ``in_specs`` (as ``explain``'s; None: the arguments' own shardings).

        ``out_specs``: optionally, one PartitionSpec (or None: as computed) per output leaf, as
        ``jax.jit(out_shardings=...)`` would ask: the output is brought there (its collective
        counted) and held that way (peak bytes).  The planner returns gradients laid out
        like their parameters, as FSDP training steps do.

        ``walker``: a fresh :class:`~.walker.Walker` (or subclass) over this program's ``costs`` to walk
        with, for a caller that wants more from the walk than the report (the planner's
        :class:`~einshard.planner.combining.DependencyWalker` also follows which collectives each
        value depends on); default a plain ``Walker``.  The program's end is stepped as an
        equation named ``output`` whose ``invars`` are the output being brought to its layout.

        ``forks``: how many of the approximate ops whose rule knows XLA's other choice are walked again under it,
        to bound what that choice changes downstream (None: ``alternatives.MAX_FORKS``; 0 for a caller that ranks
        many layouts by their costs and reads no bound: the report then says its bounds are local).
        """
        start = time.perf_counter()
        in_specs, out_specs = self._with_call_specs(in_specs, out_specs)
        in_layouts = arg_layouts(self.args, in_specs, self.mesh)
        if walker is None:
            walker = Walker(self.costs)
        elif walker.ops or walker.costs is not self.costs:
            raise EinshardError("TracedProgram.report(walker=...): pass a fresh walker over this program's costs")
        opened = open_values(self.costs, self.jaxpr)
        plan = walker._segment_plan(self.jaxpr)
        outputs = frozenset(id(v) for v in self.jaxpr.outvars if not hasattr(v, "val"))
        splits: dict[int, Any] = {}
        unsettled = 0
        for walks in range(1, MAX_WALKS + 1):
            # XLA's propagation runs to a fixed point: the program is walked again with its open values moved to the
            # splits their readers hand them, until a walk finds nothing new (:mod:`.open_values`).  A walk that
            # meets such a reader stops there (the last may not: it is the one reported).
            if walks > 1:
                type(walker).__init__(walker, self.costs)
                self.costs.counts.rewalks += 1
            self.costs.counts.segment_replays_before = self.costs.counts.segment_replays
            walker.open_splits = splits
            # (a repeated stretch making a value moved so keys its tapes by those splits, by the values' tokens)
            walker.open_copies = _open_in_copies(plan, splits)
            walker.open_at = opened.at
            walker.open_shared = opened.shared
            walker.open_stop = walks < MAX_WALKS
            walker.open_fixed = opened.fixed
            try:
                layouts, outs = self._walk(walker, in_layouts, out_specs)
            except Reopened as stopped:
                # (the walk stopped in the program's own jaxpr: its environment is the walker's)
                found = spread_back(opened, stopped.found, walker.env, walker.open_natural)
                splits = {**splits, **{i: d for i, d in found.items() if i not in splits}}
                continue
            # A walk that met no reader handing a value a split it was not given, stepped or replayed
            # (Walker.open_met), found nothing new: asking every reader of the program again would find nothing.
            met = walker.open_met
            found = found_splits(opened, layouts, walker.open_natural) if opened.readers and met else {}
            # Splits only add up, as Shardy's propagation only adds mesh axes: a value a walk gave a split makes
            # its readers' results split as it is, which then hand nothing new (a value given two splits keeps
            # the first).
            new = {i: d for i, d in found.items() if i not in splits}
            if not new:
                break
            if settled_in_place(opened, new, layouts, self.costs.uses_of(self.jaxpr), outputs):
                # (values only their readers' slices read: laid out there, as a walk given them would leave them)
                for v in _values_of(opened, new):
                    layouts[v] = walker.relayout(v.aval, new[id(v)])
                break
            splits = {**splits, **new}
            unsettled = len(new) if walks == MAX_WALKS else 0  # (the last walk found more than it was given)
        if out_specs is not None:
            for v, lay, spec in zip(self.jaxpr.outvars, outs, out_specs):
                if spec is None or hasattr(v, "val") or not getattr(v.aval, "shape", ()):
                    continue
                entries = list(spec) + [None] * (len(v.aval.shape) - len(spec))
                dst = walker.relayout(
                    v.aval, [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries]
                )
                if not is_free(lay):
                    walker.change(_Output((v,)), "backward", lay, dst, v.aval.dtype, 1, "output layout")
                layouts[v] = dst
        for v, lay in zip(self.jaxpr.outvars, outs):
            if lay.unreduced and layouts.get(v) is lay:
                # An output left as a pending sum: the program returns it whole.
                done = lay.with_dims(lay.dims, frozenset())
                walker.change(_Output((v,)), "backward", lay, done, v.aval.dtype, 1, "output is a pending sum")
                layouts[v] = done
        # Gathered copies of arguments (an FSDP weight) are not added: XLA holds them from its early
        # all-gathers to the argument's last use (measured on the corpus: the FSDP ratios are 0.94-1.12 with
        # them, 0.45-0.81 without), but the planner's FSDP memory budget is built on the sharded figure
        # (tests/test_planner.py); see docs/analysis.md.
        profile = self.costs.profile
        peak = _peak_bytes(
            self.jaxpr,
            layouts,
            walker.sub_envs,
            tiling=profile.tiling,
            cache=self.peak_cache,
            reduce_scatter=profile.reduce_scatter,
        )
        # A ranking costing (forks=0: the planner's) reads what the ops sum to, not the ops: a replayed stretch's
        # stay unmade until someone reads them (OpLog); a report for a reader lists them all.
        ops: Sequence[OpReport] = walker.ops if forks == 0 else tuple(walker.ops)
        phases = _phase_totals(walker.ops.costs())
        report = ProgramReport(
            explicit=self.explicit,
            ops=ops,
            flops=sum(t["flops"] for t in phases.values()),
            comm_bytes=sum(t["bytes"] for t in phases.values()),
            comm_count=int(sum(t["count"] for t in phases.values())),
            peak_bytes=peak,
            time_s=sum(t["time_s"] for t in phases.values()),
            phases=phases,
            unfollowed=tuple(sorted(walker.unfollowed)),
            mesh=self.mesh,
            profile=self.costs.profile,
            analysis_s=time.perf_counter() - start,
            unfollowed_at=tuple(
                f"{name} at {', '.join(sites)}" for name, sites in sorted(walker.unfollowed_at.items())
            ),
            peak_note=self.peak_note,
            unsettled=unsettled,
            output_dims=tuple(_returned_dims(v, layouts) for v in self.jaxpr.outvars),
        )
        if self.costs.forced:
            return report  # a fork's report: compared by alternatives.widen, never widened itself
        report = widen(report, lambda forced: self._fork(forced, in_specs, out_specs), forks)
        return dataclasses.replace(report, analysis_s=time.perf_counter() - start)

    def _walk(
        self, walker: Walker, in_layouts: list[Layout], out_specs: Sequence[Any] | None
    ) -> tuple[dict[Any, Layout], list[Layout]]:
        """One walk of the program: its values' layouts, and its outputs'."""
        walker.value_names, walker.eqn_where = self.naming
        layouts: dict[Any, Layout] = {}
        for v, spec in zip(self.jaxpr.outvars, out_specs or ()):
            rank = len(getattr(v.aval, "shape", ()))
            if spec is not None and not hasattr(v, "val") and rank:
                entries = list(spec) + [None] * (len(v.aval.shape) - len(spec))
                walker.requested[id(v)] = tuple(
                    () if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries
                )
        return layouts, walker.walk(self.jaxpr, in_layouts, 1, None, env=layouts)

    def _with_call_specs(self, in_specs: Any, out_specs: Sequence[Any] | None) -> tuple[Any, Sequence[Any] | None]:
        """``in_specs`` and ``out_specs``, or where the caller gives none and the program is a jit call naming its
        shardings (:attr:`call_specs`), those: an argument without a sharding of its own (a ShapeDtypeStruct)
        takes the call's ``in_shardings``, and the outputs the call's ``out_shardings``, as XLA compiles them."""
        call_in, call_out = self.call_specs
        if in_specs is None and any(s is not None for s in call_in):
            leaves, tree = jax.tree_util.tree_flatten(self.args)
            if len(leaves) == len(call_in):
                own = [getattr(_sharding_of(x), "spec", None) for x in leaves]
                specs = [c if o is None else o for o, c in zip(own, call_in)]
                in_specs = jax.tree_util.tree_unflatten(tree, specs)
        if out_specs is None and any(s is not None for s in call_out):
            out_specs = list(call_out)
        return in_specs, out_specs

    def _fork(self, forced: frozenset[int], in_specs: Any, out_specs: Sequence[Any] | None) -> ProgramReport:
        """The report of a walk in which the marked ops ``forced`` take XLA's other choice (see :mod:`.alternatives`)."""
        self.costs.forced = forced
        try:
            return self.report(in_specs, out_specs)
        finally:
            self.costs.forced = frozenset()


def _returned_dims(v: Any, layouts: Mapping[Any, Layout]) -> tuple[tuple[str, ...], ...]:
    """The split an output ``v`` of the program is returned in (whole: a literal, a value laid out nowhere)."""
    found = None if hasattr(v, "val") else layouts.get(v)
    if found is None or is_free(found):
        return ((),) * len(getattr(v.aval, "shape", ()))
    return found.dims


def _values_of(opened: Any, ids: Mapping[int, Any]) -> list[Any]:
    """The values (jaxpr variables) of ``ids``, as their makers hold them."""
    return [v for i in ids if (e := opened.made_by.get(i)) is not None for v in e.outvars if id(v) == i]


def _open_in_copies(plan: Any, splits: Mapping[int, Any]) -> dict[int, tuple[Any, ...]]:
    """Per copy of a repeated stretch (by start) that makes a value of ``splits``: those values' tokens in the copy
    and splits, in a fixed order (the copies of a run whose values are moved alike key alike)."""
    out: dict[int, list[Any]] = {}
    if splits:
        starts = sorted(plan.copies)
        for i, dims in splits.items():
            p = plan.made_at.get(i)
            if p is None:
                continue
            k = bisect.bisect_right(starts, p) - 1
            copy = plan.copies[starts[k]] if k >= 0 else None
            if copy is not None and p < copy.stop:
                out.setdefault(copy.start, []).append((copy.tokens[i], dims))
    return {start: tuple(sorted(found)) for start, found in out.items()}


def _phase_totals(terms: Iterable[CostTerms]) -> dict[str, dict[str, float]]:
    """Per phase, the ops' flops, bytes sent, collectives and time (each repeat counted), summed in program order.

    ``terms``: each op's :func:`.oplog.cost_terms` (a replayed stretch's made once per tape: OpLog.costs).  A deep
    model's report has thousands of ops per costing: each phase's running sums are kept in a list (four additions
    per op, the terms and order of ``op.comm_bytes`` and a dict per phase: the same totals to the bit), not read
    and written back through a dict by name."""
    sums: dict[str, list[float]] = {}
    for phase, flops, sent, count, time_s, communicates in terms:
        tot = sums.get(phase)
        if tot is None:
            tot = sums[phase] = [0.0, 0.0, 0.0, 0.0]
        tot[0] += flops
        if communicates:  # (an op without any adds 0 to either: the sum as it was)
            tot[1] += sent
            tot[2] += count
        tot[3] += time_s
    return {phase: dict(zip(("flops", "bytes", "count", "time_s"), tot)) for phase, tot in sums.items()}


def _is_sharding_type_error(err: BaseException) -> bool:
    from jax._src.core import ShardingTypeError

    return isinstance(err, ShardingTypeError)


def _unplaced(leaf: Any) -> Any:
    """An argument leaf as a shape and dtype alone, without the sharding it carries (other leaves as they are)."""
    if getattr(leaf, "sharding", None) is None or not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
        return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)


class PlacementRefused(EinshardError):
    """JAX refuses fn on its arguments as placed, before any sharding rule, and takes it on them unplaced."""

    def __init__(self, message: str, jax_error: BaseException) -> None:
        super().__init__(
            message,
            hint="Place the arguments the way fn needs (e.g. a lax.scan's scanned axis whole: "
            "jax.sharding.reshard(x, P(None, ...)) before the scan), or explain with in_specs= on unplaced arrays.",
        )
        self.jax_error = jax_error


def _raise_if_refused_for_placement(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], err: BaseException
) -> None:
    """An EinshardError where JAX refuses ``fn`` on the arguments as they are placed (a ``lax.scan`` over a split
    leading axis, say: JAX checks that before any sharding rule, with a plain ValueError) but traces it on the same
    shapes unplaced: the refusal is the placement's, so say which (fn's own errors propagate as JAX raised them)."""
    placed = [
        f"{jax.tree_util.keystr(path)}: {leaf.sharding.spec}"
        for path, leaf in jax.tree_util.tree_leaves_with_path(args)
        if isinstance(getattr(leaf, "sharding", None), jax.sharding.NamedSharding)
        and any(entry is not None for entry in leaf.sharding.spec)
    ]
    if not placed:
        return
    try:
        jax.make_jaxpr(fn)(*jax.tree_util.tree_map(_unplaced, args), **kwargs)
    except Exception:
        return  # fn fails whatever the placement: the user's own error, as JAX raised it
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    shown = ", ".join(placed[:4]) + (f" and {len(placed) - 4} more" if len(placed) > 4 else "")
    raise PlacementRefused(
        "explain(): JAX refuses fn on the arguments as they are placed (it traces on the same shapes unplaced): "
        f"{type(err).__name__}: {first}. The split arguments: {shown}",
        err,
    ) from None


def _no_devices(args: tuple[Any, ...]) -> bool:
    """Whether the arguments carry no concrete mesh (shape-only), so the check is given the mesh's sizes."""
    return not any(
        isinstance(getattr(getattr(x, "sharding", None), "mesh", None), jax.sharding.Mesh)
        for x in jax.tree_util.tree_leaves(args)
    )


class _Output:
    """Stands for the program's end where an output (``invars``) is brought to its requested layout."""

    class primitive:  # noqa: N801 (mimics a jaxpr equation)
        name = "output"

    def __init__(self, invars: tuple[Any, ...]) -> None:
        self.invars = invars


def trace(fn: Callable[..., Any], *args: Any, mesh: Any = None, profile: Any = None, **kwargs: Any) -> TracedProgram:
    """Trace ``fn(*args, **kwargs)`` once for costing under many layouts (see :class:`TracedProgram`)."""
    mesh_axes = _mesh_of(mesh, args)
    return TracedProgram(fn, args, mesh_axes, OpCosts(mesh_axes, profile), kwargs)


def _dead_code_eliminated(jaxpr: Any) -> Any:
    """The jaxpr without values no output needs (a gradient's jaxpr still computes the primal loss).

    XLA drops that work too, so counting it would predict collectives XLA never runs.
    """
    try:
        from jax._src.interpreters import partial_eval as pe

        pruned, used_inputs = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    except Exception:  # internal API: analyse the whole jaxpr if it moved
        return jaxpr
    if not all(used_inputs):
        # Keep the signature: unused inputs stay as inputs.
        pruned = pruned.replace(invars=jaxpr.invars) if hasattr(pruned, "replace") else jaxpr
    return pruned
