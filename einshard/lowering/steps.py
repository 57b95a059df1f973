"""Executable collective steps and the shard_map that runs one sharded einsum.

A :class:`Step` names one collective (or a local slice) applied to one local
block inside the body of a ``jax.shard_map``; :func:`apply_step` runs it.
:func:`einsum_shard_map` builds the whole program for an einsum: steps on the
operands, the local ``jnp.einsum``, steps on the result.  It also tracks each
block's :class:`~einshard.core.layout.Layout` through the steps, so a step list that
would compute the wrong thing (operands split differently on a shared axis, a
result that does not have the requested layout) is rejected with an
:class:`~einshard.errors.EinshardError` before anything runs.

Pending partial sums (``{U:model}`` on the output layout) cannot leave a
shard_map portably (JAX's ``unreduced`` out_specs need Explicit mesh axes and
differ between releases), so they are returned *as per-device partial values*:
the result gets a new leading axis, split over the pending mesh axes, holding
each device group's partial sum; ``result.sum(0)`` is the einsum.

Example:
    >>> import jax, numpy as np
    >>> from einshard.lowering import Step, einsum_shard_map, einsum_layouts
    >>> mesh = jax.make_mesh((2,), ('model',), axis_types=(jax.sharding.AxisType.Auto,))
    >>> ins, out = einsum_layouts('b x, x y@model -> b y@model', [(4, 6), (6, 8)], mesh)
    >>> f = einsum_shard_map(ins, out, mesh=mesh)          # column-parallel: no collective
    >>> x, w = np.ones((4, 6), np.float32), np.ones((6, 8), np.float32)
    >>> float(f(x, w)[0, 0])
    6.0
    >>> ins, out = einsum_layouts('b x@model, x@model y -> b y', [(4, 6), (6, 8)], mesh)
    >>> g = einsum_shard_map(ins, out, steps_after=[Step('all-reduce', 'out', ('model',))], mesh=mesh)
    >>> float(g(x, w)[0, 0])                               # row-parallel: one psum
    6.0
"""

from __future__ import annotations

import math
import string
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.collectives import KINDS, STEP_KINDS, Step, reorder_pairs
from ..core.layout import Layout, MeshAxis, resolve_named
from ..core.mesh import (
    AnyMesh,
    auto_axes,
    current_mesh,
    eagerly_differentiated,
    explicit_axes,
    is_tracer,
    resolve_mesh,
    show_mesh,
)
from ..core.mesh import mesh_axes as _mesh_axes
from ..errors import EinshardError
from ..parsing import AxisItem, Side, parse_einsum, parse_placement

__all__ = [
    "KINDS",
    "STEP_KINDS",
    "Step",
    "apply_step",
    "step_layout",
    "einsum_layouts",
    "einsum_shard_map",
    "einsum_auto",
    "mesh_axes_of",
    "place",
    "restrict_spec",
    "check_lowering_context",
    "lowering_mesh",
]


def _axes(step: Step) -> str | tuple[str, ...]:
    return step.mesh_axes[0] if len(step.mesh_axes) == 1 else step.mesh_axes


def varying_axes(v: Any) -> frozenset[str]:
    """The mesh axes over which a value inside a shard_map body varies (its check_vma type), across JAX releases."""
    t = jax.typeof(v) if not isinstance(v, jax.ShapeDtypeStruct) else v
    found = getattr(t, "vma", None)
    if found is None:
        found = getattr(getattr(t, "manual_axis_type", None), "varying", None)
    return frozenset(found or ())


def vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``x`` typed as varying over ``axes`` too (``pcast``), so values of both kinds meet under check_vma."""
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def ring_size(mesh_axes: Sequence[str]) -> int:
    """The number of devices on the ring over ``mesh_axes`` (inside a shard_map body)."""
    return math.prod(jax.lax.axis_size(a) for a in mesh_axes)


def apply_step(block: jax.Array, step: Step, *, invariant: bool | Collection[str] = False) -> jax.Array:
    """Run one step on this device's block (call inside a ``jax.shard_map`` body).

    ``invariant=True`` makes an all-gather's result typed as the same on every
    device of the ring (``to="invarying"``), which a replicated out_spec needs
    under ``check_vma``; its gradient is then a local slice.  The default
    (varying) all-gather's gradient is a reduce-scatter, the right one when the
    gathered block meets data that differs per device (FSDP).  A collection of
    mesh axes makes the gather invariant over those axes only (the gather is
    then split into runs of axes, minor run first, which gives the same blocks).

    Example:
        >>> import jax, numpy as np
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((4,), ('x',), axis_types=(jax.sharding.AxisType.Auto,))
        >>> gather = Step('all-gather', 0, ('x',), dim=0)
        >>> body = lambda b: apply_step(b, gather, invariant=True)
        >>> f = jax.shard_map(body, mesh=mesh, in_specs=P('x'), out_specs=P())
        >>> f(np.arange(8.0)).tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    axes = _axes(step)
    if step.kind == "all-gather":
        fixed = set(step.mesh_axes) if invariant is True else set(invariant or ())
        runs: list[tuple[list[str], bool]] = []
        for m in step.mesh_axes:
            if runs and runs[-1][1] == (m in fixed):
                runs[-1][0].append(m)
            else:
                runs.append(([m], m in fixed))
        for run, inv in reversed(runs):  # minor run first: blocks stay in major-to-minor order
            name = run[0] if len(run) == 1 else tuple(run)
            block = jax.lax.all_gather(block, name, axis=step.dim, tiled=True, to="invarying" if inv else "varying")
        return block
    if step.kind == "all-reduce":
        return jax.lax.psum(block, axes)
    if step.kind == "reduce-scatter":
        return jax.lax.psum_scatter(block, axes, scatter_dimension=step.dim, tiled=True)
    if step.kind == "all-to-all":
        # The block is split along `dim` and whole along `to_dim`: cut `to_dim` in n
        # pieces, send piece j to device j, and stack what arrives along `dim`.
        return jax.lax.all_to_all(block, axes, split_axis=step.to_dim, concat_axis=step.dim, tiled=True)
    n = ring_size(step.mesh_axes)
    if step.kind == "dynamic-slice":
        assert step.dim is not None
        size = block.shape[step.dim]
        if size % n:
            raise EinshardError(f"dynamic-slice: dimension {step.dim} of size {size} does not split into {n} blocks")
        piece = size // n
        return jax.lax.dynamic_slice_in_dim(block, jax.lax.axis_index(axes) * piece, piece, step.dim)
    if step.reorder is not None:  # the same blocks, held by other devices
        sizes = {m: jax.lax.axis_size(m) for m in step.mesh_axes}
        return jax.lax.ppermute(block, axes, reorder_pairs(step.mesh_axes, sizes, *step.reorder))
    # collective-permute: a cyclic shift around the ring
    perm = [(j, (j + step.shift) % n) for j in range(n)]
    return jax.lax.ppermute(block, axes, perm)


# ---------------------------------------------------------------------------
# Tracking layouts through steps


def _fail(reason: str, hint: str | None = None) -> EinshardError:
    return EinshardError(reason, hint=hint)


