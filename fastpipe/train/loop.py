"""Where ``fastpipe train``'s per-step losses come from: a synchronous step loop or ``fit``.

The run loop in :mod:`.run` consumes one loss per optimizer step from either source and
does the rest (history, progress bar, saves) the same way for every schedule:

- :func:`sync_losses`: each step sets the learning rate, runs one ``train_step`` of a
  synchronous schedule and steps the optimizer;
- :func:`fit_losses`: :func:`fastpipe.asynchronous.fit` owns the optimizer step (XPipe and
  the other consistency policies); the learning rates come from :func:`step_scheduler`.

:func:`traced_window` runs the asynchronous schedule's traced extra window for the report.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from fastpipe.asynchronous import FitRun, fit
from fastpipe.trace.timeline import Timeline

__all__ = ["Batches", "StepRunner", "fit_losses", "step_scheduler", "sync_losses", "traced_window"]

StepRunner = Callable[..., Tensor]  # (pipe, x, y, loss_fn, trace) -> loss; see fastpipe.train.options
Batches = Iterable[tuple[Tensor | None, Tensor | None]]  # None: not this rank's (DistributedPipe)


def sync_losses(
    pipe: nn.Module,
    optimizer: torch.optim.Optimizer,
    runner: StepRunner,
    loss_fn: Any,
    batches: Batches,
    start: int,
    lr_at: Callable[[int], float],
    autocast: Callable[[], Any],
) -> Iterator[Tensor]:
    """One loss per batch: set step ``start + i``'s learning rate, run the step, update."""
    for step, (x, y) in enumerate(batches, start):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = runner(pipe, x, y, loss_fn, False)
        optimizer.step()
        yield loss


def step_scheduler(
    optimizer: torch.optim.Optimizer, start: int, lr_at: Callable[[int], float]
) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler whose ``k``-th learning rate is ``lr_at(start + k)``, bit for bit.

    LambdaLR multiplies each group's ``initial_lr`` by the factor, so ``initial_lr`` is set
    to 1.0 (a loaded optimizer state may carry another one): the rate is then exactly
    what the synchronous loop assigns at that step, and a resumed run needs no scheduler
    state, only its step.
    """
    for group in optimizer.param_groups:
        group["initial_lr"] = 1.0
        group["lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_at(start + k))


def fit_losses(run: FitRun, autocast: Callable[[], Any]) -> Iterator[Tensor]:
    """The losses of ``run``, each window run under ``autocast`` (the caller's code between losses is not)."""
    while True:
        with autocast():
            loss = next(run, None)
        if loss is None:
            return
        yield loss


def traced_window(
    pipe: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Any,
    batches: Batches,
    *,
    consistency: str,
    window: int,
    start: int,
    lr_at: Callable[[int], float],
    context: Callable[[], Any],
) -> tuple[Timeline, dict[int, int]]:
    """One traced window of ``fit`` on ``batches`` whose updates are then undone.

    The weights and the optimizer state are restored afterwards, so the report's timeline
    comes from a window like the training's without changing the trained model.

    Returns:
        The window's timeline and, per stage, the peak bytes of weight copies it held.
    """
    weights = {k: v.detach().clone() for k, v in pipe.state_dict().items()}
    state = copy.deepcopy(optimizer.state_dict())
    try:
        run = fit(
            pipe,
            batches,
            loss_fn,
            optimizer,
            consistency=consistency,
            scheduler=step_scheduler(optimizer, start, lr_at),
            window=window,
            trace=True,
        )
        with context():
            for _ in run:
                pass
    finally:
        pipe.load_state_dict(weights)
        optimizer.load_state_dict(state)
        optimizer.zero_grad(set_to_none=True)
    timeline = pipe.last_timeline
    assert isinstance(timeline, Timeline)
    return timeline, dict(run.weight_copy_bytes)
