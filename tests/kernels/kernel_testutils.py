"""Helpers shared by the kernel tests (a uniquely named module, so no clash with other conftests)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
from torch import nn

__all__ = ["INTERPRET", "count_saved_bytes", "EagerMLPBlock"]

#: True in the ``TRITON_INTERPRET=1`` run: tests then pick sizes that launch few programs.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def count_saved_bytes(fn: Callable[[], torch.Tensor], params: Iterable[torch.Tensor]) -> tuple[int, torch.Tensor]:
    """Bytes of tensors saved for backward while running ``fn()``, parameters excluded."""
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


class EagerMLPBlock(nn.Module):
    """The plain-torch block MLPBlock replaces: x + drop(fc2(gelu(fc1(norm(x)))))."""

    def __init__(self, hidden: int, ffn_hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn_hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn_hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(self.act(self.fc1(self.norm(x)))))
