"""The command line's arguments, one function per command: pure argparse, no JAX.

``einshard --help`` (and every ``einshard COMMAND --help``) builds its parser from here without importing JAX
or the library; a command's module (``demo``, ``analyze_cli``, ...) is imported only when it runs.  The few
names the help lists (presets, hardware profiles) are written out here, and ``tests/test_cli_help.py`` checks
they are the library's own.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["demo", "analyze", "show", "plan", "audit", "check_explicit", "PRESET_NAMES", "PROFILE_NAMES", "DEMO_STEPS"]

PRESET_NAMES = ("dp", "fsdp", "tp", "hybrid", "fsdp-tp", "tp-async", "pipeline")
PROFILE_NAMES = ("cpu", "h100", "tpu-v5p")
DEMO_STEPS = 20


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a size of 0 or less is refused here, never replaced by a default)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (a learning rate of NaN, inf, 0 or less trains nothing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text!r}")
    return value


def _name(text: str) -> str:
    """An argparse type: a non-empty name (an empty --layout would silently mean the default)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name, got an empty string")
    return text


def _target(text: str) -> str:
    """An argparse type: a target einshard knows ('tpu:v5p:4x4x4', 'gpu:h100x8'); checked when given (the
    parser's import of einshard.targets happens only then, so `einshard --help` still starts no JAX)."""
    from einshard.errors import EinshardError
    from einshard.targets import parse_target

    try:
        parse_target(text)
    except EinshardError as err:
        raise argparse.ArgumentTypeError(str(err).splitlines()[0]) from None
    return text


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


class _Once(argparse._StoreAction):
    """A value option given twice is an error: argparse would keep the last silently (``--mesh a=2 --mesh b=2``)."""

    # The namespaces this option was stored into (kept here, not in the namespace: the demo's launcher
    # passes every namespace attribute on to its workers).  A parser is built per command line.
    parsed_into: list[argparse.Namespace]

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        seen = self.__dict__.setdefault("parsed_into", [])
        if any(ns is namespace for ns in seen):
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice (give it once)")
        seen.append(namespace)
        super().__call__(parser, namespace, values, option_string)


def refuse_repeats(parser: argparse.ArgumentParser) -> None:
    """Every value option of ``parser`` (``--mesh X``, not flags such as ``--json``) may be given once."""
    for action in parser._actions:
        if type(action) is argparse._StoreAction and action.option_strings:
            action.__class__ = _Once


def demo(parser: argparse.ArgumentParser) -> None:
    layouts = ", ".join(PRESET_NAMES)
    g = parser.add_argument_group("layout")
    g.add_argument(
        "--layout",
        type=_name,
        default=None,
        help=f"a preset: {layouts}, or 'all' (the default, unless --rules is given)",
    )
    g.add_argument(
        "--rules",
        metavar="FILE",
        help='your own layout: JSON {"batch": EXPR, "params": {PATTERN: EXPR}, "mesh": "data=4,model=2"} '
        "or lines 'PATTERN: EXPR' ('batch:' and 'mesh:' lines are reserved); first matching pattern wins",
    )
    g.add_argument("--mesh", metavar="AXES", help="mesh axis sizes, e.g. data=4,model=2 (default: the preset's)")
    g.add_argument(
        "--devices", type=_positive, default=8, help="simulated CPU devices when no accelerator is present (default 8)"
    )
    g.add_argument(
        "--processes", type=_positive, default=1, help="run as N local processes with jax.distributed (CPU, gloo)"
    )
    t = parser.add_argument_group("training")
    t.add_argument("--data", metavar="PATH", help="a UTF-8 text file to train on (default: a text einshard ships)")
    t.add_argument("--steps", type=_non_negative, default=DEMO_STEPS, help=f"steps per layout (default {DEMO_STEPS})")
    t.add_argument("--batch", type=_positive, default=16, help="sequences per step, global (default 16)")
    t.add_argument("--seq", type=_positive, default=64, help="bytes per sequence (default 64)")
    t.add_argument("--layers", type=_positive, default=2, help="transformer blocks (default 2)")
    t.add_argument("--width", type=_positive, default=64, help="model width d (default 64)")
    t.add_argument("--heads", type=_positive, default=8, help="attention heads h (default 8)")
    t.add_argument("--ffn", type=_positive, default=256, help="MLP hidden size f (default 256)")
    t.add_argument("--lr", type=_positive_number, default=3e-3, help="AdamW learning rate (default 3e-3)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also train on one device and compare every step's loss (default: on)",
    )
    x = parser.add_argument_group("explicit programs (--layout tp-async, pipeline)")
    x.add_argument(
        "--ring",
        choices=("one-way", "two-way", "sync"),
        default=None,
        help="tp-async: the collective-matmul ring schedule (default one-way; sync = plain collectives)",
    )
    x.add_argument(
        "--microbatches",
        type=_positive,
        default=None,
        help="pipeline: micro-batches per data shard (default: up to 2 x stages)",
    )
    x.add_argument(
        "--schedule",
        choices=("gpipe", "circular", "1f1b"),
        default=None,
        help="pipeline: gpipe (default), circular (each micro-batch goes round the stages layers/stages times) "
        "or 1f1b (one forward / one backward per stage: at most ~stages micro-batches of activations kept)",
    )
    o = parser.add_argument_group("state and output")
    o.add_argument(
        "--checkpoint",
        metavar="DIR",
        help="save the sharded state here (an orbax directory, replaced atomically) at the end or on Ctrl-C",
    )
    o.add_argument(
        "--resume",
        metavar="DIR",
        help="restore a checkpoint (or an einshard <= 0.3 .npz), laid out by this run's layout",
    )
    o.add_argument("--plot", metavar="PATH", help="write the loss curves and bytes per device (PNG/SVG; matplotlib)")
    o.add_argument("--plain", action="store_true", help="plain progress lines instead of a progress bar")
    # Set by --processes for the workers it starts.
    parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
    refuse_repeats(parser)