def step_layout(lay: Layout, step: Step) -> Layout:
    """The layout of a block after ``step`` (or an EinshardError if the step does not fit it).

    Example:
        >>> from einshard.core.layout import Layout, MeshAxis
        >>> lay = Layout(('b', 'd'), (8, 4), (MeshAxis('data', 2),), ((), ()))
        >>> str(step_layout(lay, Step('dynamic-slice', 0, ('data',), dim=0)))
        '[b:8@data d:4]'
    """
    dims = list(lay.dims)
    axes = tuple(step.mesh_axes)
    for m in axes:
        if m not in lay.mesh_sizes:
            raise _fail(f"step {step}: {m!r} is not a mesh axis (the mesh: {', '.join(map(str, lay.mesh))})")
    n = math.prod(lay.mesh_sizes[m] for m in axes)

    def check_dim(d: int | None) -> int:
        if d is None or not 0 <= d < len(dims):
            raise _fail(f"step {step}: dim {d} is not a dimension of {lay}")
        return d

    def suffix(d: int) -> None:
        if dims[d][len(dims[d]) - len(axes) :] != axes or not dims[d]:
            raise _fail(
                f"step {step}: dimension {d} ({lay.axes[d]}) of {lay} is not split over {axes} as its minor mesh axes"
            )

    def unused(d: int) -> None:
        taken = lay.sharded_mesh_axes | lay.unreduced
        clash = [m for m in axes if m in taken]
        if clash:
            raise _fail(f"step {step}: mesh axis {clash[0]!r} already splits or sums {lay}")
        shards = lay.shards(d) * n
        if lay.shape[d] % shards:
            raise _fail(f"step {step}: {lay.axes[d]} of size {lay.shape[d]} does not split into {shards} blocks")

    if step.kind == "all-gather":
        d = check_dim(step.dim)
        suffix(d)
        dims[d] = dims[d][: len(dims[d]) - len(axes)]
        return lay.with_dims(tuple(dims))
    if step.kind == "dynamic-slice":
        d = check_dim(step.dim)
        unused(d)
        dims[d] = dims[d] + axes
        return lay.with_dims(tuple(dims))
    if step.kind == "all-reduce":
        missing = [m for m in axes if m not in lay.unreduced]
        if missing:
            raise _fail(f"step {step}: {lay} holds no pending sums over {missing[0]!r}")
        return lay.with_dims(tuple(dims), lay.unreduced - set(axes))
    if step.kind == "reduce-scatter":
        d = check_dim(step.dim)
        missing = [m for m in axes if m not in lay.unreduced]
        if missing:
            raise _fail(f"step {step}: {lay} holds no pending sums over {missing[0]!r}")
        shards = lay.shards(d) * n
        if lay.shape[d] % shards:
            raise _fail(f"step {step}: {lay.axes[d]} of size {lay.shape[d]} does not split into {shards} blocks")
        dims[d] = dims[d] + axes
        return lay.with_dims(tuple(dims), lay.unreduced - set(axes))
    if step.kind == "all-to-all":
        d, t = check_dim(step.dim), check_dim(step.to_dim)
        suffix(d)
        dims[d] = dims[d][: len(dims[d]) - len(axes)]
        shards = math.prod(lay.mesh_sizes[m] for m in dims[t]) * n
        if lay.shape[t] % shards:
            raise _fail(f"step {step}: {lay.axes[t]} of size {lay.shape[t]} does not split into {shards} blocks")
        dims[t] = dims[t] + axes
        return lay.with_dims(tuple(dims))
    if step.reorder is not None:
        before, after = step.reorder
        if before != lay.dims:
            raise _fail(f"step {step}: {lay} is not split as {before}")
        return lay.with_dims(after)
    return lay  # a ring shift moves blocks between devices; the layout cannot say which


# ---------------------------------------------------------------------------
# Layouts of an annotated einsum


def mesh_axes_of(mesh: Any) -> tuple[MeshAxis, ...]:
    """The mesh's axes as :class:`MeshAxis` values (:func:`einshard.core.mesh.mesh_axes`)."""
    return _mesh_axes(mesh)


def _side_placement(side: Side) -> str:
    left = " ".join(str(AxisItem(i.name)) if isinstance(i, AxisItem) else str(i) for i in side.items)
    return f"{left} -> {' '.join(str(i) for i in side.items)}"


def einsum_layouts(expr: str, shapes: Sequence[Sequence[int]], mesh: Any) -> tuple[tuple[Layout, ...], Layout]:
    """The operand layouts and the output layout an annotated einsum writes, for these shapes.

    The output's size of each axis is read off the operands; ``{U:axes}`` on the
    output becomes the layout's pending sums.  No ``...`` (name every axis).

    Example:
        >>> import jax
        >>> mesh = jax.make_mesh((2,), ('model',))
        >>> ins, out = einsum_layouts('b x@model, x@model y -> b y {U:model}', [(4, 6), (6, 8)], mesh)
        >>> str(out)
        '[b:4 y:8 {U:model}]'
    """
    parsed = parse_einsum(expr)
    axes_of_mesh = _mesh_axes(mesh)
    if len(shapes) != len(parsed.inputs):
        raise parsed.fail(f"the einsum has {len(parsed.inputs)} operands but {len(shapes)} shapes were given")
    sizes: dict[str, int] = {}
    layouts = []
    for side, shape in zip(parsed.inputs, shapes, strict=True):
        if side.has_ellipsis:
            raise parsed.fail("einsum_layouts does not take '...': name every axis", side.column)
        if side.unreduced:
            raise parsed.fail("an operand cannot hold pending sums ('{U:...}')", side.unreduced_column)
        lay = resolve_named(parse_placement(_side_placement(side)), tuple(shape), axes_of_mesh)
        for name, size in zip(lay.axes, lay.shape, strict=True):
            if sizes.setdefault(name, size) != size:
                raise parsed.fail(f"axis {name!r} has size {sizes[name]} in one operand and {size} in another")
        layouts.append(lay)
    out_side = parsed.output
    if out_side.has_ellipsis:
        raise parsed.fail("einsum_layouts does not take '...': name every axis", out_side.column)
    out_shape = tuple(sizes[n] for n in out_side.names)
    plain = Side(out_side.items)
    out = resolve_named(parse_placement(_side_placement(plain)), out_shape, axes_of_mesh)
    for m in out_side.unreduced:
        if m not in out.mesh_sizes:
            raise parsed.fail(f"{m!r} in '{{U:...}}' is not a mesh axis", out_side.unreduced_column)
    return tuple(layouts), out.with_dims(out.dims, frozenset(out_side.unreduced))


