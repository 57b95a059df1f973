"""Padding for einsum axes whose size does not split evenly over their mesh axes.

For an einsum, zero padding is exact wherever the padded entries are later
dropped: a padded *contracted* axis adds zeros to every sum, and a padded
axis the result keeps whole gives extra rows that are sliced off afterwards.
The one case that cannot be fixed by padding is a result axis that the output
layout itself splits unevenly (the result could not be laid out as asked):
that is an :class:`~einshard.errors.EinshardError`.  Padding and slicing are
linear, so gradients stay exact.

Example:
    >>> import jax
    >>> mesh = jax.make_mesh((4,), ('model',))
    >>> pad = plan_padding('b x@model, x@model y -> b y', [(3, 10), (10, 5)], mesh)
    >>> pad.padded_shapes, pad.output_shape
    (((3, 12), (12, 5)), (3, 5))
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..analysis.einsum.read import expand_ellipsis
from ..core.mesh import MeshLike
from ..parsing import parse_einsum
from .placing import mesh_axes_of

__all__ = ["Padding", "plan_padding", "pad_operands", "unpad_result"]


@dataclass(frozen=True)
class _Shaped:
    """An operand as far as expanding '...' goes: its shape."""

    shape: tuple[int, ...]


@dataclass(frozen=True)
class Padding:
    """How to pad each operand so every split is even, and how to cut the result back.

    Attributes:
        sizes: for each padded axis, (name, size, padded size).
        shapes: the operands' shapes; ``padded_shapes``: after padding.
        output_shape: the true result shape; ``padded_output_shape``: what the padded einsum gives.
    """

    sizes: tuple[tuple[str, int, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    padded_shapes: tuple[tuple[int, ...], ...]
    output_shape: tuple[int, ...]
    padded_output_shape: tuple[int, ...]

    @property
    def needed(self) -> bool:
        return bool(self.sizes)


def plan_padding(expr: str, shapes: Sequence[Sequence[int]], mesh: MeshLike) -> Padding:
    """The padding an annotated einsum needs for these operand shapes (none if every split is even).

    Each axis is padded to a multiple of the least common multiple of the
    shard counts it has on any side, so every side's split is even.
    """
    parsed = parse_einsum(expr)
    sizes_of_mesh = {m.name: m.size for m in mesh_axes_of(mesh)}
    if len(shapes) != len(parsed.inputs):
        raise parsed.fail(f"the einsum has {len(parsed.inputs)} operands but {len(shapes)} shapes were given")
    if any(side.has_ellipsis for side in parsed.sides):
        # The axes under '...' get names, as the analyzer gives them ('...0', ...); no '@' splits them,
        # so they are never padded.
        parsed = expand_ellipsis(parsed, tuple(_Shaped(tuple(s)) for s in shapes))  # type: ignore[misc]
    size: dict[str, int] = {}
    multiple: dict[str, int] = {}
    for side, shape in zip(parsed.inputs, shapes, strict=True):
        if len(side.axes) != len(shape):
            raise parsed.fail(f"an operand names {len(side.axes)} axes but has shape {tuple(shape)}", side.column)
        for item, n in zip(side.axes, shape, strict=True):
            if size.setdefault(item.name, int(n)) != int(n):
                raise parsed.fail(f"axis {item.name!r} has size {size[item.name]} in one operand and {n} in another")
    for side in parsed.sides:
        for item in side.axes:
            for m in item.mesh_axes or ():
                if m not in sizes_of_mesh:
                    raise parsed.fail(f"mesh axis {m!r} is not an axis of the mesh", item.column)
            count = math.prod(sizes_of_mesh[m] for m in item.mesh_axes or ())
            multiple[item.name] = math.lcm(multiple.get(item.name, 1), count)
    for item in parsed.output.axes:
        count = math.prod(sizes_of_mesh[m] for m in item.mesh_axes or ())
        if size[item.name] % count:
            raise parsed.fail(
                f"the output splits axis {item.name!r} (size {size[item.name]}) into {count} shards, which is "
                "not even; padding cannot help because the result itself would have to be split unevenly",
                item.column,
                f"Keep {item.name!r} whole in the output (it is then padded and cut back), or give it a size that "
                f"is a multiple of {count}.",
            )
    padded = {name: -(-n // multiple.get(name, 1)) * multiple.get(name, 1) for name, n in size.items()}
    changed = tuple((name, size[name], padded[name]) for name in size if padded[name] != size[name])
    return Padding(
        sizes=changed,
        shapes=tuple(tuple(int(n) for n in s) for s in shapes),
        padded_shapes=tuple(tuple(padded[i.name] for i in side.axes) for side in parsed.inputs),
        output_shape=tuple(size[i.name] for i in parsed.output.axes),
        padded_output_shape=tuple(padded[i.name] for i in parsed.output.axes),
    )


def pad_operands(padding: Padding, operands: Sequence[Any]) -> list[Any]:
    """Zero-pad each operand to its padded shape (a no-op where nothing is padded)."""
    out = []
    for x, shape, target in zip(operands, padding.shapes, padding.padded_shapes, strict=True):
        if shape == target:
            out.append(x)
        else:
            out.append(_zero_pad(x, tuple(t - s for s, t in zip(shape, target, strict=True))))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _zero_pad(x: Any, extra: tuple[int, ...]) -> Any:
    """``jnp.pad`` with zeros at the end, whose gradient first unsplits the padded dimensions.

    The cotangent of a padded operand comes back split as the einsum uses it (on an
    Explicit mesh axis, in its type); cutting the padding off such a split is uneven,
    which JAX refuses, so the padded dimensions are resharded whole first.
    """
    return jnp.pad(x, [(0, e) for e in extra])


def _zero_pad_fwd(x: Any, extra: tuple[int, ...]) -> tuple[Any, None]:
    return _zero_pad(x, extra), None


def _zero_pad_bwd(extra: tuple[int, ...], _: None, ct: Any) -> tuple[Any]:
    sharding = getattr(jax.typeof(ct), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if (
        sharding is not None
        and spec is not None
        and any(e and spec[d] is not None for d, e in enumerate(extra) if d < len(spec))
    ):
        whole = PartitionSpec(*(None if d < len(extra) and extra[d] else p for d, p in enumerate(spec)))
        ct = jax.sharding.reshard(ct, NamedSharding(sharding.mesh, whole))
    return (ct[tuple(slice(0, n - e) for n, e in zip(ct.shape, extra, strict=True))],)


_zero_pad.defvjp(_zero_pad_fwd, _zero_pad_bwd)


def unpad_result(padding: Padding, y: Any) -> Any:
    """Cut the padded rows off the result (a no-op where the result axes were not padded).

    The result's trailing axes are the einsum's; a leading axis of per-device
    partial sums (pending ``{U:...}``) is kept.
    """
    if padding.output_shape == padding.padded_output_shape:
        return y
    return y[(Ellipsis, *(slice(0, n) for n in padding.output_shape))]
