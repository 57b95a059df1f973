"""Where a lowering runs: the mesh it resolves to, the contexts JAX can run it in, and placing operands on it.

Shared by every lowering (einsum, pipelines, data parallelism): each resolves
its mesh with :func:`lowering_mesh`, refuses what JAX itself cannot run with
:func:`check_lowering_context`, and lays operands out for a shard_map's
``in_specs`` with :func:`place` (Explicit axes) and :func:`constrain_auto` (Auto ones).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..core.layout import MeshAxis, spec_dims
from ..core.mesh import (
    AnyMesh,
    MeshLike,
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

__all__ = [
    "mesh_axes_of",
    "restrict_spec",
    "place",
    "constrain_auto",
    "lowering_mesh",
    "check_lowering_context",
]


def mesh_axes_of(mesh: MeshLike) -> tuple[MeshAxis, ...]:
    """The mesh's axes as :class:`MeshAxis` values (:func:`einshard.core.mesh.mesh_axes`)."""
    return _mesh_axes(mesh)


def restrict_spec(spec: PartitionSpec, keep: Collection[str]) -> PartitionSpec:
    """``spec`` with only the mesh axes in ``keep`` (the others dropped; an emptied entry is None)."""
    entries: list[Any] = []
    for names in spec_dims(spec):
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


def lowering_mesh(mesh: MeshLike | None, operands: Sequence[Any], *, what: str) -> AnyMesh:
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
