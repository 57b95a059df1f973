"""``einshard demo``'s ``run(args)``: check everything, then train every chosen layout and compare them."""

from __future__ import annotations

import argparse
import math
from typing import Any

from einshard.errors import EinshardError

from ..presets import Preset
from .data import load_corpus
from .launcher import configure_jax, launch, rebuild_argv
from .loop import StopFlag, train_layout
from .preflight import check_arguments, check_layout_fits
from .report import final_table, matches_reference, print_plan, write_plot
from .trainer import RunResult, Trainer

__all__ = ["run", "SINGLE_DEVICE"]

# The reference every layout is compared with: the same training, every array whole on one device.
SINGLE_DEVICE = Preset("1 device", "the same training on one device", {".*": "... -> ..."}, "b s -> b s")


def run(args: argparse.Namespace) -> int:
    if args.processes > 1 and args.process_id is None:
        return launch(args, rebuild_argv(args))
    presets, mesh_arg, options = check_arguments(args)
    try:
        import optax  # noqa: F401
    except ImportError:
        raise EinshardError("einshard demo trains with optax: pip install 'einshard[examples]'") from None
    configure_jax(args)

    import jax

    import einshard

    from ..models.transformer import Config, count_params, init

    is_main = jax.process_index() == 0

    def say(text: str = "") -> None:
        if is_main:
            print(text, flush=True)

    if mesh_arg and math.prod(mesh_arg.values()) != jax.device_count():
        shown = ",".join(f"{k}={v}" for k, v in mesh_arg.items())
        raise EinshardError(
            f"--mesh {shown} has {math.prod(mesh_arg.values())} devices, but there are {jax.device_count()}"
        )
    cfg = Config(layers=args.layers, width=args.width, heads=args.heads, ffn=args.ffn, seq=args.seq)
    corpus = load_corpus(args.data)
    n = jax.device_count()
    for preset in presets:  # every layout checked against the model's shapes before any training starts
        check_layout_fits(preset, mesh_arg or preset.default_mesh(n), cfg, args.batch, args.seed)
    platform = jax.devices()[0].platform
    procs = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    say(f"einshard {einshard.__version__} on jax {jax.__version__}: {n} {platform} devices{procs}")
    params_count = count_params(init(cfg, args.seed))
    say(
        f"model: byte-level transformer, {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads, "
        f"MLP {cfg.ffn}, {params_count:,} parameters; text: {args.data or 'einshard_apps/data/corpus.txt'} "
        f"({len(corpus):,} bytes); {args.steps} AdamW steps of {args.batch} x {cfg.seq} tokens"
    )
    results: list[RunResult] = []
    reference: RunResult | None = None
    code = 0
    saved = False
    with StopFlag() as stop:
        if args.check:
            names = tuple((mesh_arg or presets[0].default_mesh(n)).keys())
            say(f"\n== single device: the same training on {jax.devices()[0]}, the reference for every layout")
            ref = Trainer(
                SINGLE_DEVICE,
                dict.fromkeys(names, 1),
                cfg,
                corpus,
                batch=args.batch,
                lr=args.lr,
                seed=args.seed,
                devices=jax.local_devices()[:1],
                resume=args.resume,
            )
            reference = train_layout(ref, args.steps, say=say, plain=args.plain, stop=stop, name="1 device")
        for preset in presets:
            if stop.requested:
                break
            sizes = mesh_arg or preset.default_mesh(n)
            say(f"\n== {preset.name}: {preset.what}")
            trainer = Trainer(
                preset,
                sizes,
                cfg,
                corpus,
                batch=args.batch,
                lr=args.lr,
                seed=args.seed,
                resume=args.resume,
                step_options=options if len(presets) == 1 else _accepted(options, preset),
            )
            print_plan(trainer, say)
            res = train_layout(trainer, args.steps, say=say, plain=args.plain, stop=stop)
            results.append(res)
            if reference is not None:
                ok, diff = matches_reference(res, reference)
                say(f"  loss matches the single-device run: {'yes' if ok else 'NO'} (max |diff| {diff:.1e})")
                if not ok:
                    code = 1
            if args.checkpoint:
                trainer.save(args.checkpoint)
                saved = True
                say(f"  saved step {trainer.step_index} to {args.checkpoint}")
        interrupted = stop.requested
    say("")
    for line in final_table(results, reference):
        say(line)
    if len(results) > 1:
        say(
            "\nEvery layout trains the same model to the same loss: only where the arrays live changes, and with it "
            "the memory per device and the collectives XLA inserts. Pick one with --layout NAME, write your own "
            "with --rules FILE, draw one with `einshard show`."
        )
    if args.plot and is_main:
        say(write_plot(args.plot, results, reference))
    if interrupted:
        say(
            "interrupted: stopped after the last finished step"
            + (f" (state saved to {args.checkpoint})" if saved else "")
        )
        return 130
    return code


def _accepted(options: dict[str, Any], preset: Preset) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in preset.step_options}
