"""The reference workload of the foundation benchmarks: 8 residual MLP blocks.

Each block is LayerNorm → Linear(512→2048) → GELU → Linear(2048→512), plus the skip.
Batch 256, 8 micro-batches.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["ResidualMLP", "make_model", "make_batch", "HIDDEN", "FFN", "BLOCKS", "BATCH", "CHUNKS"]

HIDDEN, FFN, BLOCKS, BATCH, CHUNKS = 512, 2048, 8, 256, 8


class ResidualMLP(nn.Module):
    """Pre-norm MLP block with a residual connection."""

    def __init__(self, hidden: int = HIDDEN, ffn: int = FFN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


def make_model(blocks: int = BLOCKS, seed: int = 0, hidden: int = HIDDEN, ffn: int = FFN) -> nn.Sequential:
    """The workload model (``hidden``/``ffn`` scale the family), deterministically initialised."""
    torch.manual_seed(seed)
    return nn.Sequential(*[ResidualMLP(hidden, ffn) for _ in range(blocks)])


def make_batch(batch: int = BATCH, seed: int = 1, hidden: int = HIDDEN) -> tuple[Tensor, Tensor]:
    """An input batch and a regression target."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)
