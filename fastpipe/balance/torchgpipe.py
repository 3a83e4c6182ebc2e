"""torchgpipe's two balancers: by measured time and by measured memory.

:func:`by_time` and :func:`by_size` play the part of ``torchgpipe.balance.balance_by_time`` and
``balance_by_size``: profile the layers of an ``nn.Sequential`` on one sample, then split them into
``partitions`` stages. ``by_time`` splits by :func:`~fastpipe.balance.planner.plan` (the simulated step
time of a schedule), ``by_size`` by the least largest stage memory.
"""

from __future__ import annotations

import torch
from torch import nn

from fastpipe.balance.bottleneck import min_bottleneck
from fastpipe.balance.planner import BalanceError, plan
from fastpipe.balance.profile import profile_layers

__all__ = ["by_size", "by_time"]


def by_time(
    module: nn.Sequential,
    sample: torch.Tensor,
    partitions: int,
    *,
    device: torch.device | str | None = None,
    repeats: int = 3,
    microbatches: int = 8,
    schedule: str = "gpipe",
) -> list[int]:
    """Profiles forward/backward time per layer and returns :func:`plan`'s balance for ``schedule``."""
    profile = profile_layers(module, sample, device=device, repeats=repeats)
    return plan(profile.forward, profile.backward, partitions, microbatches=microbatches, schedule=schedule)


def by_size(
    module: nn.Sequential,
    sample: torch.Tensor,
    partitions: int,
    *,
    device: torch.device | str | None = None,
    param_scale: float = 2.0,
) -> list[int]:
    """Balances memory: activation bytes plus ``param_scale`` x parameter bytes per layer.

    ``param_scale`` counts the parameter with its gradient and optimizer state: about 2 for SGD, 4 for
    Adam (parameter, gradient, two moments). Minimises the largest stage (exact DP).
    """
    profile = profile_layers(module, sample, device=device, repeats=1)
    sizes = [a + param_scale * p for a, p in zip(profile.activation_bytes, profile.parameter_bytes)]
    if len(sizes) < partitions:
        raise BalanceError(f"{len(sizes)} layers cannot fill {partitions} partitions")
    balance = min_bottleneck(sizes, partitions)
    assert balance is not None
    return balance