# ---------------------------------------------------------------------------
# The shard_map of one einsum


def _local_einsum_result(locals_: Sequence[Layout], out_axes: tuple[str, ...], out: Layout) -> Layout:
    """The layout of the local einsum's result, given the operands' layouts after their steps."""
    dims_of: dict[str, tuple[str, ...]] = {}
    for lay in locals_:
        for name, d in zip(lay.axes, lay.dims, strict=True):
            if dims_of.setdefault(name, d) != d:
                raise _fail(
                    f"after the operand steps, axis {name!r} is split over {dims_of[name] or 'nothing'} "
                    f"in one operand and over {d or 'nothing'} in another: the local einsum would mix blocks",
                    "Gather one side, slice the other (dynamic-slice), or realign with an all-to-all.",
                )
    pending = {m for name, d in dims_of.items() if name not in out_axes for m in d}
    # Pending sums an operand carries pass through the einsum (it is linear in each operand), unless
    # two operands carry the same one (a product of partial sums is not a partial sum of the product).
    carried = [m for lay in locals_ for m in lay.unreduced]
    if len(set(carried)) != len(carried) or set(carried) & {m for d in dims_of.values() for m in d}:
        raise _fail(
            f"after the operand steps the operands carry pending sums over {sorted(carried)}: two over one "
            "mesh axis, or one over a mesh axis that also splits an axis, do not multiply to the result's sum",
            "All-reduce the pending sums of all but one operand first.",
        )
    pending |= set(carried)
    dims = tuple(dims_of[n] for n in out_axes)
    used = [m for d in dims for m in d]
    if len(set(used)) != len(used) or pending & set(used):
        raise _fail(
            f"after the operand steps one mesh axis would split two result axes or both split and sum "
            f"({', '.join(f'{n}@{d}' for n, d in zip(out_axes, dims, strict=True) if d)}; pending {sorted(pending)}): "
            "the devices would hold only diagonal blocks",
            "All-gather one of the operands on that mesh axis first.",
        )
    return Layout(out_axes, out.shape, out.mesh, dims, frozenset(pending))


def _subscripts(in_axes: Sequence[tuple[str, ...]], out_axes: tuple[str, ...]) -> str:
    names: dict[str, str] = {}
    letters = iter(string.ascii_letters)
    for axes in (*in_axes, out_axes):
        for a in axes:
            if a not in names:
                names[a] = next(letters)
    return ",".join("".join(names[a] for a in axes) for axes in in_axes) + "->" + "".join(names[a] for a in out_axes)


def _pspec(lay: Layout) -> PartitionSpec:
    return PartitionSpec(*lay.spec_entries())


def restrict_spec(spec: PartitionSpec, keep: Collection[str]) -> PartitionSpec:
    """``spec`` with only the mesh axes in ``keep`` (the others dropped; an emptied entry is None)."""
    entries: list[Any] = []
    for entry in spec:
        names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        kept = tuple(m for m in names if m in keep)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def place(x: Any, mesh: AnyMesh, spec: PartitionSpec) -> Any:
    """Lay an operand out on the Explicit axes of ``mesh`` as ``spec`` says, for a shard_map's in_specs.

    JAX checks an Explicit axis of an in_spec against the operand's type, so the
    operand is ``reshard``-ed to a ``NamedSharding`` (which, unlike a bare
    PartitionSpec, needs no mesh context, and, unlike ``device_put``, works on
    an AbstractMesh while tracing and under ``jax.vmap``).  Auto axes are left
    to the shard_map, which lays them out on the way in; ``reshard`` refuses them.
    """
    explicit = explicit_axes(mesh)
    if not explicit:
        return x
    target = NamedSharding(mesh, restrict_spec(spec, explicit))
    try:
        return jax.sharding.reshard(x, target)
    except ValueError as err:  # JAX's reasons (device assignment, divisibility) are the useful part
        raise EinshardError(
            f"cannot lay an operand of shape {tuple(jnp.shape(x))} out as {target.spec} on {show_mesh(mesh)}: {err}",
            hint="Under jax.jit with Explicit mesh axes, trace inside `with jax.set_mesh(mesh):` or pass mesh=.",
        ) from None


