"""Placement of a traced value (under ``jax.jit``, ``jax.grad``, ``jax.vmap``): reshard and sharding constraints."""

from __future__ import annotations

import contextlib
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._compat import use_abstract_mesh
from ..core.layout import Layout, resolve_named
from ..core.mesh import (
    AnyMesh,
    auto_axes,
    eagerly_differentiated,
    explicit_axes,
    mesh_axes,
    operand_mesh,
    outside_jit,
    show_mesh,
)
from ..parsing import Expression
from .meshes import count_mesh_conflict, current_abstract_mesh, pick_mesh
from .resolve import concrete_sharding, spec_entry


def constrain(x: Any, expr: Expression, mesh: AnyMesh | None) -> Any:
    if expr.uses_counts:
        chosen = pick_mesh(expr, mesh)
        # Under jit only the abstract mesh of jax.set_mesh is visible; refuse it as eagerly.
        ctx = current_abstract_mesh()
        if ctx is not None:
            raise count_mesh_conflict(expr, ctx, "jax.set_mesh made current")
        sh = concrete_sharding(expr, x.shape, chosen)
        return jax.lax.with_sharding_constraint(x, sh)
    target: AnyMesh | None = mesh if mesh is not None else current_abstract_mesh()
    if target is None:
        own = getattr(jax.typeof(x), "sharding", None)
        own_mesh = getattr(own, "mesh", None)
        target = own_mesh if own_mesh is not None and not own_mesh.empty else None
        if target is not None and outside_jit(x):
            # Eager jax.grad: the type names the abstract mesh, but the backward pass runs eagerly and
            # needs the devices, which the concrete array under the tracer has.
            target = _innermost_concrete_mesh(x) or target
    if target is None:
        raise expr.fail(
            "under jax.jit the expression needs a mesh: pass mesh= or call jax.jit inside `with jax.set_mesh(mesh):`",
            None,
        )
    lay = resolve_named(expr, tuple(x.shape), mesh_axes(target))
    types = dict(zip(target.axis_names, target.axis_types))
    if (
        isinstance(target, Mesh)
        and explicit_axes(target)
        and not auto_axes(target)  # with Auto axes too, the constraint's NamedSharding names the devices
        and current_abstract_mesh() is None
        and not outside_jit(x)
        and operand_mesh(x) is None
    ):
        # A value that lives on no mesh, laid out over the Explicit axes of mesh= inside jax.jit without the mesh
        # context: reshard would need the context (JAX fails at dispatch: "enter your jit into a mesh context"),
        # but jax.device_put with the concrete NamedSharding carries the devices itself, as plain JAX users write
        # it (issue 22).  It is what this expression means, on this mesh.
        return jax.device_put(x, NamedSharding(target, PartitionSpec(*lay.spec_entries())))
    if explicit_axes(target) and current_abstract_mesh() is None and eagerly_differentiated(x):
        # JAX itself cannot transpose a reshard on Explicit axes outside a mesh context
        # (eager jax.grad fails with "Expected cotangent type ..."): say what works.
        raise expr.fail(
            "eager jax.grad through a layout on Explicit mesh axes needs the mesh context, "
            f"and none is current (mesh {show_mesh(target)})",
            None,
            "Call it inside `with jax.set_mesh(mesh):`, or under jax.jit.",
        )
    explicit = _restrict(lay, lambda m: types[m] == AxisType.Explicit)
    auto = _restrict(lay, lambda m: types[m] == AxisType.Auto)
    # Without a current mesh (the array's own mesh, or mesh= outside jax.set_mesh),
    # reshard needs one to read a PartitionSpec against: make the target current.
    scope = (
        use_abstract_mesh(target.abstract_mesh if isinstance(target, Mesh) else target)
        if current_abstract_mesh() is None
        else contextlib.nullcontext()
    )
    has_explicit = any(t == AxisType.Explicit for t in types.values())
    has_auto = any(t == AxisType.Auto for t in types.values())

    def apply(v: Any) -> Any:
        if has_explicit:
            v = jax.sharding.reshard(v, NamedSharding(target, explicit) if isinstance(target, Mesh) else explicit)
        if has_auto:
            v = jax.lax.with_sharding_constraint(v, NamedSharding(target, auto))
        return v

    if has_explicit and has_auto and outside_jit(x):
        # On a mixed mesh, eager jax.grad cannot transpose the reshard/constraint pair op by op
        # (plain JAX fails with "Expected cotangent type"); staged together under jit it can.
        apply = jax.jit(apply)
    try:
        with scope:
            x = apply(x)
    except (ValueError, AssertionError) as err:  # JAX asserts when a constraint meets an Explicit mesh
        raise expr.fail(
            f"JAX refused the layout under jit: {err}",
            None,
            "With Explicit mesh axes, trace inside `with jax.set_mesh(mesh):`.",
        ) from None
    return x


def _innermost_concrete_mesh(x: Any) -> Mesh | None:
    """The concrete mesh of the array under eager-transformation tracers (None if it has none)."""
    while isinstance(x, jax.core.Tracer):
        kind = type(x).__name__
        x = x.primal if kind in ("JVPTracer", "LinearizeTracer") else x.val if kind == "BatchTracer" else None
    m = getattr(getattr(x, "sharding", None), "mesh", None)
    return m if isinstance(m, Mesh) else None


def _restrict(lay: Layout, keep: Any) -> PartitionSpec:
    entries = []
    for d in lay.dims:
        kept = tuple(m for m in d if keep(m))
        entries.append(spec_entry(kept))
    return PartitionSpec(*entries)
