"""``einshard plan``: plan a model's layouts for a mesh and a memory budget, from sizes only.

    einshard plan --mesh data=4,model=2 --budget 2GiB
    einshard plan --model transformer --mesh data=4,model=2 --rules-out rules.json
    einshard demo --rules rules.json                      # train with the planned layout
    einshard plan --mesh data=4,model=2 --verify          # check the 3 best and the best preset with XLA
    einshard plan --mesh data=4,model=2 --verify --explicit   # ... as typed programs on Explicit axes

``--model mlp`` is ``relu(X @ W1) @ W2`` (widths scaled by ``--width``);
``--model transformer`` is the demo's transformer (``einshard demo``'s default
sizes); ``--model llama-7b`` / ``llama-70b`` are Llama-2-sized decoders
(bf16, scanned, remat; ``--layers``, ``--seq`` resize them).  ``--target
tpu:v5p:4x4x4`` plans for a TPU slice (its profile, HBM as the default budget,
its default mesh) and ``--verify`` then compiles with the TPU compiler
(``einshard[tpu]``); ``--target gpu:h100x8`` is a profile only.  Both are planned as a training step (loss and gradients); nothing is
allocated (``--verify [K]`` compiles the K best candidates, shapes only, and
chooses by XLA's numbers; with ``--explicit`` on a mesh with Explicit axes, jax.make_mesh's default, where a
layout JAX refuses is printed as refused and ranked last).  Times are for ``--profile`` (default: this
machine's), named on the plan's first line.  ``--rules-out`` writes the rules file ``einshard demo
--rules`` reads: ``{"params": {pattern: expression}, "batch": expression, "mesh": ...}``.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    import math

    import jax
    import jax.numpy as jnp

    from einshard.planner import parse_bytes, plan

    from .presets import parse_mesh

    target = None
    if args.target is not None:
        from einshard.targets import parse_target

        target = parse_target(args.target)
    mesh = parse_mesh(args.mesh) if args.mesh else (target.default_mesh() if target else {"data": 4, "model": 2})
    parse_bytes(args.budget, "--budget")  # the flag's error, before any tracing
    if target is None:
        _simulate_devices(mesh)
    if args.model.startswith("llama-"):
        import functools

        from .models import llama

        lcfg = llama.sized(args.model, layers=args.layers, seq=args.seq)
        params = llama.shapes(lcfg)
        batch = jax.ShapeDtypeStruct((args.batch or math.prod(mesh.values()), lcfg.seq + 1), jnp.int32)
        loss = functools.partial(llama.loss_fn, cfg=lcfg)
        fn: Any = jax.value_and_grad(loss) if args.objective == "training" else loss
        title = (
            f"model: {args.model} ({lcfg.layers} layers, width {lcfg.width}, {llama.param_count(lcfg) / 1e9:.1f}B "
            f"parameters, bf16, scanned, remat), batch {batch.shape}"
        )
    elif args.model == "transformer":
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
    on: Any = mesh
    if args.explicit:
        # jax.make_mesh's default axis types (Explicit): each candidate is then the typed program a user's step is.
        if target is not None:
            from einshard.errors import EinshardError

            raise EinshardError("einshard plan: --explicit plans on this machine's devices; it does not take --target")
        on = jax.make_mesh(tuple(mesh.values()), tuple(mesh), axis_types=(jax.sharding.AxisType.Explicit,) * len(mesh))
    result = plan(
        fn,
        params,
        batch,
        mesh=on,
        profile=args.profile,
        memory_budget=args.budget,
        objective=args.objective,
        verify=args.verify,
        target=target,
    )
    print(title)
    print(result)
    if args.rules_out:
        result.save_rules(args.rules_out, mesh=mesh)
        print(f"rules written to {args.rules_out} ({_use_hint(args)})")
    return 0 if result.fits else 1


def _simulate_devices(mesh: dict[str, int]) -> None:
    """On a CPU, as many simulated devices as the mesh has, so that ``--verify`` can compile on it (before
    JAX starts; a caller's own XLA_FLAGS device count, or a backend already started, is kept)."""
    import math
    import os

    import jax

    if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        jax.config.update("jax_num_cpu_devices", math.prod(mesh.values()))
    except RuntimeError:
        pass  # the backend already started (in-process use): keep its devices


def _use_hint(args: argparse.Namespace) -> str:
    """How to use the rules file: a demo command that trains with it as planned (same model, mesh and batch)."""
    import shlex

    if args.model != "transformer":
        return (
            "rules for the MLP above, for einshard(params, rules); `einshard demo --rules` trains the demo's "
            "transformer: plan that with --model transformer"
        )
    command = ["einshard", "demo", "--rules", args.rules_out]
    if args.batch is not None:
        command += ["--batch", str(args.batch)]
    return "use: " + shlex.join(command)
