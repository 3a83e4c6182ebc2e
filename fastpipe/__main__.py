"""``python -m fastpipe``: the ``fastpipe`` command, also for ``torchrun -m fastpipe train ...``."""

import sys

from fastpipe.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(main())
