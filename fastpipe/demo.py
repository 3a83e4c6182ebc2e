"""A quick smoke test: ``python -m fastpipe.demo`` is a short ``fastpipe train`` run.

It trains the character-level GPT of :mod:`fastpipe.train` for 30 steps (about 10 s of
compute on two CPU cores) and writes its report to ``fastpipe-demo/``. Extra arguments go to
``fastpipe train`` after these defaults, so they add options or override them
(``python -m fastpipe.demo --schedule zb-h1 --steps 5``). It runs from a clone's root as well as
from anywhere else (see :mod:`fastpipe._source_tree`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from fastpipe.cli import main as cli_main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs ``fastpipe train --steps 30 --out fastpipe-demo`` plus ``argv`` (later options win)."""
    extra = list(sys.argv[1:] if argv is None else argv)
    return cli_main(
        [
            "train",
            "--steps",
            "30",
            "--warmup",
            "10",
            "--eval-batches",
            "2",
            "--sample-chars",
            "80",
            "--out",
            "fastpipe-demo",
            *extra,
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
