"""The U-Net the skip tests pipeline: 11 layers, two skips (shared by the local and the distributed tests)."""

from __future__ import annotations

import torch
from torch import nn

import fastpipe

__all__ = ["K", "Up", "unet"]

# Reductions on the longest path from input to loss (three Linears and two Ups of at most
# 14 inputs), plus the 8 rows a weight gradient sums over.
K = 6 + 8 + 6 + 10 + 14 + 8 + 8


class Up(nn.Module):
    """A decoder block: joins the upsampled path with the encoder's features it pops."""

    def __init__(self, name: str, width: int, skip: int, out: int) -> None:
        super().__init__()
        self.name = name
        self.linear = nn.Linear(width + skip, out)

    def forward(self, x: torch.Tensor, **skips: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(torch.cat([x, skips[self.name]], dim=1)))


def unet(seed: int = 0, dropout: float = 0.0) -> fastpipe.Sequential:
    """11 layers; with balance [3, 5, 3] 'd1' crosses from stage 0 to 2, 'd2' from 1 to 2."""
    torch.manual_seed(seed)
    return fastpipe.Sequential(
        nn.Linear(6, 8),
        nn.Dropout(dropout),
        fastpipe.stash("d1"),
        nn.Linear(8, 6),
        nn.Tanh(),
        fastpipe.stash("d2"),
        nn.Linear(6, 4),
        nn.Tanh(),
        fastpipe.pops(Up("d2", 4, 6, 6), "d2"),
        fastpipe.pops(Up("d1", 6, 8, 8), "d1"),
        nn.Linear(8, 3),
    )
