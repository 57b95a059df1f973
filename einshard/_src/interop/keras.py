"""Keras 3 ``LayoutMap``: read one into einshard path rules for a pytree, and write a layout back as one.

A ``LayoutMap`` maps variable paths (``'sequential/dense_1/kernel'``) to a ``TensorLayout``'s axes — a tuple
with one mesh axis (or None) per dimension — and ``keras.distribution.ModelParallel`` places each variable
by it.  Keras looks a path up as the path itself, else the one key that, read as a regular expression,
matches the *whole* path (``re.fullmatch`` in Keras 3.15; two keys matching is an error), else nothing: the
variable is replicated, silently.  :func:`from_keras` asks a ``LayoutMap`` itself (so its own rule applies,
whatever the Keras release), reads a plain dict with Keras 3.15's rule, and records, per leaf, the key that
matched or that none did (``einshard.audit`` lists those, largest first).

Keras is imported only to write a map (:func:`to_keras`); reading takes any mapping of patterns to axes.
Keras needs ``KERAS_BACKEND=jax`` set before it is imported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from .._checks import naming
from ..core.mesh import MeshLike
from ..errors import EinshardError
from ..tree_rules import Rules, leaf_expressions
from ._leaves import ImportedRules, imported, leaves_of, spec_expression

__all__ = ["from_keras", "to_keras", "keras_params"]


def _entries(layout: Any) -> tuple[Any, ...]:
    """A ``TensorLayout``'s axes, or a tuple given as data: each None, a mesh axis name or a tuple of them."""
    axes = getattr(layout, "axes", layout)
    if not isinstance(axes, (tuple, list)):
        raise EinshardError(f"from_keras: layout_map= holds a TensorLayout or a tuple of mesh axes, got {layout!r:.60}")
    for a in axes:
        names = (a,) if isinstance(a, str) else a if isinstance(a, (tuple, list)) else None
        if a is not None and (names is None or not all(isinstance(n, str) and n for n in names)):
            raise EinshardError(
                f"from_keras: layout_map= entry {a!r:.60} (in {tuple(axes)!r:.80}) is not None, a mesh axis name "
                "or a tuple of them"
            )
    return tuple(None if a is None else a if isinstance(a, str) else tuple(a) for a in axes)


def _table(layout_map: Any) -> dict[str, Any]:
    if isinstance(layout_map, Mapping):
        table = dict(layout_map)
    else:
        keys = getattr(layout_map, "keys", None)
        if keys is None or isinstance(layout_map, (str, bytes)):
            raise EinshardError(
                f"from_keras: layout_map= takes a keras.distribution.LayoutMap or a dict of path patterns to axes, "
                f"got {type(layout_map).__name__}"
            )
        table = {k: layout_map[k] for k in keys()}
    for key, value in table.items():
        _check_pattern(key)
        _entries(value)
    return table


def _check_pattern(key: Any) -> None:
    """A LayoutMap key is a path or a regular expression Python compiles (Keras matches with ``re``)."""
    if not isinstance(key, str) or not key:
        raise EinshardError(f"from_keras: layout_map= keys are variable paths or patterns (str), got {key!r:.60}")
    try:
        re.compile(key)
    except (re.error, RecursionError, OverflowError) as err:
        raise EinshardError(
            f"from_keras: layout_map= key {key[:60]!r} is not a valid regular expression: {err}"
        ) from None


def _keras_lookup(table: Mapping[str, Any], path: str) -> str | None:
    """The key of ``table`` Keras would use for the variable at ``path``, or None (Keras 3's rule: the path
    itself, else the one key that fully matches it)."""
    if path in table:
        return path
    matching = [key for key in table if re.fullmatch(key, path)]
    if len(matching) > 1:
        raise EinshardError(
            f"the variable {path!r} matches several LayoutMap keys: {matching} (Keras refuses this too)",
            hint="Make the patterns exclusive: each variable path may match at most one key.",
        )
    return matching[0] if matching else None


def _own_lookup(layout_map: Any, table: Mapping[str, Any], path: str) -> str | None:
    """The key a real ``LayoutMap`` uses for ``path``, by asking it (its own matching rule, whatever the Keras
    release), then finding which key holds the layout it returned."""
    try:
        layout = layout_map[path]
    except ValueError as err:  # several keys match: Keras refuses, so do we
        raise EinshardError(f"the variable {path!r}: {err}") from None
    if layout is None:
        return None
    return next(key for key, value in table.items() if value is layout)


def from_keras(layout_map: Any, params: Any, *, mesh: MeshLike | None = None) -> ImportedRules:
    """Read a Keras ``LayoutMap`` (or ``{pattern: axes}``) into einshard path rules for ``params``.

    Args:
        layout_map: a ``keras.distribution.LayoutMap``, or a dict from path patterns to tuples of mesh axes.
        params: the pytree the rules are for; each leaf's name is its keys joined by ``/``, as
            :func:`keras_params` gives a model's variables (``{'sequential/dense/kernel': array}``).
        mesh: the mesh (its axis names are checked); default the map's own ``device_mesh``.

    Returns:
        :class:`~einshard.interop.ImportedRules`: rules for ``einshard.einshard(params, r.rules, mesh=...)``
        and, per leaf, the key that matched it (None: replicated because no key did).
    """
    table = _table(layout_map)
    names = _mesh_names(mesh, layout_map)
    leaves = leaves_of(params)
    with naming("from_keras", "layout_map"):  # a key's layout that does not fit its leaf or the mesh
        return imported("keras", leaves, _layouts(layout_map, table, leaves), names, tuple(table))


