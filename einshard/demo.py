"""``einshard demo``: placeholder until the demo lands (see README)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator is present")


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
