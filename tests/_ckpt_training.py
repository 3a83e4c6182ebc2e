"""The model, batches and loop the checkpoint tests train (one process and spawned ranks alike)."""

from __future__ import annotations

import torch
from torch import nn

from fastpipe import Pipe

__all__ = ["HIDDEN", "batch", "make_model", "train"]

HIDDEN = 16


def make_model(seed: int = 0, dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Dropout(dropout)) for _ in range(8)])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)


def train(pipe: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """``steps`` optimizer steps of MSE on :func:`batch`; a Pipe or a DistributedPipe (call on every rank)."""
    losses = []
    for step in steps:
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        if isinstance(pipe, Pipe):
            loss = pipe.train_step(x, y, nn.MSELoss())
        else:
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        opt.step()
        losses.append(loss.item())
    return losses