def constrain_auto(x: Any, mesh: AnyMesh, spec: PartitionSpec) -> Any:
    """``with_sharding_constraint`` on the Auto axes of ``mesh`` (a no-op without any in ``spec``)."""
    auto = auto_axes(mesh)
    part = restrict_spec(spec, auto)
    if not auto or all(e is None for e in part):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, part))


def lowering_mesh(mesh: Any, operands: Sequence[Any], *, what: str) -> AnyMesh:
    """The mesh a lowering runs on (:func:`einshard.core.mesh.resolve_mesh`), which must have devices to run on.

    A dict of sizes describes shapes only (enough for ``analyze``/``explain``),
    so it is refused here; an AbstractMesh is only usable while tracing.
    """
    if isinstance(mesh, Mapping):
        raise EinshardError(
            f"{what}: mesh= is a dict of axis sizes ({dict(mesh)!r}), which describes shapes only "
            "(enough for einshard.analyze/explain); running needs devices",
            hint="Pass the jax.sharding.Mesh (jax.make_mesh(...)), or call inside `with jax.set_mesh(mesh):`.",
        )
    chosen = resolve_mesh(mesh, operands, what=what)
    assert chosen is not None  # required=True raises instead
    return chosen if isinstance(chosen, Mesh) else _concrete_twin(chosen, operands)


def _concrete_twin(mesh: AnyMesh, operands: Sequence[Any]) -> AnyMesh:
    """The concrete mesh behind an abstract one, where an operand's value (eager autodiff) has it.

    Under ``jax.grad`` outside ``jax.jit`` the operands' types carry only the abstract
    mesh, but JAX runs the backward pass eagerly, and a sharding constraint on an
    AbstractMesh cannot be run eagerly; their values know the devices.
    """
    for leaf in (leaf for x in operands for leaf in jax.tree_util.tree_leaves(x)):
        value = leaf
        if is_tracer(leaf):
            try:
                value = leaf.to_concrete_value()
            except Exception:  # noqa: BLE001 - a tracer without a value has no devices to offer
                continue
        own = getattr(getattr(value, "sharding", None), "mesh", None)
        if isinstance(own, Mesh) and own.abstract_mesh == mesh:
            return own
    return mesh


def check_lowering_context(mesh: AnyMesh, operands: Sequence[Any], *, what: str) -> None:
    """Refuse, with what to write instead, the contexts where JAX itself cannot run a program on ``mesh``.

    * An AbstractMesh has no devices: it can only be used while tracing.
    * ``jax.grad`` outside ``jax.jit`` and outside ``jax.set_mesh`` on a mesh with Explicit axes:
      JAX cannot create the gradient's cotangent, typed on the mesh, without a mesh context
      (plain ``jnp`` code fails the same way), so say how to write it instead.
    """
    leaves = [leaf for x in operands for leaf in jax.tree_util.tree_leaves(x)]
    if not isinstance(mesh, Mesh) and not any(is_tracer(x) for x in leaves) and current_mesh() is None:
        raise EinshardError(
            f"{what}: {show_mesh(mesh)} has no devices, and the operands are concrete arrays: "
            "an AbstractMesh can only lay out values being traced",
            hint="Pass the jax.sharding.Mesh (jax.make_mesh(...)), or call inside `with jax.set_mesh(mesh):`.",
        )
    if explicit_axes(mesh) and current_mesh() is None and any(eagerly_differentiated(x) for x in leaves):
        raise EinshardError(
            f"{what} under jax.grad outside jax.jit on a mesh with Explicit axes "
            f"({', '.join(sorted(explicit_axes(mesh)))}) needs the mesh context: JAX cannot create the gradient "
            "of a value typed on that mesh without one (plain jnp code on such arrays fails the same way)",
            hint="Write `with jax.set_mesh(mesh): jax.grad(f)(...)`, or jit it: `jax.jit(jax.grad(f))(...)`; "
            "or make the mesh's axes Auto (jax.make_mesh(..., axis_types=(AxisType.Auto, ...))).",
        )


