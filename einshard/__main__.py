"""``python -m einshard``: the command line (see einshard.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