def analyze(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "expression", help="an annotated einsum, e.g. 'b x@data, x y@model -> b? y?' (? lets the analyzer choose)"
    )
    parser.add_argument("--mesh", default="", help="mesh axis sizes, e.g. data=4,model=2")
    parser.add_argument("--sizes", default="", help="einsum axis sizes, e.g. b=1024,x=4096,y=16384")
    parser.add_argument("--dtype", default="f32", help="element type: f32, bf16, f16, f8, ... (default f32)")
    parser.add_argument(
        "--profile", default="cpu", choices=PROFILE_NAMES, help="hardware for time estimates (default cpu)"
    )
    parser.add_argument(
        "--alternatives", type=_non_negative, default=8, help="how many alternatives to show (default 8)"
    )
    parser.add_argument("--json", action="store_true", help="print plan.to_dict() as JSON")
    parser.add_argument("--plain", action="store_true", help="plain text even if rich is installed")
    refuse_repeats(parser)


def show(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("expression", help="a placement, e.g. 'b s d -> b@data s d@model' or 'a b -> a4 b*'")
    parser.add_argument("--shape", required=True, help="the array's shape, e.g. 8,16,32")
    parser.add_argument("--mesh", help="mesh axis sizes for '@' expressions, e.g. data=4,model=2")
    parser.add_argument("--dims", help="the dimensions drawn as rows,columns (names or indices)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--devices", type=_positive, default=None, help="simulated CPU devices (default: the mesh's size, else 8)"
    )
    refuse_repeats(parser)


def plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=["mlp", "transformer", "llama-7b", "llama-70b"],
        default="mlp",
        help="the model to plan (default: mlp; llama-7b/-70b: Llama-2-sized decoders, shapes only, bf16, scanned)",
    )
    parser.add_argument(
        "--mesh", default=None, help="mesh axis sizes (default data=4,model=2; with --target: the target's default)"
    )
    parser.add_argument(
        "--target",
        type=_target,
        default=None,
        help="hardware to plan for: tpu:GEN:TOPOLOGY (tpu:v5p:4x4x4; --verify compiles with the TPU compiler, "
        "needs einshard[tpu]) or gpu:CHIPxN (gpu:h100x8: a profile only); budget defaults to its HBM",
    )
    parser.add_argument("--layers", type=_positive, default=None, help="llama models: another depth")
    parser.add_argument("--seq", type=_positive, default=None, help="llama models: sequence length (default 4096)")
    parser.add_argument(
        "--budget",
        default=None,
        help="memory per device, e.g. 2GiB (default: this machine's GPU/TPU memory, none on a CPU or with --profile)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="hardware profile: h100, tpu-v5p, cpu (default: this machine's, cpu on a CPU; named in the output)",
    )
    parser.add_argument(
        "--verify",
        nargs="?",
        type=int,
        const=3,
        default=None,
        metavar="K",
        help="compile the K best layouts and the best preset with XLA (shapes only) and choose by the compiled "
        "collectives and memory (K default 3; 0: never; default: on when the model has ops without a rule)",
    )
    parser.add_argument(
        "--explicit",
        action="store_true",
        help="plan on a mesh with Explicit axes (jax.make_mesh's default, as a user's step runs on it) instead of "
        "sizes: --verify compiles each candidate as that typed program, and names the layouts JAX refuses there",
    )
    parser.add_argument("--objective", default="training", choices=["training", "inference", "memory", "communication"])
    parser.add_argument(
        "--batch",
        type=_positive,
        default=None,
        help="global batch (default: 16 for the transformer, 16384 for the mlp)",
    )
    parser.add_argument(
        "--width", type=_positive, default=1024, help="the demo's x width; y = 2x, z = x/2 (default 1024)"
    )
    parser.add_argument("--rules-out", default=None, help="write the parameter rules as JSON here")
    refuse_repeats(parser)


def check_explicit(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--function",
        metavar="FILE.py:NAME",
        help="your function of no arguments returning (fn, args) or (fn, args, kwargs): placed arrays or "
        "ShapeDtypeStructs with shardings (also module:NAME)",
    )
    what.add_argument(
        "--layout", choices=PRESET_NAMES[:5], default=None, help="the demo transformer under a preset (default hybrid)"
    )
    what.add_argument(
        "--rules", metavar="FILE", help="the demo transformer under your rules file (demo --rules format)"
    )
    parser.add_argument("--mesh", default=None, help="mesh axis sizes, e.g. data=4,model=2 (every axis Explicit)")
    parser.add_argument("--batch", type=_positive, default=16, help="the demo model's global batch (default 16)")
    parser.add_argument(
        "--profile", default="cpu", choices=PROFILE_NAMES, help="hardware for the fixes' costs (default cpu)"
    )
    parser.add_argument("--json", action="store_true", help="print the report's to_dict() as JSON")
    parser.add_argument(
        "--exit-zero", action="store_true", help="exit 0 even when JAX rejects an op (a report-only CI step)"
    )
    refuse_repeats(parser)


def audit(parser: argparse.ArgumentParser) -> None:
    from .audit_cli import arguments  # the verb's arguments live beside its run()

    arguments(parser)
    refuse_repeats(parser)
