"""The device bytes a pipe may fill when no ``memory_limit`` is given: each device's own capacity.

``checkpoint="auto"`` (the default) recomputes the least that fits a limit. Without
``memory_limit=`` the limit is what the stages' devices can hold: on CUDA, the bytes free
on the device plus those this process's caching allocator already reserves there (the
model's parameters among them, which the prediction counts), read when the pipe is built.
Other processes' bytes are not this pipe's to use. Over several devices the least of them
is taken, since one limit holds for every device.

Host memory has no such figure: a pipe on the CPU, or on an accelerator that reports no
capacity, runs ``"auto"`` as nothing recomputed unless ``memory_limit=`` says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["device_capacity", "capacity_limit"]


def device_capacity(device: Any) -> int | None:
    """The bytes this process can hold on ``device``: free plus its own reserved; None for host memory.

    Args:
        device: a ``torch.device`` or its name.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free) + int(torch.cuda.memory_reserved(device))


def capacity_limit(devices: Iterable[Any]) -> int | None:
    """The least capacity among ``devices`` (:func:`device_capacity`); None if one reports none."""
    found = [device_capacity(d) for d in devices]
    if not found or any(c is None for c in found):
        return None
    return min(c for c in found if c is not None)
