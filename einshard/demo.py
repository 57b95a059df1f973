"""``einshard demo``: one 2-layer MLP under data, tensor and hybrid parallelism.

Each layout is a handful of einshard expressions.  For each, the demo places
the parameters and the batch, runs the jitted forward pass, checks the result
against the single-device computation, and prints every array's layout: the
expression, JAX's type (``f32[64@data,128]``), and the bytes each device holds.

With no accelerator it runs on ``--devices`` simulated CPU devices (default 8).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

__all__ = ["add_arguments", "run", "LAYOUTS"]


@dataclass(frozen=True)
class MLPLayout:
    """Expressions for the batch and the two weights of ``relu(X @ W1) @ W2``."""

    name: str
    what: str
    x: str
    w1: str
    w2: str


# The mesh is (data, model).  Names, not positions: the same expressions work on any mesh shape.
LAYOUTS = {
    "dp": MLPLayout(
        "dp",
        "data parallel: the batch is split over every device, weights are copied",
        "b x -> b@(data,model) x",
        "x y -> x y",
        "y z -> y z",
    ),
    "tp": MLPLayout(
        "tp",
        "tensor parallel (Megatron): W1 split by columns, W2 by rows; one all-reduce at the end",
        "b x -> b x",
        "x y -> x y@(data,model)",
        "y z -> y@(data,model) z",
    ),
    "hybrid": MLPLayout(
        "hybrid",
        "data x tensor parallel: batch over 'data', the hidden axis over 'model'",
        "b x -> b@data x",
        "x y -> x y@model",
        "y z -> y@model z",
    ),
    "einshard02": MLPLayout(
        "einshard02",
        "einshard 0.2's tutorial layout, in its count syntax, on an anonymous mesh of all devices",
        "b x -> * b x",
        "x y -> x y*",
        "y z -> y* z",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", type=int, default=8, help="simulated CPU devices to use when no accelerator is present (default 8)"
    )
    parser.add_argument(
        "--layout",
        choices=[*LAYOUTS, "all"],
        default="all",
        help="which layout to run (default: all of them)",
    )
    parser.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. data=4,model=2 (default: 2 model-parallel)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)


def _parse_mesh(text: str) -> dict[str, int]:
    from .errors import EinshardError

    out: dict[str, int] = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name.strip() or not size.strip().isdigit():
            raise EinshardError(f"--mesh takes name=size pairs like data=4,model=2; got {text!r}")
        out[name.strip()] = int(size)
    return out


def run(args: argparse.Namespace) -> int:
    import jax

    # Simulated CPU devices only affect the CPU backend; real accelerators win.
    if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        jax.config.update("jax_num_cpu_devices", args.devices)

    import jax.numpy as jnp
    import numpy as np

    import einshard
    from einshard.errors import EinshardError

    n = jax.device_count()
    sizes = _parse_mesh(args.mesh) if args.mesh else {"data": max(n // 2, 1), "model": 2 if n > 1 else 1}
    if int(np.prod(list(sizes.values()))) != n:
        raise EinshardError(f"--mesh {sizes} has {int(np.prod(list(sizes.values())))} devices, but there are {n}")
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
    print(f"einshard {einshard.__version__} on jax {jax.__version__}: {n} {jax.devices()[0].platform} devices")
    print("mesh:", ", ".join(f"{k}={v}" for k, v in sizes.items()))

    b, x_dim, y_dim, z_dim = args.batch, 128, 256, 64
    key = jax.random.key(args.seed)
    k1, k2, k3 = jax.random.split(key, 3)
    X = np.asarray(jax.random.normal(k1, (b, x_dim)))
    W1 = np.asarray(jax.random.normal(k2, (x_dim, y_dim)) / np.sqrt(x_dim))
    W2 = np.asarray(jax.random.normal(k3, (y_dim, z_dim)) / np.sqrt(y_dim))
    print(f"model: Z = relu(X[b={b}, x={x_dim}] @ W1[x, y={y_dim}]) @ W2[y, z={z_dim}]")

    @jax.jit
    def forward(x, w1, w2):
        return jax.nn.relu(x @ w1) @ w2

    with jax.default_device(jax.devices()[0]):
        reference = np.asarray(forward(jnp.asarray(X), jnp.asarray(W1), jnp.asarray(W2)))

    chosen = list(LAYOUTS) if args.layout == "all" else [args.layout]
    ok = True
    for name in chosen:
        lay = LAYOUTS[name]
        print(f"\n== {name}: {lay.what}")
        use_mesh = None if name == "einshard02" else mesh
        xs = einshard.einshard(X, lay.x, mesh=use_mesh)
        w1s = einshard.einshard(W1, lay.w1, mesh=use_mesh)
        w2s = einshard.einshard(W2, lay.w2, mesh=use_mesh)
        out = forward(xs, w1s, w2s)
        # The output's layout is whatever XLA chose; describe() reads it back as an expression.
        z_expr = einshard.describe(out, names="b z")
        for label, expr, arr in (("X", lay.x, xs), ("W1", lay.w1, w1s), ("W2", lay.w2, w2s), ("Z", z_expr, out)):
            per_device = arr.sharding.shard_shape(arr.shape)
            nbytes = int(np.prod(per_device)) * arr.dtype.itemsize
            typed = einshard.layout(
                expr, arr.shape, mesh=None if einshard.placement.is_anonymous(arr.sharding.mesh) else arr.sharding.mesh
            )
            print(f"  {label:<3}{expr!r:<28} {str(typed):<28} {_kib(nbytes):>10} per device")
        err = float(np.max(np.abs(np.asarray(out) - reference)))
        same = err <= 1e-4 * max(1.0, float(np.max(np.abs(reference))))
        ok &= same
        print(f"  result equals the single-device forward pass: {'yes' if same else 'NO'} (max abs diff {err:.2e})")
    return 0 if ok else 1


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


if __name__ == "__main__":  # pragma: no cover
    from .cli import main

    sys.exit(main(["demo", *sys.argv[1:]]))
