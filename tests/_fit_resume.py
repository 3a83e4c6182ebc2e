"""One fit run against the same run saved at a drained point and resumed in fresh objects."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import fastpipe

Fresh = Callable[[], tuple[Any, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]]


def whole_and_resumed(
    fresh: Fresh, batches: list[Any], consistency: str, directory: Any, split: int = 4, window: int = 2
) -> tuple[list[float], Any, list[float], Any]:
    """``(losses, pipe)`` of one uninterrupted run and of the run saved after ``split`` mini-batches
    (a multiple of ``window``: nothing in flight) and resumed from the file with new objects."""
    path = os.path.join(directory, "ckpt.pt")
    loss_fn = nn.MSELoss()
    whole_pipe, opt, sched = fresh()
    whole = [
        loss.item()
        for loss in whole_pipe.fit(batches, loss_fn, opt, consistency=consistency, scheduler=sched, window=window)
    ]
    pipe, opt, sched = fresh()
    run = pipe.fit(batches[:split], loss_fn, opt, consistency=consistency, scheduler=sched, window=window)
    first = [loss.item() for loss in run]
    assert run.steps % run.window == 0  # a drained point
    fastpipe.save(pipe, path, opt)
    sched_state = sched.state_dict()
    pipe, opt, sched = fresh()
    fastpipe.load(path, pipe, opt)
    sched.load_state_dict(sched_state)
    rest = [
        loss.item()
        for loss in pipe.fit(batches[split:], loss_fn, opt, consistency=consistency, scheduler=sched, window=window)
    ]
    return whole, whole_pipe, first + rest, pipe
