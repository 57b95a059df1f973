"""``einshard show``: draw an array layout from the shell (the drawing itself is :func:`einshard.show`)."""

from __future__ import annotations

import argparse
import math

import numpy as np

from einshard.errors import EinshardError

from .presets import parse_mesh

# Simulated CPU devices show starts at most: XLA's memory grows with each (4,096 take ~0.6 GB and 8 s).
MAX_DEVICES = 4096


def run(args: argparse.Namespace) -> int:
    import os

    shape = _parse_shape(args.shape)
    try:
        dtype = np.dtype(args.dtype)
    except TypeError:
        dtype = np.dtype(object)
    if dtype.kind not in "biufc" and dtype.name != "bfloat16":
        raise EinshardError(f"--dtype takes a numeric type like float32, bfloat16, int8; got {args.dtype!r}")
    sizes = parse_mesh(args.mesh) if args.mesh else None
    _check_mesh_flag(args.expression, sizes)
    wanted = args.devices or (math.prod(sizes.values()) if sizes else 8)
    if wanted > MAX_DEVICES:
        flag = "--devices" if args.devices else f"--mesh {args.mesh}"
        raise EinshardError(
            f"{flag} asks for {wanted:,} simulated devices; show draws at most {MAX_DEVICES:,} "
            "(each simulated CPU device costs XLA memory: 100,000 took 19 GB)",
            hint="A layout reads the same on a smaller mesh with the same axis ratios: scale the sizes down.",
        )
    import jax

    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        try:
            jax.config.update("jax_num_cpu_devices", wanted)
        except RuntimeError:
            pass  # backend already started (in-process use): keep its devices
    import einshard

    mesh = None
    if sizes:
        n = math.prod(sizes.values())
        if n > jax.device_count():
            raise EinshardError(f"--mesh {args.mesh} needs {n} devices, but there are {jax.device_count()}")
        mesh = jax.sharding.Mesh(
            np.asarray(jax.devices()[:n]).reshape(tuple(sizes.values())),
            tuple(sizes),
            axis_types=(jax.sharding.AxisType.Auto,) * len(sizes),
        )
    sh = einshard.sharding(args.expression, shape, mesh=mesh)
    abstract = jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
    try:
        einshard.show(abstract, args.dims, names=args.expression)
    except EinshardError as err:
        if args.dims is None:
            raise
        # (show()'s own errors here are about the dimensions asked for: name the flag, not dims=)
        raise EinshardError(f"--dims {args.dims}: {err.reason.removeprefix('show(): ')}", hint=err.hint) from None
    return 0


def _parse_shape(text: str) -> tuple[int, ...]:
    """``'8,16,32'`` (or ``8x16x32``) -> ``(8, 16, 32)``: ASCII digits only, each size at most 18 of them."""
    parts = [s.strip() for s in text.replace("x", ",").split(",") if s.strip()]
    if not parts or not all(p.isascii() and p.isdigit() and len(p) <= 18 for p in parts):
        raise EinshardError(f"--shape takes sizes like 8,16,32; got {text!r}")
    return tuple(int(p) for p in parts)


def _check_mesh_flag(text: str, sizes: dict[str, int] | None) -> None:
    """Every mesh axis the expression names has a size in --mesh (else an error naming the flag, not ``mesh=``)."""
    from einshard._src.parsing import parse_placement

    expr = parse_placement(text)
    for item in expr.output.axes:
        # With a --mesh, an axis it lacks is the library's error (it names the mesh's axes and near misses).
        missing = [m for m in item.mesh_axes or () if not sizes]
        if missing:
            given = (
                f"--mesh {','.join(f'{k}={v}' for k, v in sizes.items())} gives no size for it"
                if sizes
                else "there is no --mesh"
            )
            example = ",".join([*(f"{k}={v}" for k, v in (sizes or {}).items()), *(f"{m}=2" for m in missing)])
            raise expr.fail(
                f"the expression lays axis {item.name!r} out over mesh axis {missing[0]!r}, but {given}",
                item.column,
                f"Give every mesh axis a size: --mesh {example}",
            )
