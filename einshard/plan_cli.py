"""``einshard plan``: plan the demo model's layouts for a mesh and a memory budget, from sizes only.

    einshard plan --mesh data=4,model=2 --budget 2GiB
    einshard plan --mesh data=256,model=8 --profile h100 --batch 65536 --width 8192 --rules-out rules.json

The model is the demo's ``relu(X @ W1) @ W2`` (widths scaled by ``--width``),
as a training step (loss and gradients); nothing is allocated or compiled.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=["demo"], default="demo", help="the model to plan (default: demo)")
    parser.add_argument("--mesh", default="data=4,model=2", help="mesh axis sizes (default data=4,model=2)")
    parser.add_argument("--budget", default=None, help="memory per device, e.g. 2GiB (default: none)")
    parser.add_argument("--profile", default="h100", help="hardware profile: h100, tpu-v5p, cpu (default h100)")
    parser.add_argument("--objective", default="training", choices=["training", "inference", "memory", "communication"])
    parser.add_argument("--batch", type=int, default=16384, help="global batch (default 16384)")
    parser.add_argument("--width", type=int, default=1024, help="the demo's x width; y = 2x, z = x/2 (default 1024)")
    parser.add_argument("--rules-out", default=None, help="write the parameter rules as JSON here")


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from .analysis.planner import plan
    from .layouts import parse_mesh

    x, y, z = args.width, 2 * args.width, max(args.width // 2, 1)

    def loss(params, batch):
        return jnp.mean((jax.nn.relu(batch @ params["w1"]) @ params["w2"]) ** 2)

    params = {"w1": jax.ShapeDtypeStruct((x, y), jnp.float32), "w2": jax.ShapeDtypeStruct((y, z), jnp.float32)}
    batch = jax.ShapeDtypeStruct((args.batch, x), jnp.float32)
    fn = jax.value_and_grad(loss) if args.objective == "training" else (lambda p, b: jax.nn.relu(b @ p["w1"]) @ p["w2"])
    result = plan(
        fn,
        params,
        batch,
        mesh=parse_mesh(args.mesh),
        profile=args.profile,
        memory_budget=args.budget,
        objective=args.objective,
    )
    print(f"model: Z = relu(X[b={args.batch}, x={x}] @ W1[x, y={y}]) @ W2[y, z={z}], {args.objective} step")
    print(result)
    if args.rules_out:
        result.save_rules(args.rules_out)
        print(f"rules written to {args.rules_out}")
    return 0 if result.fits else 1
