"""``python bench/copy_overlap.py [--backend auto|host|cuda] [--runs 5]``: see :mod:`fastpipe.bench.copy_overlap`."""

from fastpipe.bench.copy_overlap import main

if __name__ == "__main__":
    main()
