"""``einshard show``: draw an array layout from the shell (the drawing itself is :func:`einshard.show`)."""

from __future__ import annotations

import argparse
import math

import numpy as np

from einshard.errors import EinshardError

from .presets import parse_mesh


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("expression", help="a placement, e.g. 'b s d -> b@data s d@model' or 'a b -> a4 b*'")
    parser.add_argument("--shape", required=True, help="the array's shape, e.g. 8,16,32")
    parser.add_argument("--mesh", help="mesh axis sizes for '@' expressions, e.g. data=4,model=2")
    parser.add_argument("--dims", help="the dimensions drawn as rows,columns (names or indices)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--devices", type=int, default=None, help="simulated CPU devices (default: the mesh's size, else 8)"
    )


def run(args: argparse.Namespace) -> int:
    import os

    try:
        shape = tuple(int(s) for s in args.shape.replace("x", ",").split(",") if s.strip())
    except ValueError:
        raise EinshardError(f"--shape takes sizes like 8,16,32; got {args.shape!r}") from None
    sizes = parse_mesh(args.mesh) if args.mesh else None
    import jax

    wanted = args.devices or (math.prod(sizes.values()) if sizes else 8)
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
    abstract = jax.ShapeDtypeStruct(shape, np.dtype(args.dtype), sharding=sh)
    einshard.show(abstract, args.dims, names=args.expression)
    return 0
