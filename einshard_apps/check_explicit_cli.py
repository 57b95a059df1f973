"""``einshard check-explicit``: which ops of a training step JAX's default (Explicit) mesh rejects, with fixes.

    einshard check-explicit --layout hybrid --mesh data=4,model=2      # the demo transformer, a preset's layouts
    einshard check-explicit --rules rules.json                          # ... your rules file (demo --rules format)
    einshard check-explicit --function my_model.py:check                # your own function

``--function FILE.py:NAME`` (or ``package.module:NAME``) names a function of no arguments returning ``(fn, args)``
or ``(fn, args, kwargs)``: arrays placed on a mesh with Explicit axes, or ``jax.ShapeDtypeStruct``s with
shardings; the mesh is theirs (or ``--mesh``: axis sizes, every axis Explicit).  It runs
:func:`einshard.check_explicit` and prints its report (``--json``: ``to_dict()``).  The exit status is 0 when JAX
accepts every op, 1 when some op is rejected (so a CI step fails before the training job does; ``--exit-zero``
reports only).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import pathlib
import sys
from typing import Any

__all__ = ["run"]


def _load_function(spec: str) -> Any:
    from einshard.errors import EinshardError

    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name.isidentifier():
        raise EinshardError(f"--function takes FILE.py:NAME or module:NAME, got {spec!r}")
    if target.endswith(".py"):
        path = pathlib.Path(target)
        if not path.is_file():
            raise EinshardError(f"--function: no file {target!r}")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None:
            raise EinshardError(f"--function: cannot import {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        sys.path.insert(0, str(path.resolve().parent))
        module_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise EinshardError(f"--function: cannot import {target!r}: {err}") from None
    if not hasattr(module, name):
        raise EinshardError(f"--function: {target!r} has no {name!r}")
    return getattr(module, name)


def _from_function(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    from einshard.errors import EinshardError

    made = _load_function(args.function)()
    if not isinstance(made, tuple) or len(made) not in (2, 3) or not callable(made[0]):
        raise EinshardError(f"--function {args.function}: expected it to return (fn, args) or (fn, args, kwargs)")
    fn, fargs = made[0], made[1]
    fkwargs = made[2] if len(made) == 3 else {}
    return fn, tuple(fargs), dict(fkwargs), {}


def _from_demo(args: argparse.Namespace) -> tuple[Any, tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    from .models import transformer as tm
    from .presets import PRESETS, expressions_for, load_rules, parse_mesh

    if args.rules:
        preset, rules_mesh = load_rules(args.rules)
    else:
        preset, rules_mesh = PRESETS[args.layout], None
    cfg = tm.Config()
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tm.init(cfg, 0))
    batch = jax.ShapeDtypeStruct((args.batch, cfg.seq + 1), jnp.int32)
    mesh = parse_mesh(args.mesh) if args.mesh else rules_mesh or preset.default_mesh(8)
    in_specs = (expressions_for(params, preset.params), preset.batch)
    print(f"the demo transformer's training step ({cfg.layers} layers, width {cfg.width}), layout {preset.name}")
    return jax.grad(tm.loss_fn), (params, batch), {}, {"mesh": mesh, "in_specs": in_specs}


def run(args: argparse.Namespace) -> int:
    import einshard
    from einshard.errors import EinshardError

    if args.function and (args.layout or args.rules):
        raise EinshardError("--function checks your own function; --layout and --rules choose the demo model's")
    if args.function:
        fn, fargs, fkwargs, options = _from_function(args)
        if args.mesh:
            from .presets import parse_mesh

            options["mesh"] = parse_mesh(args.mesh)
    else:
        args.layout = args.layout or "hybrid"
        fn, fargs, fkwargs, options = _from_demo(args)
    report = einshard.check_explicit(fn, *fargs, profile=args.profile, **options, **fkwargs)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.ok or args.exit_zero else 1
