"""Counting the activation bytes an op keeps for its backward (what these kernels cut)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

import torch

__all__ = ["count_saved_bytes"]

T = TypeVar("T")


def count_saved_bytes(fn: Callable[[], T], params: Iterable[torch.Tensor] = ()) -> tuple[int, T]:
    """Run ``fn()`` and return (bytes of tensors saved for backward, its result).

    Tensors that share storage with one of ``params`` are not counted: parameters live on
    the stage anyway, only activations grow with the number of micro-batches in flight.
    """
    param_ptrs = {p.data_ptr() for p in params}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in param_ptrs:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out
