"""``fastpipe train`` with one rank SIGKILLed mid-run: the fault injection of the kill-and-resume tests.

Run: ``torchrun ... tests/_kill_in_train.py STEP RANK train ARGS...`` (or ``python``, for one
process and ``RANK`` 0). Rank ``RANK`` SIGKILLs itself when it is about to run step index
``STEP`` (after ``STEP`` steps), once: a marker file ``.killed-at-step-STEP`` in ``--out``
keeps the run that torchrun restarts from dying again. The rest is the real ``fastpipe
train``; the kill is installed by wrapping the run's loss stream, which yields one loss per
step, so the product code holds no kill switch.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from fastpipe.cli import main

# The module, not the function that fastpipe.train exports under the same name.
train_run = importlib.import_module("fastpipe.train.run")

__all__ = ["install"]


def _dying(losses: Iterator[Any], job: Any, start: int, at: int, rank: int) -> Iterator[Any]:
    step = start
    while True:
        me = job.ranks.rank if job.ranks is not None else 0
        marker = os.path.join(job.args.out, f".killed-at-step-{step}")
        if step == at and me == rank and not os.path.exists(marker):
            os.makedirs(job.args.out, exist_ok=True)
            with open(marker, "w") as f:
                f.write(f"rank {me}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            loss = next(losses)
        except StopIteration:
            return
        yield loss
        step += 1


def install(at: int, rank: int) -> None:
    """Makes rank ``rank`` SIGKILL itself before step index ``at`` of every later ``fastpipe train`` run."""
    real = train_run._losses  # fails loudly if the run's loss stream is renamed

    def losses(job: Any, start: int) -> tuple[Iterator[Any], Any]:
        stream, fit_run = real(job, start)
        return _dying(stream, job, start, at, rank), fit_run

    train_run._losses = losses  # type: ignore[assignment]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    install(int(sys.argv[1]), int(sys.argv[2]))
    raise SystemExit(main(sys.argv[3:]))
