"""What the memory tests share: the CPU byte counter, a loss that says how it reduces, a thread runner."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

__all__ = ["ProductLoss", "install_counter_or_skip", "on_thread"]


class ProductLoss(nn.Module):
    """``(out * target).mean()``, a mean over samples that says so (no per-micro-batch weighting warning)."""

    reduction = "mean"

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out * target).mean()


def install_counter_or_skip() -> None:
    """Install the exact CPU byte counter now (before the tensors to count exist), or skip the test."""
    from fastpipe.memory._cpu_counter import CounterUnavailableError, install

    try:
        install()
    except CounterUnavailableError as exc:
        pytest.skip(f"no CPU byte counter here: {exc}")


def on_thread(fn: Callable[[], object]) -> int:
    """Run ``fn`` on a new thread, re-raising what it raised; returns that thread's id."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:  # handed to the test's thread
            errors.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if errors:
        raise errors[0]
    assert worker.ident is not None
    return worker.ident
