"""What the memory tests share: the CPU byte counter, a loss that says how it reduces, a thread runner,
and the steps by which a rank's pipe is held against its ``memory_limit``."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest
import torch
from torch import nn

if TYPE_CHECKING:
    from fastpipe import DistributedPipe, Pipe
    from fastpipe.memory.accounting import PeakMemory
    from fastpipe.memory.model import DeviceMemory

__all__ = [
    "LimitRefusal",
    "ProductLoss",
    "install_counter_or_skip",
    "metered_after_a_first_step",
    "on_thread",
    "refuse_the_bare_prediction",
]


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


@dataclass
class LimitRefusal:
    """What :func:`refuse_the_bare_prediction` saw on this rank.

    Attributes:
        devices: the prediction of every device, from a step run without a binding limit.
        refused: the ``ValueError`` of a step under the largest of them ("" if the step ran).
        untouched: no parameter had a gradient after that step, so no action ran before the refusal.
        limit: the largest prediction plus the guard's margin (and a byte): a limit the pipe must run under.
    """

    devices: list[DeviceMemory]
    refused: str
    untouched: bool
    limit: int

    def report(self, counted: int) -> dict[str, Any]:
        """What a rank hands back to its test, with ``counted`` the bytes it held when run under :attr:`limit`.

        Each device is ``(worker, total bytes)``, so that the ranks' predictions compare as plain values.
        """
        return {
            "devices": [(d.worker, d.total) for d in self.devices],
            "refused": self.refused,
            "untouched": self.untouched,
            "limit": self.limit,
            "counted": counted,
        }


def refuse_the_bare_prediction(
    pipe: Callable[[int | str], DistributedPipe], x: torch.Tensor, y: torch.Tensor
) -> LimitRefusal:
    """Predict every device with a free limit, then step a pipe whose limit is that prediction itself.

    The guard keeps a margin free, so the second step must be refused. Both pipes are closed and
    released before this returns, so that what the caller counts next is its own pipe's.

    Args:
        pipe: builds this rank's pipe under the given ``memory_limit``.
        x, y: the batch and its target (whole on every rank, as ``train_step`` takes them).
    """
    from fastpipe.memory.limit import MARGIN

    free = pipe("1TiB")
    free.train_step(x, y, ProductLoss())
    assert free.memory_guard is not None, "a pipe built with memory_limit has a guard"
    devices = free.memory_guard.last
    free.close()
    del free
    need = max(d.total for d in devices)

    tight = pipe(need)
    refused = ""
    try:
        tight.train_step(x, y, ProductLoss())
    except ValueError as exc:
        refused = str(exc)
    untouched = all(p.grad is None for p in tight.parameters())
    tight.close()
    del tight
    return LimitRefusal(devices, refused, untouched, int(need * (1 + MARGIN)) + 1)


def metered_after_a_first_step(
    pipe: DistributedPipe | Pipe, opt: torch.optim.Optimizer | None, x: torch.Tensor, y: torch.Tensor
) -> PeakMemory:
    """The bytes of this rank's second training step, counted by the CPU counter.

    The first step, with ``opt``'s, builds what later steps reuse (receive buffers, the optimizer's
    state), so the counted step shows what every step after it holds. Without ``opt`` the first
    step's gradients are dropped.
    """
    from fastpipe.memory.accounting import PeakMeter

    pipe.train_step(x, y, ProductLoss())
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    else:
        pipe.zero_grad(set_to_none=True)
    gc.collect()
    with PeakMeter("cpu") as meter:
        pipe.train_step(x, y, ProductLoss())
    return meter.result
