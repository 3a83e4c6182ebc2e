"""The small values ranks exchange each step, kept off the GPU's queue.

A step shares a few numbers between ranks: the micro-batch sizes, the step's seed and its
schedule's digest before it, the loss and its NaN/inf flags after it, the loss scale. The host
reads every one of them. Over NCCL they would be copied into the GPU, queued behind the rank's
compute work on the collective's stream, and read back after it, so each exchange would empty
every rank's GPU queue. They travel instead over the pipeline's gloo control group (the
group itself on gloo, a gloo side group beside NCCL), in host memory; a value that lives on a
GPU reaches the host through :class:`~fastpipe.step.host_io.HostCopy` (pinned memory, one
wait). Only a data-parallel group that has no host backend (a pure NCCL group) reduces them
on its device, staged through pinned memory both ways.

:class:`LossReadback` starts the copy of the loss out of the last stage's device as soon as
the step's last micro-batch loss exists, so the wait at the end of the step does not include
the backward work queued after it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastpipe.distributed.backend import backend_for
from fastpipe.step.host_io import HostCopy, staged_to

__all__ = ["LOSS_DTYPES", "LossReadback", "host_broadcast", "host_reduce_groups", "host_all_reduce"]

Wait = Callable[[Any, str], None]

#: The loss dtypes a step's loss message names by index (-1: another dtype).
LOSS_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def host_reduce_groups(group: Any, comm_device: torch.device) -> list[tuple[Any, torch.device]]:
    """``[(group, where it reduces host values)]``: the CPU where it has a host backend, else
    ``comm_device`` (the GPU of a pure NCCL group); ``[]`` for no group."""
    if group is None:
        return []
    return [(group, torch.device("cpu") if backend_for(group, "cpu") in ("gloo", "mpi") else comm_device)]


def host_broadcast(values: Tensor, src: int, group: Any, wait: Wait, what: str) -> Tensor:
    """``values`` of global rank ``src`` on every rank of the host ``group`` (a CPU tensor), waited with ``wait``.

    A GPU tensor is copied to the host first (on ``src``, the only rank whose values count).
    """
    buf = HostCopy(values).read()
    wait(dist.broadcast(buf, src=src, group=group, async_op=True), what)
    return buf


def host_all_reduce(
    values: Tensor, groups: Sequence[tuple[Any, torch.device]], wait: Wait, what: str, op: Any = dist.ReduceOp.SUM
) -> Tensor:
    """``op`` of ``values`` over each ``(group, device)`` in turn (see :func:`host_reduce_groups`); a CPU tensor.

    Each all-reduce runs on its ``device``, waited for with ``wait``; the host reads the result once.
    """
    buf = values
    for group, device in groups:
        buf = staged_to(HostCopy(buf).read(), device)
        wait(dist.all_reduce(buf, op=op, group=group, async_op=True), what)
    return HostCopy(buf).read()


class LossReadback:
    """The last rank's loss message, ``[loss, 1 + first non-finite micro-batch (0: none), dtype]``.

    Args:
        weights: each micro-batch's factor in the mini-batch loss (one per micro-batch).
    """

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = list(weights)
        self._copy: HostCopy | None = None

    def poll(self, results: Mapping[int, Any]) -> None:
        """Start the copy once every micro-batch's loss is in ``results`` (call after each action)."""
        if self._copy is None and len(results) >= len(self.weights):
            self._copy = HostCopy(self._message(results))

    def read(self, results: Mapping[int, Any]) -> Tensor:
        """The message, a float64 CPU tensor of 3 (the host waits for its copy here)."""
        self.poll(results)
        assert self._copy is not None, "a step's loss is read after its last micro-batch's forward"
        return self._copy.read()

    def _message(self, results: Mapping[int, Any]) -> Tensor:
        losses: list[Tensor] = [results[m] for m in range(len(self.weights))]
        total = torch.stack([w * value for w, value in zip(self.weights, losses)]).sum()
        # One finiteness test for the whole step; the first bad micro-batch found on the device.
        bad = ~torch.isfinite(torch.stack(losses).detach()).reshape(len(losses), -1).all(dim=1)
        first = torch.where(bad.any(), bad.to(torch.int64).argmax() + 1, 0)
        code = LOSS_DTYPES.index(total.dtype) if total.dtype in LOSS_DTYPES else -1
        message = torch.empty(3, dtype=torch.float64, device=total.device)
        message[0], message[1], message[2] = total.detach(), first, code
        return message
