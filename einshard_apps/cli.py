"""The ``einshard`` command line: ``einshard demo``, ``einshard explain``, ...

Each subcommand lives in the module of its layer and registers itself here
through ``COMMANDS``: name -> (module, one-line help).  A module provides
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from einshard.errors import EinshardError

__all__ = ["main", "COMMANDS"]

# Imported lazily so that `einshard --help` does not start JAX.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("einshard_apps.demo", "train a small transformer under data, FSDP, tensor and hybrid parallel layouts"),
    "explain": ("einshard_apps.explain_cli", "analyse an annotated einsum: strategy, collectives, cost, alternatives"),
    "show": ("einshard_apps.show_cli", "draw an array layout of any rank: which devices hold which block"),
    "plan": ("einshard_apps.plan_cli", "plan the demo model's layouts for a mesh and a memory budget"),
}

SYNTAX_HELP = """\
einshard expressions (https://github.com/ -- see README "Syntax"):

  placement   'x y -> x y@model'          y split over the mesh axis 'model'
              'b d -> b@(data,fsdp) d'    b split over two mesh axes, major to minor
              'x y -> x y*'               einshard 0.2 counts: y split over all devices
              'a b -> 2 a2* b'            replicate twice, a gets the rest
  einsum      'b x@data, x y@model -> b y@model'
              'b x@model, x@model y -> b y {U:model}'   pending partial sums
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="einshard",
        description="Readable sharding for JAX.",
        epilog=SYNTAX_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=SYNTAX_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except EinshardError as err:
        print(f"einshard {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"einshard {args.command}: interrupted", file=sys.stderr)
        return 130
