"""``einshard.einsum``: run an annotated einsum as the explicit program its plan describes.

The analyzer (:func:`einshard.analyze`) decides which collectives an einsum
needs; this module turns that :class:`~einshard.analysis.EinsumPlan` into
:class:`~einshard.lowering.steps.Step`\\ s and runs them in one
``jax.shard_map`` (:func:`~einshard.lowering.shard_einsum.einsum_shard_map`), so the
program that runs is the plan that was explained — there is no second
derivation of the collectives here.

Each collective of the plan carries the tensor's layout before and after it;
the step is read off that difference.  The free local slices the plan takes
between collectives (a replicated operand cut to match its partner) are read
off the same way, as ``dynamic-slice`` steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from .._caches import register
from .._checks import check_dtype, check_precision, describe_value
from .._compat import native_unreduced
from ..analysis import EinsumPlan, analyze
from ..analysis.cost import Collective
from ..analysis.einsum.analyze import Operand
from ..core.collectives import Target, reorder_pairs
from ..core.layout import Layout
from ..core.logical import AxisRules, AxisRulesLike, current_axis_rules, resolve_text
from ..core.mesh import AnyMesh, MeshLike
from ..core.moves import drop_trivial
from ..errors import EinshardError
from .padding import Padding, pad_operands, plan_padding, unpad_result
from .placing import lowering_mesh
from .shard_einsum import einsum_auto, einsum_shard_map
from .steps import Step

__all__ = ["einsum", "lower", "EinsumProgram", "plan_steps", "runs_exactly"]

MODES = ("sync", "async", "auto")


def _slices(cur: Layout, target: Layout, operand: Target) -> list[Step]:
    """The free local slices the plan takes between two collectives on one tensor: ``cur`` to ``target``.

    The analyzer records collectives only (a slice moves no data); between two of
    them a tensor can only be split further, each device keeping its own block.
    Anything else would need communication the plan does not list, so it is a bug.
    """
    cur, target = drop_trivial(cur), drop_trivial(target)
    steps = []
    for d, (have, want) in enumerate(zip(cur.dims, target.dims, strict=True)):
        if have == want:
            continue
        if want[: len(have)] != have:
            raise EinshardError(
                f"internal: the plan takes {cur} to {target} between two collectives without communication; "
                "please report this einsum"
            )
        steps.append(Step("dynamic-slice", operand, want[len(have) :], dim=d))
    return steps


def _runs(c: Collective) -> bool:
    """Whether the lowering runs this collective exactly as planned.

    A split re-grouped onto *fewer* devices (``c@y -> c@x`` with ``|x|`` dividing ``|y|``)
    is priced as XLA runs it: a permute, then a gather over a *factor* of a mesh axis.
    A shard_map names whole mesh axes only, so such a plan is not run (an alternative is).
    Re-grouping onto as many or more devices is one permute of blocks or pieces of them.
    """
    try:
        steps = c.steps
    except EinshardError:
        return False
    if c.before is None:
        return True
    sizes = c.before.mesh_sizes
    for s in steps:
        if s.reorder is not None:
            try:
                reorder_pairs(s.mesh_axes, sizes, *s.reorder)
            except ValueError:
                return False
        elif math.prod(sizes[m] for m in s.mesh_axes) != c.group_size and s.kind != "dynamic-slice":
            return False
    return True


def runs_exactly(plan: EinsumPlan) -> bool:
    """Whether :func:`lower` runs this plan's collectives exactly as listed (else it runs an alternative).

    Not run: a split regrouped onto fewer devices (:func:`_runs`); pending sums an operand
    brings carried through the local einsum (JAX computes on an unreduced value only by
    reducing it); and a permute over a mesh axis the result is replicated over (its blocks
    are equal over that axis, but a ppermute's result is typed as varying there, which a
    replicated out_spec refuses under ``check_vma``).
    """
    carried = any(g.unreduced & u.unreduced for g, u in zip(plan.operands, plan.operands_used, strict=True))
    varying = plan.out_layout.sharded_mesh_axes | plan.out_layout.unreduced
    sizes = plan.out_layout.mesh_sizes
    replicated_permute = any(
        c.kind == "collective-permute" and any(sizes[m] > 1 and m not in varying for m in c.axes)
        for c in plan.collectives
    )
    return not carried and not replicated_permute and all(_runs(c) for c in plan.collectives)


def _runnable(plan: EinsumPlan) -> EinsumPlan:
    """The plan itself if the lowering runs each of its collectives exactly, else the cheapest that it does.

    Splits regrouped onto fewer devices (:func:`_runs`) are not run, nor pending sums an operand brings
    carried through the local einsum (JAX refuses to compute on an unreduced value;
    it is reduced first).  ``program.plan`` is the plan that runs, and lists the
    analyzer's first choice among its alternatives.
    """

    whole = runs_exactly
    if whole(plan):
        return plan
    # Same result layout first; for an inferred (unrequested) output, any complete one.
    for same_layout in (True, False):
        for alt in plan.alternatives:
            if whole(alt) and _delivers_alike(alt, plan) and (alt.out_layout == plan.out_layout or not same_layout):
                return _with_alternatives(alt, plan)
    raise EinshardError(f"einshard.einsum found no plan for {plan.expression} that it can run exactly")


# A chosen ('?') result is delivered complete: all-reduced as computed, or reduce-scattered onto an output axis.
_COMPLETE_RESOLUTIONS = frozenset({"complete", "reduce-scatter"})


def _delivers_alike(alt: EinsumPlan, plan: EinsumPlan) -> bool:
    """Whether ``alt`` delivers what ``plan`` was asked for: the requested layout, the pending sums, or (for a
    chosen result) a complete result in any layout."""
    if plan.resolution in _COMPLETE_RESOLUTIONS:
        return alt.resolution in _COMPLETE_RESOLUTIONS
    return alt.resolution == plan.resolution


def _with_alternatives(chosen: EinsumPlan, best: EinsumPlan) -> EinsumPlan:
    import dataclasses

    others = tuple(p for p in (best, *best.alternatives) if p is not chosen)
    return dataclasses.replace(chosen, more=lambda: others)


def local_sums(plan: EinsumPlan) -> dict[int, Layout]:
    """The operands the plan sums locally before moving them (their lone-reduced axes), as summed.

    XLA does this (``sum_z x[b, z@m]`` becomes partial sums of ``x[b]`` before any
    communication, which then moves the smaller array); the first collective on such
    an operand starts from the summed layout.
    """
    out: dict[int, Layout] = {}
    for i, (given, used) in enumerate(zip(plan.operands, plan.operands_used, strict=True)):
        if given.axes != used.axes:
            keep = [d for d, a in enumerate(given.axes) if a in used.axes]
            pending = frozenset(m for d, a in enumerate(given.axes) if a not in used.axes for m in given.dims[d])
            out[i] = drop_trivial(
                Layout(
                    tuple(given.axes[d] for d in keep),
                    tuple(given.shape[d] for d in keep),
                    given.mesh,
                    tuple(given.dims[d] for d in keep),
                    given.unreduced | pending,
                )
            )
    return out


def plan_steps(plan: EinsumPlan) -> tuple[list[Step], list[Step]]:
    """The plan's collectives as the steps that run: (on the operands, on the result).

    Each collective records its tensor (operand position or ``'out'``), dimension
    and mesh axes, and runs as its :attr:`~einshard.analysis.cost.Collective.steps`;
    the free local slices the plan takes between them are added as ``dynamic-slice``
    steps.  No collective is added that the plan does not list.

    Example:
        >>> import einshard
        >>> plan = einshard.analyze('b x@m, x@m y -> b y', mesh={'m': 2}, sizes={'b': 4, 'x': 6, 'y': 8})
        >>> before, after = plan_steps(plan)
        >>> [str(s) for s in after]
        ['all-reduce[m](out)']
    """
    summed = local_sums(plan)

    def run(start: Layout, target: Layout, operand: Target) -> list[Step]:
        steps: list[Step] = []
        cur = start
        for c in plan.collectives:
            if c.operand != operand:
                continue
            assert c.before is not None and c.after is not None  # the analyzer records both
            steps += _slices(cur, c.before, operand)
            steps += c.steps
            cur = c.after
        return steps + _slices(cur, target, operand)

    before: list[Step] = []
    for i, (given, used) in enumerate(zip(plan.operands, plan.operands_used, strict=True)):
        before += run(summed.get(i, drop_trivial(given)), used, i)
    return before, run(drop_trivial(plan.computed_layout), plan.out_layout, "out")


@dataclass(frozen=True)
class EinsumProgram:
    """An einsum lowered for a mesh: call it with the operands.

    Attributes:
        plan: the analyzer's plan it runs (collectives, costs, alternatives).
        mode: ``'sync'``, ``'async'`` (collective matmul rings) or ``'auto'`` (XLA decides).
        steps_before, steps_after: the explicit steps on the operands and the result.
        fn: the function (not jitted: it composes with ``jax.jit``, ``jax.grad``, ``jax.vmap``).
        padding: how uneven splits were zero-padded (None when every split is even);
            the plan is then the padded einsum's.
    """

    plan: EinsumPlan
    mode: str
    steps_before: tuple[Step, ...]
    steps_after: tuple[Step, ...]
    fn: Callable[..., jax.Array]

    padding: Padding | None = None
    mesh: AnyMesh | None = None

    def __call__(self, *operands: Any) -> jax.Array:
        return self.fn(*operands)

    # jax.jit(program) hashes the callable; the plan holds dicts, so a field-wise hash fails.  A program is
    # one compiled function: identity is its hash (equal programs run the same computation anyway).
    __hash__ = object.__hash__

    @property
    def partials_axis(self) -> bool:
        """Whether pending sums come back on a leading axis of per-device partial values (``.sum(0)`` reduces).

        False when the result has none, or when it is a JAX ``unreduced`` array (a mesh
        whose axes are all Explicit, on a JAX with ``PartitionSpec(unreduced=...)``:
        :func:`einshard._compat.native_unreduced`).
        """
        return bool(self.plan.out_layout.unreduced) and self.mode != "auto" and not native_unreduced(self.mesh)

    def complete(self, y: jax.Array) -> jax.Array:
        """The result with its pending sums reduced (itself when it has none)."""
        if not self.plan.out_layout.unreduced:
            return y
        if self.partials_axis:
            return y.sum(0)
        spec = PartitionSpec(*self.plan.out_layout.spec_entries())
        return jax.sharding.reshard(y, spec if self.mesh is None else NamedSharding(self.mesh, spec))

    @property
    def program(self) -> str:
        """What runs, one line per step (the ring that replaces a step in ``'async'`` mode included)."""
        own = getattr(self.fn, "program", None)
        if own is not None:
            return str(own) if not isinstance(own, (list, tuple)) else "\n".join(str(x) for x in own)
        lines = [str(s) for s in self.steps_before]
        lines.append(f"local einsum ({self.mode})")
        lines += [str(s) for s in self.steps_after]
        return "\n".join(lines)


def _padding(expr: str, operands: Sequence[Any], mesh: AnyMesh) -> Padding | None:
    """The zero padding uneven splits need, or None (also for jnp-style strings, which carry no layout)."""
    if "@" not in expr or not operands or any(not hasattr(x, "shape") for x in operands):
        return None
    pad = plan_padding(expr, [tuple(x.shape) for x in operands], mesh)
    return pad if pad.needed else None


def _check_options(mode: Any, two_way: Any) -> None:
    if mode not in MODES:
        raise EinshardError(f"mode= must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    if not isinstance(two_way, bool):
        raise EinshardError(f"two_way= is True or False, got {two_way!r}")
    if two_way and mode != "async":
        raise EinshardError(
            f"two_way=True makes the collective-matmul rings bidirectional, but mode={mode!r} runs no ring",
            hint="Use mode='async' with two_way=True.",
        )


def lower(
    expr: str,
    *operands: Any,
    mode: str = "sync",
    mesh: MeshLike | None = None,
    two_way: bool = False,
    profile: Any = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    axis_rules: AxisRulesLike | None = None,
    _what: str | None = None,
) -> EinsumProgram:
    """Analyse ``expr`` for these operands (arrays or ``ShapeDtypeStruct``s) and lower its plan.

    Example:
        >>> import jax, numpy as np, einshard
        >>> mesh = jax.make_mesh((2,), ('m',), axis_types=(jax.sharding.AxisType.Auto,))
        >>> x, w = np.ones((4, 6), np.float32), np.ones((6, 8), np.float32)
        >>> prog = einshard.lower('b x@m, x@m y -> b y', x, w, mesh=mesh)
        >>> print(prog.program)
        einsum ab,bc->ac
        all-reduce[m](out)
        >>> float(prog(x, w)[0, 0])
        6.0
    """
    where = "einshard.lower" if _what is None else _what
    if not isinstance(expr, str):
        raise EinshardError(f"{where}: expr= takes an einsum expression (a string), got {describe_value(expr)}")
    _check_options(mode, two_way)
    check_precision(precision, where)
    check_dtype(preferred_element_type, where, "preferred_element_type")
    mesh = lowering_mesh(mesh, operands, what=where)
    # Logical names (b@batch) become mesh axes here, once: the program cache and the analysis see mesh axes.
    rules = AxisRules.of(axis_rules) if axis_rules is not None else current_axis_rules()
    expr = resolve_text(expr, [str(n) for n in mesh.axis_names], rules)
    # Repeated calls (eager einsums in a loop, a model's layers) reuse one program, so JAX's
    # caches (keyed on the function) compile it once.  The key is what the plan depends on.
    key = (
        expr,
        tuple(Operand.of(x) for x in operands),
        mode,
        mesh,
        two_way,
        profile,
        precision,
        preferred_element_type,
    )
    try:
        hash(key)
    except TypeError:
        return _lower_on(expr, operands, mode, mesh, two_way, profile, precision, preferred_element_type)
    return _lower_cached(key, operands)


_PROGRAMS: dict[tuple[Any, ...], EinsumProgram] = {}
register(_PROGRAMS.clear)


def _lower_cached(key: tuple[Any, ...], operands: Sequence[Any]) -> EinsumProgram:
    program = _PROGRAMS.get(key)
    if program is None:
        expr, _, mode, mesh, two_way, profile, precision, pet = key
        program = _lower_on(expr, operands, mode, mesh, two_way, profile, precision, pet)
        if len(_PROGRAMS) >= 1024:  # bounded, oldest first
            _PROGRAMS.pop(next(iter(_PROGRAMS)))
        _PROGRAMS[key] = program
    return program


def _lower_on(
    expr: str,
    operands: Sequence[Any],
    mode: str,
    mesh: AnyMesh,
    two_way: bool,
    profile: Any,
    precision: Any,
    preferred_element_type: Any,
) -> EinsumProgram:
    padding = _padding(expr, operands, mesh)
    if padding is not None:
        # Zero padding is exact for an einsum: pad the uneven splits, run, cut the result back.
        shaped = [jax.ShapeDtypeStruct(s, jnp.result_type(x)) for s, x in zip(padding.padded_shapes, operands)]
        inner = lower(
            expr,
            *shaped,
            mode=mode,
            mesh=mesh,
            two_way=two_way,
            profile=profile,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )

        def padded(*ops: Any) -> jax.Array:
            return unpad_result(padding, inner.fn(*pad_operands(padding, ops)))

        return EinsumProgram(inner.plan, mode, inner.steps_before, inner.steps_after, padded, padding, mesh)
    plan = _runnable(analyze(expr, *operands, mesh=mesh, profile=profile))
    if mode == "auto":
        # Runs eagerly on Explicit meshes and composes with the caller's jit/grad/vmap (einsum_auto).
        auto = einsum_auto(
            plan.operands,
            plan.out_layout,
            mesh=mesh,
            precision=precision,
            preferred_element_type=preferred_element_type,
        )
        return EinsumProgram(plan, mode, (), (), auto, None, mesh)
    before, after = plan_steps(plan)
    fn = einsum_shard_map(
        tuple(drop_trivial(op) for op in plan.operands),
        drop_trivial(plan.out_layout),
        before,
        after,
        local_sums=local_sums(plan),
        mesh=mesh,
        mode=mode,
        two_way=two_way,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return EinsumProgram(plan, mode, tuple(before), tuple(after), fn, None, mesh)


def einsum(
    expr: str,
    *operands: Any,
    mode: str = "sync",
    mesh: MeshLike | None = None,
    two_way: bool = False,
    profile: Any = None,
    precision: Any = None,
    preferred_element_type: Any = None,
    axis_rules: AxisRulesLike | None = None,
) -> jax.Array:
    """Compute an einsum with the operands laid out as the expression says, as an explicit program.

    ``'b x@data, x y@model -> b y@model'``: the operands are placed as written
    (numpy arrays, arrays on another layout and tracers alike), the analyzer's
    plan is run as a ``jax.shard_map`` with explicit collectives, and the result
    comes back laid out as the output side says (with ``-> b? y?``, as the analyzer chooses:
    a complete result).  Pending sums (``-> b y {U:model}``) come back as a JAX
    ``unreduced`` array on a mesh whose axes are all Explicit (pass it to the next
    einsum, which reduces it once, or ``jax.sharding.reshard`` it to a plain spec);
    elsewhere as per-device partial values on a new leading axis split over those
    mesh axes, which ``.sum(0)`` finishes (``lower(...).complete(y)`` does either).

    Args:
        mode: ``'sync'`` (plain collectives), ``'async'`` (the gather feeding the
            contraction, or the result's reduce-scatter, as a collective-matmul
            ring of ``ppermute``\\ s), or ``'auto'`` (XLA decides; the baseline).
        two_way: bidirectional rings in ``'async'`` mode.
        mesh: a ``jax.sharding.Mesh``; default the current mesh (``jax.set_mesh``), else the
            operands' mesh (also under ``jax.jit``, from their types) — see :mod:`einshard.core.mesh`.
        axis_rules: a table from logical axis names to mesh axes for ``@batch``-style names; default
            the table made current by ``with einshard.axis_rules(...)`` (docs/logical-axes.md).

    Composes with ``jax.jit``, ``jax.grad`` and ``jax.vmap``; gradients come from
    JAX's transposition of the collectives.  ``einshard.lower(...)`` gives the
    program and its plan without running it.

    Example:
        >>> import jax, numpy as np, einshard
        >>> mesh = jax.make_mesh((2,), ('m',), axis_types=(jax.sharding.AxisType.Auto,))
        >>> x, w = np.ones((4, 6), np.float32), np.ones((6, 8), np.float32)
        >>> y = einshard.einsum('b x, x y@m -> b y@m', x, w, mesh=mesh)
        >>> y.shape, float(y[0, 0])
        ((4, 8), 6.0)
    """
    program = lower(
        expr,
        *operands,
        mode=mode,
        mesh=mesh,
        two_way=two_way,
        profile=profile,
        precision=precision,
        preferred_element_type=preferred_element_type,
        axis_rules=axis_rules,
        _what="einshard.einsum",
    )
    return program(*operands)
