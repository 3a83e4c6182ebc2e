"""Moving a step's values between the host and a GPU without draining the GPU more than once.

A host read of a CUDA value (``.item()``, ``float()``, ``bool()``, ``.tolist()``, a blocking
``.cpu()``) waits until the GPU has run everything queued before it, and a blocking host-to-GPU
copy from pageable memory waits for its stream too. Done once per micro-batch, either one
empties the GPU's queue once per micro-batch. So a step computes its per-micro-batch scalars
on the device and reads them together (:func:`read_floats`); copies into the GPU go through
a fresh pinned buffer without blocking (:func:`staged_to`, :func:`value_to`); copies out of it
land in pinned memory and are waited for only where the host reads them (:class:`HostCopy`).

On the CPU, and on accelerators without pinned memory, these are plain ``Tensor.to`` calls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from fastpipe.step.microbatch import rebuilt

__all__ = ["HostCopy", "read_floats", "staged_to", "value_to"]


def read_floats(values: Sequence[float | Tensor], what: str) -> list[float]:
    """Each value as a Python float, with one host read per (device, dtype) among the tensors.

    The floats are those ``float(value)`` gives, bit for bit: each group is stacked in its own
    dtype (no promotion, so an int64 count is not rounded through float32) and read with one
    ``tolist()``.

    Args:
        values: numbers, or tensors of one element each.
        what: what the values are, for the error message (``"loss_fn.normaliser(target)"``).

    Raises:
        ValueError: a tensor holds more or fewer than one element.
    """
    out: list[float] = [0.0] * len(values)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        if not isinstance(v, Tensor):
            out[i] = float(v)
            continue
        if v.numel() != 1:
            raise ValueError(
                f"fastpipe: {what} must be a number or a one-element tensor, got a tensor of shape {tuple(v.shape)}"
            )
        groups.setdefault((v.device, v.dtype), []).append(i)
    for index in groups.values():
        stacked = torch.stack([values[i].detach().reshape(()) for i in index])  # type: ignore[union-attr]
        for i, number in zip(index, stacked.tolist()):
            out[i] = float(number)
    return out


def staged_to(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``; a host tensor bound for a GPU is copied without blocking the host.

    The host tensor is first copied into a fresh pinned buffer: the GPU copy then runs
    asynchronously, and the caller may change its own tensor at once (torch's caching host
    allocator keeps the buffer until the copy has run). Autograd sees both copies, as with
    ``tensor.to(device)``.
    """
    device = torch.device(device)
    if tensor.device.type != "cpu" or device.type != "cuda" or tensor.layout != torch.strided:
        return tensor.to(device)
    staged = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    staged.copy_(tensor)
    return staged.to(device, non_blocking=True)


def value_to(value: Any, device: torch.device) -> Any:
    """A pipeline value (a tensor, a tuple holding tensors, or anything else) with its tensors
    on ``device``, each moved by :func:`staged_to`."""
    if isinstance(value, Tensor):
        return staged_to(value, device)
    if isinstance(value, tuple):
        return rebuilt(value, [staged_to(v, device) if isinstance(v, Tensor) else v for v in value])
    return value


class HostCopy:
    """A tensor's copy into host memory, started now and waited for when :meth:`read`.

    A CUDA tensor is copied into pinned memory on its device's current stream, followed by an
    event: :meth:`read` waits for that event only, not for GPU work queued after it. Any other
    tensor is copied (or, on the CPU, taken) at once.
    """

    def __init__(self, tensor: Tensor) -> None:
        tensor = tensor.detach()
        self._event: Any = None
        if tensor.device.type != "cuda":
            self._host = tensor.cpu()
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensor.device))

    def read(self) -> Tensor:
        """The host copy, once it has landed (the host waits here, and only here)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host
