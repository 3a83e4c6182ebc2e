"""Helpers shared by the kernel tests (a uniquely named module, so no clash with other conftests)."""

from __future__ import annotations

import os

import torch
from torch import nn

from fastpipe.kernels.memory import count_saved_bytes

__all__ = ["INTERPRET", "count_saved_bytes", "EagerMLPBlock"]

#: True in the ``TRITON_INTERPRET=1`` run: tests then pick sizes that launch few programs.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
