"""``python bench/schedules.py --json out.json --png out.png``: see :mod:`fastpipe.bench.schedules`."""

from fastpipe.bench.schedules import main

if __name__ == "__main__":
    raise SystemExit(main())
