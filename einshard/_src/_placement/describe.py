"""``describe()``: the expression that reproduces an array's layout (counts on anonymous meshes, ``@`` otherwise)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .._checks import describe_value
from ..core.layout import spec_dims
from ..core.mesh import auto_axes, is_tracer
from ..errors import EinshardError
from ..parsing import Expression, format_name, parse_placement
from .meshes import is_anonymous

__all__ = ["describe"]


def describe(x: Any, names: str | None = None) -> str:
    """The expression that reproduces ``x``'s layout: ``einshard(y, describe(x))`` lays ``y`` out the same way.

    Arrays on an anonymous (count) mesh are described with counts; arrays on
    your own mesh with ``@`` (pass ``mesh=`` or set the mesh when reusing it).

    Args:
        x: a jax.Array (or anything with ``.shape`` and ``.sharding``).
        names: axis names to use, space separated (default ``a b c ...``).

    Example:
        >>> import einshard, numpy as np
        >>> einshard.describe(einshard(np.zeros((8, 4)), 'a b -> a* b'))  # doctest: +SKIP
        'a b -> a8 b'
    """
    if names is not None and not isinstance(names, str):
        raise EinshardError(f"describe(): names= takes axis names as one string ('b s d'), got {describe_value(names)}")
    if not hasattr(x, "shape"):
        raise EinshardError(
            f"describe(): x= takes an array (anything with .shape and .sharding), got {describe_value(x)}"
        )
    shape = tuple(np.shape(x))
    axis_names = _default_names(len(shape)) if names is None else names.split()
    if len(axis_names) != len(shape):
        raise EinshardError(f"describe(): {len(axis_names)} names given for an array of rank {len(shape)}")
    left = " ".join(format_name(n) for n in axis_names)
    try:
        expr_left = parse_placement(f"{left} -> {left}")
    except EinshardError as err:
        raise EinshardError(f"describe(names={names!r}): the names do not make an expression: {err.reason}") from None
    sh = _traced_sharding(x, expr_left) if is_tracer(x) else getattr(x, "sharding", None)
    if not isinstance(sh, NamedSharding):
        if sh is not None and len(sh.device_set) > 1:
            raise EinshardError(f"describe() reads NamedShardings; this array has a {type(sh).__name__}")
        return f"{left} -> {left}"
    mesh = sh.mesh
    dims = spec_dims(sh.spec, len(shape))
    unreduced = tuple(getattr(sh.spec, "unreduced", ()) or ())
    if is_anonymous(mesh) and all(len(d) <= 1 for d in dims) and not unreduced:
        owner = {d[0]: i for i, d in enumerate(dims) if d}
        right = []
        for axis_name in mesh.axis_names:
            size = mesh.shape[axis_name]
            if axis_name in owner:
                right.append(f"{format_name(axis_names[owner[axis_name]])}{size}")
            else:
                right.append(str(size))
        right.extend(format_name(axis_names[i]) for i, d in enumerate(dims) if not d)
        return f"{left} -> {' '.join(right)}"
    items = []
    for n, d in zip(axis_names, dims):
        text = format_name(n)
        if d:
            text += "@" + (d[0] if len(d) == 1 else "(" + ",".join(d) + ")")
        items.append(text)
    right_text = " ".join(items)
    if unreduced:
        right_text += " {U:" + ",".join(unreduced) + "}"
    return f"{left} -> {right_text}"


def _traced_sharding(x: Any, expr: Expression) -> Any:
    """A traced value's sharding, read from its type (JAX's sharding-in-types).

    The type carries the Explicit mesh axes only: how Auto axes split the value
    is decided by XLA after tracing, so a value on a mesh with Auto axes cannot
    be described while tracing (saying "replicated" would be silently wrong).
    """
    sh = getattr(jax.typeof(x), "sharding", None)
    m = getattr(sh, "mesh", None)
    if m is None or m.empty:
        return None
    auto = auto_axes(m)
    if auto:
        concrete = _value_under_autodiff(x)
        if concrete is not None:  # eager jax.grad: the value under the tracer carries its whole layout
            return concrete.sharding
        raise expr.fail(
            f"describe() of a traced value reads its layout from its type, which says nothing of the Auto mesh "
            f"axes {sorted(auto)} (XLA chooses their layout after tracing)",
            None,
            "Call describe() on the result outside jax.jit, or use a mesh with Explicit axes "
            "(jax.make_mesh's default) whose layouts the type carries.",
        )
    return sh


def _value_under_autodiff(x: Any) -> Any:
    """The concrete jax.Array under eager autodiff tracers (``jax.grad`` outside ``jax.jit``), or None.

    Its sharding is the layout XLA gave it, Auto axes included (issue 22: describe() under eager jax.grad on a
    mesh with Auto axes was refused although the value knows its layout).  A batching tracer's value has the
    batch axis too, and a jit tracer has no value: None for both."""
    while isinstance(x, jax.core.Tracer):
        x = x.primal if type(x).__name__ in ("JVPTracer", "LinearizeTracer") else None
    return x if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) else None


def _default_names(n: int) -> list[str]:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [letters[i] if i < 26 else f"a{i}" for i in range(n)]
