"""``python -m einshard_apps.demo``: the same as ``einshard demo``."""

import sys

from ..cli import main

sys.exit(main(["demo", *sys.argv[1:]]))
