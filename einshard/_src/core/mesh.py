"""Meshes: the one place einshard decides which device mesh a call works on.

Every public function that needs a mesh asks :func:`resolve_mesh`, so the
same call finds the same mesh everywhere.  The precedence, documented once in
docs/syntax.md ("Where einshard finds the mesh"):

1. ``mesh=`` given explicitly: a ``jax.sharding.Mesh``, an ``AbstractMesh``,
   or a dict of axis sizes ``{'data': 4, 'model': 2}`` (only shapes matter:
   analysis and explain on a laptop).
2. The current mesh made by ``jax.set_mesh`` — the concrete mesh eagerly, the
   abstract mesh while tracing (under ``jax.jit`` only that one exists).
3. The mesh the operands already live on: a ``jax.Array``'s sharding, or a
   tracer's type (``jax.typeof(x).sharding``).
4. Otherwise an :class:`~einshard.errors.EinshardError` that says how to give one.

Operands laid out on a *different* mesh than the one chosen (other axis
names or sizes) are an error naming both meshes, for the functions that
compute with their operands (``check_operands=True``); placement moves arrays
between meshes on purpose and does not check.

Example:
    >>> import jax
    >>> from einshard._src.core.mesh import resolve_mesh, mesh_axes
    >>> m = resolve_mesh({'data': 4, 'model': 2})
    >>> mesh_axes(m)
    (MeshAxis(name='data', size=4), MeshAxis(name='model', size=2))
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any, Literal, overload

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from .._compat import get_concrete_mesh
from ..errors import EinshardError
from .layout import MeshAxis

__all__ = [
    "AnyMesh",
    "MeshLike",
    "resolve_mesh",
    "current_mesh",
    "current_concrete_mesh",
    "operand_mesh",
    "as_mesh",
    "mesh_axes",
    "show_mesh",
    "explicit_axes",
    "auto_axes",
    "is_concrete",
    "is_tracer",
    "eagerly_differentiated",
    "outside_jit",
    "named_sharding",
]

AnyMesh = Mesh | AbstractMesh
# What ``mesh=`` accepts: a mesh, or axis sizes where only shapes matter.
MeshLike = Mesh | AbstractMesh | Mapping[str, int]

_HOW = (
    "Pass mesh= (a jax Mesh, or sizes like {'data': 4, 'model': 2} where only shapes matter), call it inside "
    "`with jax.set_mesh(mesh):`, or lay the operands out with einshard() first."
)


def is_tracer(x: Any) -> bool:
    """A value being traced (under ``jax.jit``, ``jax.grad``, ``jax.vmap``...)."""
    return isinstance(x, jax.core.Tracer)


def eagerly_differentiated(x: Any) -> bool:
    """A value being differentiated by ``jax.grad``/``jax.vjp`` outside any ``jax.jit`` (its innermost value is concrete).

    JAX cannot transpose layouts on Explicit mesh axes there without a mesh context (plain JAX fails
    too), so callers refuse it with what to write instead.  The tracer classes are not public API:
    they are recognised by name (JVP and linearize tracers keep their primal, batch tracers their value).
    """
    differentiated = False
    while is_tracer(x):
        kind = type(x).__name__
        if kind in ("JVPTracer", "LinearizeTracer"):
            differentiated = True
            x = x.primal
        elif kind == "BatchTracer":
            x = x.val
        else:
            return False  # a jit/staging tracer: the whole program is staged
    return differentiated


def outside_jit(x: Any) -> bool:
    """A tracer of eager transformations only (jax.grad, jax.vmap outside jax.jit), whose innermost value is concrete."""
    while is_tracer(x):
        kind = type(x).__name__
        if kind in ("JVPTracer", "LinearizeTracer"):
            x = x.primal
        elif kind == "BatchTracer":
            x = x.val
        else:
            return False
    return True


def is_concrete(mesh: object) -> bool:
    """A mesh with devices (arrays can be placed on it), as opposed to an AbstractMesh."""
    return isinstance(mesh, Mesh)


def current_concrete_mesh() -> Mesh | None:
    """The concrete mesh made current by ``jax.set_mesh``; None outside a mesh context or while tracing."""
    try:
        mesh = get_concrete_mesh()
    except ValueError:  # older JAX under jit: only the abstract mesh is known
        return None
    if mesh is None or getattr(mesh, "empty", True):
        return None
    return mesh if isinstance(mesh, Mesh) else None


def current_mesh() -> AnyMesh | None:
    """The mesh made current by ``jax.set_mesh``: concrete when there is one, else the abstract mesh; or None.

    While tracing, JAX keeps only the abstract mesh current; outside a trace the
    concrete one is returned so that arrays can be placed on it.
    """
    concrete = current_concrete_mesh()
    if concrete is not None:
        return concrete
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract is None or abstract.empty else abstract


def operand_mesh(x: Any) -> AnyMesh | None:
    """The mesh a value is laid out on: a jax.Array's or a ShapeDtypeStruct's (``sharding=``) mesh, a tracer's
    abstract mesh from its type; else None.

    Host arrays, Python scalars and single-device arrays have no mesh.
    """
    if is_tracer(x):
        try:
            sh = jax.typeof(x).sharding
        except (AttributeError, TypeError):
            return None
        m = getattr(sh, "mesh", None)
        return None if m is None or getattr(m, "empty", True) or not m.shape else m
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
        # A ShapeDtypeStruct with sharding= is how users describe arguments without data (what jit.lower takes).
        m = getattr(getattr(x, "sharding", None), "mesh", None)
        if isinstance(m, (Mesh, AbstractMesh)) and not m.empty and m.shape:
            return m
    return None


def _sizes_mesh(sizes: Mapping[Any, Any]) -> AbstractMesh:
    names, values = [], []
    for name, size in sizes.items():
        if not isinstance(name, str) or not name:
            raise EinshardError(f"mesh= as a dict maps axis names (strings) to sizes, got the key {name!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise EinshardError(
                f"mesh axis {name!r} has size {size!r}; sizes are positive integers (mesh={dict(sizes)!r})"
            )
        names.append(name)
        values.append(int(size))
    # Shapes only: the axis types do not matter for analysis; Explicit is JAX's default.
    return AbstractMesh(tuple(values), tuple(names), axis_types=(AxisType.Explicit,) * len(names))


def as_mesh(mesh: MeshLike) -> AnyMesh:
    """``mesh=`` as given by a user, checked: a Mesh, an AbstractMesh, or a dict of sizes (an AbstractMesh)."""
    if isinstance(mesh, (Mesh, AbstractMesh)):
        if not _distinct(mesh.axis_names):
            # JAX builds such a mesh, then crashes (a segfault in shard_map) or picks one of the axes at random.
            raise EinshardError(f"mesh= names an axis twice: {tuple(mesh.axis_names)}; mesh axis names are distinct")
        return mesh
    if isinstance(mesh, Mapping):
        return _sizes_mesh(mesh)
    raise EinshardError(
        f"mesh= takes a jax.sharding.Mesh, an AbstractMesh or a dict of axis sizes, got {type(mesh).__name__}: {mesh!r}"
    )


@functools.lru_cache(maxsize=256)
def _distinct(names: tuple[Any, ...]) -> bool:
    return len(set(names)) == len(names)


def _same_shape(a: AnyMesh, b: AnyMesh) -> bool:
    return tuple(a.axis_names) == tuple(b.axis_names) and dict(a.shape) == dict(b.shape)


def _same_mesh(a: AnyMesh, b: AnyMesh) -> bool:
    if not _same_shape(a, b):
        return False
    if isinstance(a, Mesh) and isinstance(b, Mesh):
        return bool((a.device_ids == b.device_ids).all())
    return True  # one of them abstract: only names and sizes are known


def show_mesh(mesh: AnyMesh) -> str:
    """A mesh as users read it: ``Mesh('data': 4, 'model': 2)``."""
    kind = "Mesh" if isinstance(mesh, Mesh) else "AbstractMesh"
    return f"{kind}(" + ", ".join(f"{k!r}: {v}" for k, v in dict(mesh.shape).items()) + ")"


@overload
def resolve_mesh(
    mesh: MeshLike | None = None,
    operands: Iterable[Any] = (),
    *,
    what: str = "this call",
    check_operands: bool = True,
    required: Literal[True] = True,
) -> AnyMesh: ...


@overload
def resolve_mesh(
    mesh: MeshLike | None = None,
    operands: Iterable[Any] = (),
    *,
    what: str = "this call",
    check_operands: bool = True,
    required: bool,
) -> AnyMesh | None: ...


def resolve_mesh(
    mesh: MeshLike | None = None,
    operands: Iterable[Any] = (),
    *,
    what: str = "this call",
    check_operands: bool = True,
    required: bool = True,
) -> AnyMesh | None:
    """The mesh a call works on: ``mesh=``, else the current mesh, else the operands' (see the module docstring).

    Args:
        mesh: what the user passed as ``mesh=`` (None: not given).
        operands: the call's arrays (leaves of pytrees are looked at; host arrays are ignored).
        what: the function's name, for error messages.
        check_operands: whether operands laid out on another mesh than the chosen one are an error.
        required: whether finding no mesh is an error (else None is returned).

    Raises:
        EinshardError: ``mesh=`` of the wrong type; operands on two meshes; no mesh anywhere (if required).
    """
    leaves = [leaf for x in operands for leaf in jax.tree_util.tree_leaves(x)]
    own = [(i, m) for i, m in ((i, operand_mesh(x)) for i, x in enumerate(leaves)) if m is not None]
    if mesh is not None:
        chosen: AnyMesh | None = as_mesh(mesh)
        source = "mesh="
    else:
        chosen = current_mesh()
        source = "jax.set_mesh"
    if chosen is None:
        if own:
            chosen, source = own[0][1], f"operand {own[0][0] + 1}"
        elif required:
            raise EinshardError(f"{what} needs a mesh and found none. " + _HOW)
        else:
            return None
    if check_operands:
        for i, m in own:
            if not _same_mesh(m, chosen):
                raise EinshardError(
                    f"{what}: operand {i + 1} is laid out on {show_mesh(m)}, but the mesh from {source} is "
                    f"{show_mesh(chosen)}",
                    hint="Pass arrays laid out on one mesh (re-place them with einshard(x, expr, mesh=...)), "
                    "or pass the operands' mesh as mesh=.",
                )
    return chosen


def mesh_axes(mesh: MeshLike) -> tuple[MeshAxis, ...]:
    """The mesh's axes as :class:`~einshard.core.layout.MeshAxis` values (names and sizes), in mesh order."""
    return tuple(MeshAxis(str(name), int(size)) for name, size in dict(as_mesh(mesh).shape).items())


def _axis_types(mesh: AnyMesh) -> dict[str, Any]:
    types = getattr(mesh, "axis_types", None) or (AxisType.Auto,) * len(mesh.axis_names)
    return dict(zip(mesh.axis_names, types, strict=True))


def explicit_axes(mesh: AnyMesh) -> frozenset[str]:
    """The mesh axes of type Explicit (JAX's default in ``jax.make_mesh``)."""
    return frozenset(n for n, t in _axis_types(mesh).items() if t == AxisType.Explicit)


def auto_axes(mesh: AnyMesh) -> frozenset[str]:
    """The mesh axes of type Auto (sharding left to XLA's propagation)."""
    return frozenset(n for n, t in _axis_types(mesh).items() if t == AxisType.Auto)


def named_sharding(mesh: AnyMesh, spec: PartitionSpec) -> NamedSharding:
    """A NamedSharding on ``mesh`` (concrete or abstract): needs no mesh context, unlike a bare PartitionSpec."""
    return NamedSharding(mesh, spec)