def _check_operands(operands: Sequence[Any], layouts: Sequence[Layout]) -> None:
    for k, (lay, x) in enumerate(zip(layouts, operands, strict=True)):
        shape = getattr(x, "shape", None)
        if shape is None:
            raise EinshardError(f"operand {k + 1} is a {type(x).__name__}, not an array (of shape {lay.shape})")
        if tuple(shape) != lay.shape:
            raise EinshardError(f"operand {k + 1} of shape {tuple(shape)} does not fit the layout {lay}")


def _check_empty_splits(layouts: Sequence[Layout]) -> None:
    """An axis of size 0 split over devices is refused: XLA cannot gather or scatter empty blocks."""
    for lay in layouts:
        for d, (name, size) in enumerate(zip(lay.axes, lay.shape, strict=True)):
            if size == 0 and lay.shards(d) > 1:
                raise EinshardError(
                    f"axis {name!r} has size 0 and cannot be split over {', '.join(lay.dims[d])} "
                    "(the collectives cannot move empty blocks)",
                    hint=f"Leave the empty axis unsplit: drop its '@' ({name} instead of {name}@...).",
                )


def einsum_shard_map(
    layouts_in: Sequence[Layout],
    layout_out: Layout,
    steps_before: Sequence[Step] = (),
    steps_after: Sequence[Step] = (),
    *,
    local_sums: Mapping[int, Layout] | None = None,
    mesh: Any,
    mode: str = "sync",
    two_way: bool = False,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Callable[..., jax.Array]:
    """A function computing one einsum as an explicit ``jax.shard_map`` with these steps.

    Args:
        layouts_in: each operand's layout (as placed; inputs are laid out so on the way in).
        layout_out: the result's layout; ``unreduced`` axes come back as per-device
            partial sums stacked on a new leading axis split over them (sum it to reduce).
        steps_before: steps on the operands (``Step.operand`` = position), in order.
        steps_after: steps on the local einsum's result (``Step.operand == 'out'``).
        local_sums: operands summed over some of their axes before any step (axes that
            no other operand and not the result has): position -> the layout after the sum,
            with pending sums over the mesh axes that split the summed axes.
        mesh: the ``jax.sharding.Mesh``.
        mode: ``'auto'`` (no steps) is the baseline: :func:`einsum_auto`, XLA picks the collectives.
            ``'sync'`` runs every step as a plain collective.  ``'async'`` runs the
            last all-gather of an operand of a two-operand einsum (or else the first
            reduce-scatter of the result) as a collective matmul ring
            (:mod:`einshard.lowering.collective_matmul`), where the ring's mesh axes
            split the result; other steps (and einsums with no such step) stay sync.
        two_way: with ``mode='async'``, a bidirectional ring.
        precision, preferred_element_type: passed to the local ``jnp.einsum``.

    The returned function is not jitted, so it composes with ``jax.jit``,
    ``jax.grad`` and ``jax.vmap``; gradients come from JAX's transposition of
    the collectives (``check_vma=True``).  Its ``.program`` attribute lists what runs.
    """
    from . import collective_matmul as cm  # a sibling module; imported here to keep steps importable alone

    if mode == "auto":
        if steps_before or steps_after:
            raise EinshardError("mode='auto' leaves the collectives to XLA: give no steps")
        return einsum_auto(
            layouts_in, layout_out, mesh=mesh, precision=precision, preferred_element_type=preferred_element_type
        )
    if mode not in ("sync", "async"):
        raise EinshardError(f"mode must be 'sync', 'async' or 'auto', got {mode!r}")
    _check_empty_splits([*layouts_in, layout_out])
    n_ops = len(layouts_in)
    before = [s for s in steps_before]
    for s in before:
        if not isinstance(s.operand, int) or not 0 <= s.operand < n_ops:
            raise _fail(f"step {s}: operand must be an operand position 0..{n_ops - 1}")
    for s in steps_after:
        if s.operand != "out":
            raise _fail(f"step {s}: a step after the einsum acts on operand 'out'")
    if layout_out.mesh != layouts_in[0].mesh or any(lay.mesh != layouts_in[0].mesh for lay in layouts_in):
        raise _fail("the operand and output layouts are on different meshes")

    # Follow each block's layout through the steps; reject plans that compute something else.
    local = list(layouts_in)
    sums: dict[int, tuple[int, ...]] = {}
    for i, summed in (local_sums or {}).items():
        given = layouts_in[i]
        gone = tuple(d for d, a in enumerate(given.axes) if a not in summed.axes)
        others = {a for k, lay in enumerate(layouts_in) if k != i for a in lay.axes} | set(layout_out.axes)
        if (
            not gone
            or any(given.axes[d] in others for d in gone)
            or summed.axes != tuple(a for a in given.axes if a in summed.axes)
        ):
            raise _fail(f"local_sums: {summed} is not operand {i + 1} ({given}) summed over its own axes")
        sums[i] = gone
        local[i] = summed
    for s in before:
        assert isinstance(s.operand, int)  # checked above
        local[s.operand] = step_layout(local[s.operand], s)
    computed = _local_einsum_result(local, layout_out.axes, layout_out)
    final = computed
    for s in steps_after:
        final = step_layout(final, s)
    if final.dims != layout_out.dims or final.unreduced != layout_out.unreduced:
        raise _fail(
            f"the steps leave the result as {final}, not the requested {layout_out}",
            "Add the collective that closes the gap (all-reduce or reduce-scatter for pending sums, "
            "all-gather or dynamic-slice for splits).",
        )

    # Pick the step a collective matmul replaces.
    ring: tuple[str, Step] | None = None
    if mode == "async" and n_ops == 2:
        last_on = {s.operand: i for i, s in enumerate(before)}
        # A ring's result differs per device, so the ring axes must split the result.
        gathers = [
            i
            for i, s in enumerate(before)
            if s.kind == "all-gather" and last_on[s.operand] == i and set(s.mesh_axes) <= final.sharded_mesh_axes
        ]
        if gathers:
            ring = ("ag", before.pop(gathers[-1]))
        elif steps_after and steps_after[0].kind == "reduce-scatter":
            ring = ("rs", steps_after[0])
            steps_after = list(steps_after[1:])
    schedule = "two-way" if two_way else "one-way"
    subscripts = _subscripts([lay.axes for lay in local], layout_out.axes)
    kw = {"precision": precision, "preferred_element_type": preferred_element_type}
    pending = tuple(m.name for m in layout_out.mesh if m.name in layout_out.unreduced)

    # A gather over mesh axes the result is not split or summed over must give a
    # replicated (invariant) block, or the replicated out_spec would not type-check.
    varying_out = final.sharded_mesh_axes | final.unreduced

    def body(*blocks: jax.Array) -> jax.Array:
        blocks_ = list(blocks)
        for i, gone in sums.items():
            blocks_[i] = jnp.sum(blocks_[i], axis=gone)
        for s in before:
            assert isinstance(s.operand, int)
            blocks_[s.operand] = apply_step(blocks_[s.operand], s, invariant=set(s.mesh_axes) - varying_out)
        if ring is None:
            y = jnp.einsum(subscripts, *blocks_, **kw)
        elif ring[0] == "ag":
            s = ring[1]
            assert isinstance(s.operand, int) and s.dim is not None
            y = cm.allgather_einsum(
                subscripts, *blocks_, axis_name=s.mesh_axes, gathered=s.operand, dim=s.dim, schedule=schedule, **kw
            )
        else:
            s = ring[1]
            assert s.dim is not None
            y = cm.einsum_reduce_scatter(
                subscripts, *blocks_, axis_name=s.mesh_axes, dim=s.dim, schedule=schedule, **kw
            )
        for s in steps_after:
            y = apply_step(y, s, invariant=set(s.mesh_axes) - varying_out)
        return y[None] if pending else y

    in_specs = tuple(_pspec(lay) for lay in layouts_in)
    out_spec = _pspec(layout_out)
    if pending:
        out_spec = PartitionSpec(pending[0] if len(pending) == 1 else pending, *out_spec)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=True)

    def run(*operands: Any) -> jax.Array:
        if len(operands) != n_ops:
            raise EinshardError(f"the einsum takes {n_ops} operands, got {len(operands)}")
        _check_operands(operands, layouts_in)
        check_lowering_context(mesh, operands, what="the sharded einsum")
        return mapped(*(place(x, mesh, s) for x, s in zip(operands, in_specs, strict=True)))

    run.program = tuple(  # type: ignore[attr-defined]
        [*(str(s) for s in before), f"einsum {subscripts}" + (f" as ring {ring[0]} {ring[1]}" if ring else "")]
        + [str(s) for s in steps_after]
    )
    return run


