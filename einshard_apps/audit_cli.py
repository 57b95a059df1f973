"""``einshard audit``: audit a rule set you already have on a model step (einshard.audit), from sizes only.

    einshard audit --rules rules.json --model transformer --mesh data=4,model=2 --budget 2GiB
    einshard audit --rules keras_layout.json --mesh data=2,model=4

The rules file is JSON in one of three forms, told apart by their keys:

* einshard's (what ``einshard plan --rules-out`` writes): ``{"params": {pattern: expression}}``, optionally
  with ``"batch": expression`` (the batch's layout; default its first axis over the mesh's first axis) and
  ``"axis_rules": {logical name: mesh axes}`` for logical names in the expressions;
* a Keras ``LayoutMap`` as data: ``{"keras": {path regex: [mesh axis or null, ...]}}``;
* MaxText's (or Flax's) logical rules and names: ``{"logical_axis_rules": [[name, [axes]], ...],
  "logical_axes": {variable: [names]}}``.

The model is ``--model mlp`` (``relu(X @ W1) @ W2``; parameters ``w1``, ``w2``) or ``--model transformer``
(the demo's), planned as a training step.  Prints what each rule matches, what no rule matches (replicated,
largest first), memory per device against ``--budget``, explain's collectives and ``plan``'s layout beside
it.  Exit status 1 when something is left unmatched or the rules do not fit the budget.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # (annotations only: the command line imports jax lazily)
    from einshard.core.mesh import MeshLike

__all__ = ["arguments", "run"]


def arguments(parser: argparse.ArgumentParser) -> None:
    """``einshard audit``'s arguments (pure argparse: ``einshard --help`` starts no JAX)."""
    from .arguments import _positive  # counts as plan's: a zero or negative size is refused, naming the option

    parser.add_argument("--rules", required=True, help="the rule set, a JSON file (see `einshard audit --help`)")
    parser.add_argument("--model", choices=["mlp", "transformer"], default="mlp", help="the model (default mlp)")
    parser.add_argument("--mesh", default="data=4,model=2", help="mesh axis sizes (default data=4,model=2)")
    parser.add_argument("--budget", default=None, help="memory per device, e.g. 2GiB (default: none)")
    parser.add_argument(
        "--profile",
        default=None,
        help="hardware profile: h100, tpu-v5p, cpu (default: this machine's, cpu on a CPU, as plan's)",
    )
    parser.add_argument("--batch", type=_positive, default=None, help="global batch (default 16 / 16384 for the mlp)")
    parser.add_argument(
        "--width", type=_positive, default=1024, help="the mlp's x width; y = 2x, z = x/2 (default 1024)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    from einshard.audit import audit

    from .presets import parse_mesh

    mesh = parse_mesh(args.mesh)
    step, params, batch = _model(args)
    rules, axis_rules, data_rules = _read_rules(args.rules, params, mesh)
    report = audit(
        step,
        params,
        batch,
        rules=rules,
        mesh=mesh,
        budget=args.budget,
        profile=args.profile,
        axis_rules=axis_rules,
        data_rules=data_rules,
    )
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0 if report.fits and not report.unmatched else 1


def _read_rules(path: str, params: Any, mesh: MeshLike) -> tuple[Any, Any, Any]:
    """(the parameters' rules, the logical-axis table, the batch's expression) from a rules file."""
    from einshard.errors import EinshardError
    from einshard.interop import from_keras, from_maxtext

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise EinshardError(f"--rules {path}: cannot read it as JSON: {err}") from None
    if not isinstance(data, dict):
        raise EinshardError(f"--rules {path}: a JSON object is expected, got {type(data).__name__}")
    if "keras" in data:
        layout = {k: tuple(v) if isinstance(v, list) else v for k, v in data["keras"].items()}
        return from_keras(layout, params, mesh=mesh), None, None
    if "logical_axis_rules" in data:
        names = {k: tuple(v) for k, v in data.get("logical_axes", {}).items()}
        return from_maxtext(data["logical_axis_rules"], names, params, mesh=mesh), None, None
    if "params" in data:
        return data["params"], data.get("axis_rules"), data.get("batch")
    raise EinshardError(
        f"--rules {path}: expected the key 'params' (einshard rules), 'keras' (a LayoutMap) or "
        f"'logical_axis_rules' (MaxText/Flax), found {sorted(data)}"
    )


def _model(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    import jax
    import jax.numpy as jnp

    if args.model == "transformer":
        from .models import transformer as tm

        cfg = tm.Config()
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tm.init(cfg, 0))
        return jax.value_and_grad(tm.loss_fn), params, jax.ShapeDtypeStruct((args.batch or 16, cfg.seq + 1), jnp.int32)
    x, y, z = args.width, 2 * args.width, max(args.width // 2, 1)

    def mlp_loss(params: Any, batch: Any) -> Any:
        return jnp.mean((jax.nn.relu(batch @ params["w1"]) @ params["w2"]) ** 2)

    params = {"w1": jax.ShapeDtypeStruct((x, y), jnp.float32), "w2": jax.ShapeDtypeStruct((y, z), jnp.float32)}
    return jax.value_and_grad(mlp_loss), params, jax.ShapeDtypeStruct((args.batch or 16384, x), jnp.float32)
