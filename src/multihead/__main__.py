"""``python -m multihead``: the ``multihead`` command (see :mod:`multihead.cli.main`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
