"""torchgpipe's two balancers: by measured time and by measured memory.

:func:`by_time` and :func:`by_size` play the part of ``torchgpipe.balance.balance_by_time`` and
``balance_by_size``: profile the layers of an ``nn.Sequential`` on one sample, then split them into
``partitions`` stages. ``by_time`` splits by :func:`~fastpipe.balance.planner.plan` (the simulated step
time of a schedule), ``by_size`` by the least largest stage memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from fastpipe.balance.bottleneck import min_bottleneck
from fastpipe.balance.planner import BalanceError, plan
from fastpipe.balance.profile import MEASURED_TOLERANCE, Timer, profile_layers
from fastpipe.step.microbatch import Value

__all__ = ["by_size", "by_time"]


def by_time(
    module: nn.Sequential,
    sample: Value,
    partitions: int,
    *,
    device: torch.device | str | None = None,
    repeats: int = 5,
    microbatches: int = 8,
    schedule: str = "gpipe",
    side_inputs: Mapping[str, Any] | None = None,
    tolerance: float = MEASURED_TOLERANCE,
    timer: Timer | None = None,
) -> list[int]:
    """Profiles forward/backward time per layer and returns :func:`plan`'s balance for ``schedule``.

    ``sample`` (a tensor, or a tuple whose tensors share dim 0) is profiled as it is, one micro-batch,
    with ``side_inputs`` for the layers that declare them (see :func:`profile_layers`). Plans simulated
    within ``tolerance`` of the fastest tie, and the most even of them wins (see :func:`plan`).
    """
    profile = profile_layers(module, sample, device=device, repeats=repeats, side_inputs=side_inputs, timer=timer)
    return plan(
        profile.forward,
        profile.backward,
        partitions,
        microbatches=microbatches,
        schedule=schedule,
        tolerance=tolerance,
    )


def by_size(
    module: nn.Sequential,
    sample: Value,
    partitions: int,
    *,
    device: torch.device | str | None = None,
    param_scale: float = 2.0,
    side_inputs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Balances memory: activation bytes plus ``param_scale`` x parameter bytes per layer.

    ``param_scale`` counts the parameter with its gradient and optimizer state: about 2 for SGD, 4 for
    Adam (parameter, gradient, two moments). Minimises the largest stage (exact DP). ``sample`` and
    ``side_inputs`` are as for :func:`by_time`.
    """
    if len(module) < partitions:
        raise BalanceError(
            f"{len(module)} layers cannot fill {partitions} partitions (each holds at least one layer); use at "
            f"most {len(module)} partitions"
        )
    profile = profile_layers(module, sample, device=device, repeats=1, warmup=0, side_inputs=side_inputs)
    sizes = [a + param_scale * p for a, p in zip(profile.activation_bytes, profile.parameter_bytes)]
    balance = min_bottleneck(sizes, partitions)
    assert balance is not None
    return balance
