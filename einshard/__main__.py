"""``python -m einshard``: the command line, which lives with the applications (einshard_apps.cli).

The library never imports the applications; this entry point only hands the process over to them.
"""

import sys

from einshard_apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