def _layouts(layout_map: Any, table: dict[str, Any], leaves: tuple[Any, ...]) -> list[tuple[str | None, str]]:
    layouts: list[tuple[str | None, str]] = []
    for leaf in leaves:
        own = hasattr(layout_map, "device_mesh")  # a real LayoutMap
        key = _own_lookup(layout_map, table, leaf.name) if own else _keras_lookup(table, leaf.name)
        if key is None:
            layouts.append((None, spec_expression((), len(leaf.shape))))
            continue
        entries = _entries(table[key])
        if len(entries) > len(leaf.shape):  # shorter is fine: JAX leaves the trailing dimensions whole
            raise EinshardError(
                f"the LayoutMap key {key!r} gives {leaf.name} (shape {leaf.shape}) the layout {entries}, "
                f"{len(entries)} entries for rank {len(leaf.shape)}"
            )
        layouts.append((key, spec_expression(entries, len(leaf.shape))))
    return layouts


def _mesh_names(mesh: MeshLike | None, layout_map: Any) -> tuple[str, ...] | None:
    if mesh is not None:
        from ..core.mesh import as_mesh

        return tuple(str(n) for n in as_mesh(mesh).axis_names)
    device_mesh = getattr(layout_map, "device_mesh", None)
    return tuple(device_mesh.axis_names) if device_mesh is not None else None


def keras_params(model: Any) -> dict[str, Any]:
    """A Keras model's variables as a pytree for einshard: ``{variable.path: value}``."""
    variables = getattr(model, "variables", None)
    if isinstance(model, (str, bytes, Mapping)) or not isinstance(variables, (list, tuple)):
        raise EinshardError(
            f"keras_params: model= takes a Keras model or layer (its .variables), got {type(model).__name__} "
            f"{model!r:.60}"
        )
    return {v.path: v.value for v in variables}


def to_keras(rules: Rules, params: Any, mesh: MeshLike) -> Any:
    """A ``keras.distribution.LayoutMap`` that lays ``params`` out as einshard ``rules`` do on ``mesh``.

    One exact key per variable (its path, escaped), so no pattern can catch another variable.

    Args:
        rules: einshard path rules for ``params`` (a ``LayoutPlan``'s ``rules``, or your own).
        params: the pytree, named as :func:`keras_params` names a model's variables.
        mesh: a ``jax.sharding.Mesh`` or a ``keras.distribution.DeviceMesh``.
    """
    from keras import distribution

    from ..placement import spec

    device_mesh = mesh if isinstance(mesh, distribution.DeviceMesh) else _device_mesh(mesh)
    jax_mesh = _jax_mesh(device_mesh)
    layout_map = distribution.LayoutMap(device_mesh)
    for leaf, text in zip(leaves_of(params), leaf_expressions(params, rules)):
        entries = (None,) * len(leaf.shape) if text is None else tuple(spec(text, leaf.shape, mesh=jax_mesh))
        entries += (None,) * (len(leaf.shape) - len(entries))
        layout_map[re.escape(leaf.name)] = _one_axis_each(leaf, text, entries, device_mesh)
    return layout_map


def _one_axis_each(leaf: Any, text: str | None, entries: tuple[Any, ...], device_mesh: Any) -> tuple[Any, ...]:
    """``entries`` as a Keras ``TensorLayout`` takes them: one mesh axis name or None per dimension.

    A dimension split over several mesh axes (FSDP x TP on one dimension, ``P(None, ('data', 'model'))``) has
    no Keras form: ``TensorLayout`` checks each entry against the mesh's axis names, so Keras refuses the tuple
    with a bare ValueError when the map is filled.  Dropping an axis would replicate the variable silently over
    it, so the variable, its dimension and the axes are named instead.
    """
    out: list[Any] = []
    for dim, entry in enumerate(entries):
        axes = (entry,) if entry is None or isinstance(entry, str) else tuple(entry)
        if len(axes) > 1:
            sizes = dict(zip(device_mesh.axis_names, device_mesh.shape))
            over = " x ".join(f"{a}={sizes.get(a, '?')}" for a in axes)
            raise EinshardError(
                f"to_keras: {leaf.name} (shape {tuple(leaf.shape)}) is laid out {text!r}, which splits its "
                f"dimension {dim} (size {leaf.shape[dim]}) over {len(axes)} mesh axes ({over}); a Keras "
                "TensorLayout takes one mesh axis (or None) per dimension",
                hint="Export this layout with to_flax or to_maxtext (both take several mesh axes per dimension) "
                "or place it with einshard.einshard; for Keras, lay that dimension out over one mesh axis.",
            )
        out.append(axes[0])
    return tuple(out)


def _device_mesh(mesh: MeshLike) -> Any:
    from jax.sharding import Mesh
    from keras import distribution

    if not isinstance(mesh, Mesh):
        raise EinshardError(
            f"to_keras: mesh= takes a jax.sharding.Mesh (with devices) or a keras DeviceMesh, got {type(mesh).__name__}"
        )
    return distribution.DeviceMesh(
        tuple(mesh.devices.shape), [str(n) for n in mesh.axis_names], list(mesh.devices.flatten())
    )


def _jax_mesh(device_mesh: Any) -> Any:
    import jax
    import numpy as np

    devices = np.asarray(device_mesh.devices).reshape(device_mesh.shape)
    types = (jax.sharding.AxisType.Auto,) * len(device_mesh.axis_names)  # as Keras builds its meshes
    return jax.sharding.Mesh(devices, tuple(device_mesh.axis_names), axis_types=types)