def einsum_auto(
    layouts_in: Sequence[Layout],
    layout_out: Layout,
    *,
    mesh: Any,
    precision: Any = None,
    preferred_element_type: Any = None,
) -> Callable[..., jax.Array]:
    """The baseline: ``jnp.einsum`` with the layouts as sharding constraints; XLA (GSPMD/Shardy) picks the collectives.

    Auto mesh axes get ``with_sharding_constraint``; Explicit ones ``reshard`` and the
    einsum's ``out_sharding`` (trace inside ``jax.set_mesh`` under ``jax.jit``).
    Pending sums cannot be asked for here (``{U:...}``): use ``mode='sync'``.

    Example:
        >>> import jax, numpy as np
        >>> mesh = jax.make_mesh((2,), ('model',), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
        >>> ins, out = einsum_layouts('b x@model, x@model y -> b y', [(4, 6), (6, 8)], mesh)
        >>> float(einsum_auto(ins, out, mesh=mesh)(np.ones((4, 6)), np.ones((6, 8)))[0, 0])
        6.0
    """
    if layout_out.unreduced:
        raise EinshardError(
            f"mode='auto' cannot leave pending sums ({layout_out}); use mode='sync'",
            hint="Or reduce them: drop '{U:...}' from the output.",
        )
    _check_empty_splits([*layouts_in, layout_out])
    subscripts = _subscripts([lay.axes for lay in layouts_in], layout_out.axes)
    in_specs = [_pspec(lay) for lay in layouts_in]
    out_spec = _pspec(layout_out)
    explicit = explicit_axes(mesh)

    concrete = isinstance(mesh, Mesh)

    def compute(*operands: Any) -> jax.Array:
        # Auto axes: sharding constraints; Explicit axes: reshard the operands and type the result.
        # (Constraints first: with_sharding_constraint's transpose drops the Explicit part of a type.)
        xs = [place(constrain_auto(jnp.asarray(x), mesh, s), mesh, s) for x, s in zip(operands, in_specs, strict=True)]
        kw: dict[str, Any] = {"precision": precision, "preferred_element_type": preferred_element_type}
        if explicit:
            kw["out_sharding"] = NamedSharding(mesh, restrict_spec(out_spec, explicit))
        y = jnp.einsum(subscripts, *xs, **kw)
        # A one-operand einsum may come back as its input, ignoring out_sharding (and a jit's
        # out_shardings do not retype Explicit axes): place makes sure of the Explicit part.
        # On an abstract mesh (under a trace) the Auto part of the result is a constraint, except on a
        # mixed mesh: with_sharding_constraint's transpose drops the Explicit part of the cotangent's
        # type there (JAX 0.10), so XLA's propagation places the Auto part.
        if not concrete and not explicit:
            y = constrain_auto(y, mesh, out_spec)
        return place(y, mesh, out_spec)

    # On a concrete mesh, a jit whose out_shardings name it lays the result out and tells JAX the
    # devices even when no mesh context is current and the operands are host arrays (a shard_map's
    # mesh does that for the other modes); on an abstract mesh the context or the operands' types do.
    staged = jax.jit(compute, out_shardings=NamedSharding(mesh, out_spec)) if concrete else compute

    def run(*operands: Any) -> jax.Array:
        if len(operands) != len(layouts_in):
            raise EinshardError(f"the einsum takes {len(layouts_in)} operands, got {len(operands)}")
        _check_operands(operands, layouts_in)
        check_lowering_context(mesh, operands, what="the einsum (mode='auto')")
        return staged(*operands)

    run.program = (f"einsum {subscripts} (XLA auto: layouts as sharding constraints)",)  # type: ignore[attr-defined]
    return run
