"""``einshard plan``: plan a model's layouts for a mesh and a memory budget, from sizes only.

    einshard plan --mesh data=4,model=2 --budget 2GiB
    einshard plan --model transformer --mesh data=4,model=2 --rules-out rules.json
    einshard demo --rules rules.json                      # train with the planned layout

``--model mlp`` is ``relu(X @ W1) @ W2`` (widths scaled by ``--width``);
``--model transformer`` is the demo's transformer (``einshard demo``'s default
sizes).  Both are planned as a training step (loss and gradients); nothing is
allocated or compiled.  ``--rules-out`` writes the rules file ``einshard demo
--rules`` reads: ``{"params": {pattern: expression}, "batch": expression, "mesh": ...}``.
"""

from __future__ import annotations

import argparse

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", choices=["mlp", "transformer"], default="mlp", help="the model to plan (default: mlp)"
    )
    parser.add_argument("--mesh", default="data=4,model=2", help="mesh axis sizes (default data=4,model=2)")
    parser.add_argument("--budget", default=None, help="memory per device, e.g. 2GiB (default: none)")
    parser.add_argument("--profile", default="h100", help="hardware profile: h100, tpu-v5p, cpu (default h100)")
    parser.add_argument("--objective", default="training", choices=["training", "inference", "memory", "communication"])
    parser.add_argument(
        "--batch", type=int, default=None, help="global batch (default: 16 for the transformer, 16384 for the mlp)"
    )
    parser.add_argument("--width", type=int, default=1024, help="the demo's x width; y = 2x, z = x/2 (default 1024)")
    parser.add_argument("--rules-out", default=None, help="write the parameter rules as JSON here")


def run(args: argparse.Namespace) -> int:
    import jax
    import jax.numpy as jnp

    from einshard.analysis.planner import plan

    from .presets import parse_mesh

    mesh = parse_mesh(args.mesh)
    if args.model == "transformer":
        from .models import transformer as tm

        cfg = tm.Config()
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tm.init(cfg, 0))
        batch = jax.ShapeDtypeStruct((args.batch or 16, cfg.seq + 1), jnp.int32)
        fn = jax.value_and_grad(tm.loss_fn) if args.objective == "training" else tm.forward
        title = f"model: the demo transformer ({cfg.layers} layers, width {cfg.width}), batch {batch.shape}"
    else:
        x, y, z = args.width, 2 * args.width, max(args.width // 2, 1)

        def mlp_loss(params, batch):
            return jnp.mean((jax.nn.relu(batch @ params["w1"]) @ params["w2"]) ** 2)

        params = {"w1": jax.ShapeDtypeStruct((x, y), jnp.float32), "w2": jax.ShapeDtypeStruct((y, z), jnp.float32)}
        batch = jax.ShapeDtypeStruct((args.batch or 16384, x), jnp.float32)
        fn = (
            jax.value_and_grad(mlp_loss)
            if args.objective == "training"
            else (lambda p, b: jax.nn.relu(b @ p["w1"]) @ p["w2"])
        )
        title = f"model: Z = relu(X[b={batch.shape[0]}, x={x}] @ W1[x, y={y}]) @ W2[y, z={z}], {args.objective} step"
    result = plan(
        fn,
        params,
        batch,
        mesh=mesh,
        profile=args.profile,
        memory_budget=args.budget,
        objective=args.objective,
    )
    print(title)
    print(result)
    if args.rules_out:
        result.save_rules(args.rules_out, mesh=mesh)
        print(f"rules written to {args.rules_out} (use: einshard demo --rules {args.rules_out})")
    return 0 if result.fits else 1
