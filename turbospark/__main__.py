"""``python -m turbospark``: the command line lives in ``cli/``."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
