"""``python -m labkit ...``: the command line (``labkit.cli``)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
