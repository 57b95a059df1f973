"""The ``einshard`` command line: ``einshard demo``, ``einshard analyze``, ``einshard show``, ``einshard plan``.

Each verb is named after the library function it runs (``analyze`` runs :func:`einshard.analyze`).  ``einshard explain``
was that verb's name before 0.4: it still runs ``analyze`` and says so on stderr.

Each command is a pair: its arguments in :mod:`einshard_apps.arguments` (pure argparse, so ``einshard --help``
starts no JAX) and a module with ``run(args) -> int``, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from . import arguments

__all__ = ["main", "COMMANDS", "RENAMED"]

# name -> (the module that runs it, one-line help); arguments.<name> declares its arguments.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "einshard_apps.demo",
        "train a small transformer under every layout: dp, fsdp, tp, hybrid, fsdp-tp, tp-async "
        "(collective-matmul rings) and pipeline",
    ),
    "analyze": ("einshard_apps.analyze_cli", "analyse an annotated einsum: strategy, collectives, cost, alternatives"),
    "show": ("einshard_apps.show_cli", "draw an array layout of any rank: which devices hold which block"),
    "plan": ("einshard_apps.plan_cli", "plan the demo model's layouts for a mesh and a memory budget"),
    "audit": ("einshard_apps.audit_cli", "audit a rule set (einshard, Keras LayoutMap, MaxText) on a model step"),
    "check-explicit": (
        "einshard_apps.check_explicit_cli",
        "name every op JAX's default (Explicit) mesh rejects, with out_sharding=/reshard fixes and their costs",
    ),
}

# Verbs renamed in 0.4 (old -> new): still accepted, with a note on stderr.
RENAMED: dict[str, str] = {"explain": "analyze"}

SYNTAX_HELP = """\
einshard expressions (README.md, "Syntax"; https://pypi.org/project/einshard/):

  placement   'x y -> x y@model'          y split over the mesh axis 'model'
              'b d -> b@(data,fsdp) d'    b split over two mesh axes, major to minor
              'x y -> x y*'               einshard 0.2 counts: y split over all devices
              'a b -> 2 a2* b'            replicate twice, a gets the rest
  einsum      'b x@data, x y@model -> b y@model'
              'b x@model, x@model y -> b y {U:model}'   pending partial sums
"""


def version() -> str:
    """The installed einshard's version, read without importing the library (``--version`` starts no JAX)."""
    import importlib.metadata
    import pathlib
    import re

    try:
        return importlib.metadata.version("einshard")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout on PYTHONPATH: the source says it
        init = pathlib.Path(__file__).resolve().parent.parent / "einshard" / "__init__.py"
        found = re.search(r'^__version__ = "([^"]+)"', init.read_text(encoding="utf-8"), re.M)
        return found.group(1) if found else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="einshard",
        description="Readable sharding for JAX.",
        epilog=SYNTAX_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"einshard {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog=SYNTAX_HELP,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        getattr(arguments, name.replace("-", "_"))(p)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in RENAMED:
        print(f"einshard: '{argv[0]}' is now '{RENAMED[argv[0]]}' (running that)", file=sys.stderr)
        argv[0] = RENAMED[argv[0]]
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from einshard.errors import EinshardError  # the library (and JAX) start only when a command runs

    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except EinshardError as err:
        print(f"einshard {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"einshard {args.command}: interrupted", file=sys.stderr)
        return 130
