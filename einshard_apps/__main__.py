"""``python -m einshard_apps``: the same command line as ``einshard``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
