"""Checks of the demo's flags and layouts that run before any training (and before JAX starts where they can).

A layout that cannot fit the model, a flag the chosen layout does not take or a mesh no preset uses is reported
here, in terms of the command-line flags that change it, instead of after minutes of reference training.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from einshard.errors import EinshardError

from ..presets import PRESETS, Preset, load_rules, parse_mesh

__all__ = ["check_layout_fits", "chosen_presets", "check_arguments"]

# Which command-line flag sets the size of each axis the presets name.
_AXIS_FLAGS = {"l": "--layers", "b": "--batch", "d": "--width", "h": "--heads", "f": "--ffn", "s": "--seq"}


def check_layout_fits(preset: Preset, mesh: dict[str, int], cfg: Any, batch: int, seed: int = 0) -> None:
    """Resolve every expression of ``preset`` against the model's and the batch's shapes on ``mesh`` (sizes only).

    Costs no device work (``jax.eval_shape``), so a layout that cannot fit is reported before any training,
    with the flag that changes the offending size.
    """
    import jax

    from einshard._src.tree_rules import leaf_expressions
    from einshard.placement import layout as _layout

    from ..models.transformer import init

    abstract = jax.eval_shape(lambda: init(cfg, seed))
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    try:
        texts = leaf_expressions(abstract, preset.params)
    except EinshardError as err:
        raise EinshardError(f"layout {preset.name!r}: {err.reason}", err.expression, err.column, err.hint) from None
    checks = [(jax.tree_util.keystr(path), tuple(leaf.shape), text) for (path, leaf), text in zip(leaves, texts)]
    checks.append(("the batch", (batch, cfg.seq + 1), preset.batch))
    for where, shape, text in checks:
        if text is None:
            continue
        try:
            _layout(text, shape, mesh=mesh)
        except EinshardError as err:
            flags = [f"{flag} (axis '{axis}')" for axis, flag in _AXIS_FLAGS.items() if f"'{axis}'" in err.reason]
            hint = err.hint or ""
            if flags:  # a size that does not split: say which flag sets it
                hint = (hint + " " if hint else "") + "Change " + " or ".join(flags) + ", or choose another --mesh."
            mesh_text = ",".join(f"{k}={v}" for k, v in mesh.items())
            raise EinshardError(
                f"layout {preset.name!r} on mesh {mesh_text} does not fit {where} (shape {shape}): {err.reason}",
                err.expression,
                err.column,
                hint,
            ) from None


def chosen_presets(args: argparse.Namespace) -> tuple[list[Preset], dict[str, int] | None]:
    mesh = parse_mesh(args.mesh) if args.mesh else None
    if args.rules:
        if args.layout not in (None,):
            raise EinshardError("--rules replaces --layout: give one of them")
        preset, file_mesh = load_rules(args.rules)
        return [preset], mesh or file_mesh
    name = args.layout or "all"
    if name == "all":
        return list(PRESETS.values()), mesh
    if name not in PRESETS:
        raise EinshardError(f"--layout {name!r} is not a preset; the presets are: {', '.join(PRESETS)}, all")
    return [PRESETS[name]], mesh


def check_arguments(args: argparse.Namespace) -> tuple[list[Preset], dict[str, int] | None, dict[str, Any]]:
    """The layouts to train, the ``--mesh`` (or None) and the step options, every flag checked (no JAX needed)."""
    presets, mesh_arg = chosen_presets(args)
    if (args.checkpoint or args.resume) and len(presets) > 1:
        raise EinshardError("--checkpoint and --resume save one layout's state: pick one with --layout")
    options = {
        k: v for k, v in (("ring", args.ring), ("microbatches", args.microbatches), ("schedule", args.schedule)) if v
    }
    for key in options:
        if not any(key in p.step_options for p in presets):
            owners = ", ".join(p.name for p in PRESETS.values() if key in p.step_options) or "none"
            raise EinshardError(f"--{key} applies to --layout {owners} only")
    if mesh_arg and len(presets) > 1:
        # '--layout all --mesh data=2,model=4': the presets written for other mesh axes are left out.
        skipped = [p.name for p in presets if set(p.default_mesh(math.prod(mesh_arg.values()))) != set(mesh_arg)]
        presets = [p for p in presets if p.name not in skipped]
        if skipped:
            print(f"--mesh {args.mesh}: leaving out {', '.join(skipped)} (other mesh axes)", file=sys.stderr)
        if not presets:
            raise EinshardError(f"--mesh {args.mesh}: no preset uses these mesh axes")
    return presets, mesh_arg, options
