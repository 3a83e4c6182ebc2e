"""``python bench/kernels.py [--json out.json] [--rows N] [--hidden H]``: see :mod:`fastpipe.bench.kernels`."""

import sys

from fastpipe.bench.kernels import main

if __name__ == "__main__":
    main(sys.argv[1:])
