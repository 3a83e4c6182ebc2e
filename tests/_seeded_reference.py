"""The plain model run the way a pipeline defines its randomness: micro-batch by micro-batch,
each stage's task with the default generators seeded by ``task_seed(step_seed, stage, mb)``.

A Pipe must give exactly these numbers (same micro-batch shapes, same ops, same streams), so
dropout models can be compared with a plain model, not only with another pipe run.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from fastpipe.rng.streams import draw_step_seed, task_seed
from fastpipe.step.microbatch import scatter

__all__ = ["step_seed_after", "seeded_forward"]


def step_seed_after(seed: int) -> int:
    """The step seed a pipeline draws first after ``torch.manual_seed(seed)``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return draw_step_seed()


def seeded_forward(
    model: nn.Sequential,
    balance: Sequence[int],
    x: Any,
    chunks: int,
    step_seed: int,
    per_output: Callable[[int, Any], Any] | None = None,
) -> list[Any]:
    """Run ``model`` on the micro-batches of ``x``; returns one result per micro-batch.

    ``per_output(mb, output)`` (e.g. a loss) runs inside the last stage's task, as
    ``train_step``'s loss does.
    """
    bounds = list(itertools.accumulate(balance, initial=0))
    parts = [nn.Sequential(*list(model)[a:b]) for a, b in zip(bounds, bounds[1:])]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    results = []
    for m, value in enumerate(scatter(x, chunks)):
        for s, part in enumerate(parts):
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(task_seed(step_seed, s, m))
                value = part(value)
                if s == len(parts) - 1 and per_output is not None:
                    value = per_output(m, value)
        results.append(value)
    return results
