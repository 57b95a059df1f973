"""The boundary checks of the core's types (Layout, mesh axes, Step, meshes), registered by parameter name in
:data:`einshard._checks.RULES` for the public wrappers of the layers above."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._checks import RULES, argument_error
from ..errors import EinshardError


def _layout_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from .layout import Layout

    if not isinstance(value, Layout):
        raise argument_error(where, name, "an einshard Layout (einshard.layout(expr, shape, mesh=...))", value)
    return value


def _mesh_axes_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    if value is None and name == "order":
        return value
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, str) and v for v in value):
        raise argument_error(where, name, "a tuple of mesh axis names", value)
    if len(set(value)) != len(value):
        raise argument_error(where, name, "distinct mesh axis names", value)
    lay = arguments.get("lay")
    if lay is not None and hasattr(lay, "mesh"):
        known = [m.name for m in lay.mesh]
        unknown = [v for v in value if v not in known]
        if unknown:
            raise EinshardError(f"{where}: {name}= names {unknown[0]!r}, which is not a mesh axis ({', '.join(known)})")
    return tuple(value)


def _layout_axis_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """A tensor axis of ``lay``: its name or its position (negative counts from the end)."""
    lay = arguments.get("lay")
    axes = tuple(getattr(lay, "axes", ()))
    if isinstance(value, str):
        if value not in axes:
            raise EinshardError(f"{where}: {name}= names {value!r}, which is not an axis of the layout {axes}")
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise argument_error(where, name, "an axis of the layout (its name or position)", value)
    if not -len(axes) <= value < len(axes):
        raise EinshardError(f"{where}: {name}={value} is out of range for the layout's {len(axes)} axes {axes}")
    return int(value)


def _layouts_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from .layout import Layout

    if not isinstance(value, (tuple, list)) or not value or not all(isinstance(v, Layout) for v in value):
        raise argument_error(where, name, "a tuple of Layouts, one per operand", value)
    meshes = {v.mesh for v in value}
    if len(meshes) > 1:
        raise EinshardError(f"{where}: {name}= holds layouts on different meshes")
    sizes: dict[str, int] = {}
    for lay in value:
        for a, s in zip(lay.axes, lay.shape):
            if sizes.setdefault(a, s) != s:
                raise EinshardError(
                    f"{where}: {name}= gives axis {a!r} size {sizes[a]} in one layout and size {s} in another"
                )
    out = arguments.get("out_axes")
    if isinstance(out, (tuple, list)):
        missing = [a for a in out if a not in sizes]
        if missing:
            raise EinshardError(f"{where}: {name}= has no axis {missing[0]!r}, which out_axes= asks for")
    return tuple(value)


def _result_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """The result's requested layout: its axes are ``out_axes``, in order."""
    if value is None:
        return value
    value = _layout_rule(value, where, name, arguments)
    out = arguments.get("out_axes")
    if isinstance(out, (tuple, list)) and tuple(value.axes) != tuple(out):
        raise EinshardError(f"{where}: {name}= lays out {value.axes}, not the result's axes {tuple(out)}")
    return value


def _same_tensor_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """A second layout of the tensor the first (``src``/``lay``) lays out: its axes, shape and mesh."""
    value = _layout_rule(value, where, name, arguments)
    first = arguments.get("src", arguments.get("lay"))
    if first is not None and (value.axes, value.shape, value.mesh) != (first.axes, first.shape, first.mesh):
        raise EinshardError(f"{where}: {name}= lays out another tensor ({value}) than {first}")
    return value


def _reordered_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """``lay``'s splits with the mesh axes of each dimension in another order (what a collective-permute does)."""
    lay = arguments.get("lay")
    ok = isinstance(value, tuple) and all(isinstance(d, tuple) and all(isinstance(m, str) for m in d) for d in value)
    if not ok:
        raise argument_error(where, name, "a tuple of each dimension's mesh axes", value)
    if lay is not None and (
        len(value) != len(lay.dims) or any(sorted(d) != sorted(e) for d, e in zip(value, lay.dims))
    ):
        raise EinshardError(
            f"{where}: {name}={value} is not {lay.dims} with the mesh axes of each dimension reordered "
            "(a collective-permute changes only their order)"
        )
    return value


def _step_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    from .collectives import Step

    if not isinstance(value, Step):
        raise argument_error(where, name, "an einshard.lowering.Step", value)
    return value


def _mesh_rule(value: Any, where: str, name: str, arguments: dict[str, Any]) -> Any:
    """None, a Mesh/AbstractMesh or a dict of axis sizes (checked), or a hypothesis strategy of meshes."""
    if value is None or type(value).__name__.endswith("Strategy") or hasattr(value, "example"):
        return value
    from .mesh import as_mesh

    mesh = as_mesh(value)
    sizes = dict(mesh.shape)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes.values()):
        raise argument_error(where, name, "a mesh whose axis sizes are integers >= 1", value)
    return value


RULES.update(
    lay=_layout_rule,
    src=_layout_rule,
    dst=_layout_rule,
    axes=_mesh_axes_rule,
    gone=_mesh_axes_rule,
    new=_mesh_axes_rule,
    order=_mesh_axes_rule,
    axis=_layout_axis_rule,
    step=_step_rule,
    mesh=_mesh_rule,
)
# Rules some functions give a parameter whose name means something else elsewhere.
LAYOUTS = _layouts_rule
SAME_TENSOR = _same_tensor_rule
REORDERED = _reordered_rule
OPTIONAL_LAYOUT = _result_rule
