"""Expression + shape + mesh -> :class:`~einshard.core.layout.Layout` and ``NamedSharding`` (cached per call site key).

The parsed :class:`~einshard.parsing.Expression` is the key: it is frozen and hashable, and equal for texts that
differ only in spacing, so the callers parse once at the public entry and nothing here parses again.
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding

from .._caches import cached
from ..core.layout import Layout, resolve_counts, resolve_named
from ..core.logical import AxisRules, current_axis_rules, resolve_expression
from ..core.mesh import AnyMesh, mesh_axes, show_mesh
from ..errors import EinshardError
from ..parsing import Expression, ReplicaItem, build_placement
from .meshes import anonymous_mesh


def resolve_layout(
    expr: Expression, shape: tuple[int, ...], mesh: AnyMesh | None
) -> tuple[Layout, NamedSharding | None]:
    """(layout, sharding) for a placement; mesh is the explicit or context mesh, or None."""
    # The current axis rules are part of the key: the same text means other mesh axes under other rules.
    return _resolve_keyed(expr, shape, mesh, current_axis_rules())


@cached(maxsize=8192)
def _resolve_keyed(
    expr: Expression, shape: tuple[int, ...], mesh: AnyMesh | None, rules: AxisRules | None
) -> tuple[Layout, NamedSharding | None]:
    if expr.uses_counts:
        layout = resolve_counts(expr, shape, len(jax.devices()))
        concrete = anonymous_mesh(tuple(m.size for m in layout.mesh))
        return layout, NamedSharding(concrete, layout.to_spec())
    if mesh is None:
        if expr.uses_mesh_axes and rules is not None:
            # Logical names whose rules all replicate need no mesh; any mesh axis left does.
            expr = resolve_expression(expr, None, rules)
        if expr.uses_mesh_axes:
            raise expr.fail(
                "the expression names mesh axes but there is no mesh",
                next(i.column for i in expr.output.axes if i.mesh_axes is not None),
                "Pass mesh=, or make one current: `with jax.set_mesh(jax.make_mesh((4, 2), ('data', 'model'))):`.",
            )
        # Nothing sharded and no mesh: replicate over all devices, as einshard 0.2's '* a b' does.
        return resolve_counts(_replicated(expr), shape, len(jax.devices())), None
    layout = resolve_named(expr, shape, mesh_axes(mesh))
    # A NamedSharding on an AbstractMesh is what JAX uses under jit (reshard, ShapeDtypeStruct);
    # only placing data needs the concrete mesh, and concrete_sharding checks that.
    return layout, NamedSharding(mesh, layout.to_spec())


resolve_layout.cache_info = _resolve_keyed.cache_info  # type: ignore[attr-defined]  # tests inspect the cache
resolve_layout.cache_clear = _resolve_keyed.cache_clear  # type: ignore[attr-defined]


def _replicated(expr: Expression) -> Expression:
    """``a b -> a b`` as einshard 0.2's ``a b -> * a b``, built from the parsed sides (not printed and re-parsed)."""
    return build_placement(expr.inputs[0].items, (ReplicaItem(star=True), *expr.output.items))


def concrete_sharding(expr: Expression, shape: tuple[int, ...], chosen: AnyMesh | None) -> NamedSharding:
    lay, sh = resolve_layout(expr, tuple(shape), chosen)
    if sh is None:
        return replicated_everywhere(lay)
    if not isinstance(sh.mesh, Mesh):
        raise EinshardError(
            f"placing data needs a concrete jax.sharding.Mesh (with devices); mesh= is {show_mesh(sh.mesh)}",
            expr.text,
            hint="Pass a Mesh (jax.make_mesh(...)); a dict of sizes or an AbstractMesh only describes shapes "
            "(einshard.core.layout, einshard.spec, einshard.analyze).",
        )
    return sh


def replicated_everywhere(lay: Layout) -> NamedSharding:
    concrete = anonymous_mesh(tuple(m.size for m in lay.mesh))
    return NamedSharding(concrete, lay.to_spec())


def spec_entry(axes: tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes
