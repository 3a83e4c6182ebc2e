"""A fake clock for the profiler, and layers that cost a set time on it: timing tests that never time.

The profiler reads the clock around each layer's forward and backward; :class:`Work` advances the clock
by its cost in both, times ``1 + noise`` drawn from a seeded generator, so a profile is noisy the way a
loaded machine is (noise only adds time) yet the same on every run with the same seed.
"""

from __future__ import annotations

import random

import torch
from torch import nn


class FakeClock:
    """Seconds that pass only when a :class:`Work` layer spends them.

    Args:
        noise: each cost is stretched by a factor drawn from ``[1, 1 + noise]``.
        seed: the seed of the draws.
        cold: the factor of the first forward and the first backward on the clock (a process's first
            kernels: library loading, allocator growth, what a warm-up absorbs).
    """

    def __init__(self, noise: float = 0.0, seed: int = 0, cold: float = 1.0) -> None:
        self.now = 0.0
        self.noise = noise
        self.cold = cold
        self.rng = random.Random(seed)
        self.ran: set[str] = set()

    def __call__(self) -> float:
        return self.now

    def spend(self, what: str, seconds: float) -> None:
        """Advance by ``seconds``, stretched by the noise (and by ``cold`` on the first ``what``)."""
        factor = 1.0 if what in self.ran else self.cold
        self.ran.add(what)
        self.now += seconds * factor * (1 + self.rng.uniform(0, self.noise))


class _Spend(torch.autograd.Function):
    """Identity whose backward spends the layer's backward cost on the clock."""

    @staticmethod
    def forward(ctx, x, layer):  # type: ignore[no-untyped-def]
        ctx.layer = layer
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        ctx.layer.clock.spend("backward", ctx.layer.backward_cost)
        return grad, None


class Work(nn.Module):
    """A layer of ``features`` scaled by a weight, costing ``forward`` and ``backward`` seconds on ``clock``."""

    def __init__(self, clock: FakeClock, forward: float, backward: float, features: int = 4) -> None:
        super().__init__()
        self.clock = clock
        self.forward_cost = forward
        self.backward_cost = backward
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.clock.spend("forward", self.forward_cost)
        return _Spend.apply(x * self.weight, self)


def uniform_model(clock: FakeClock) -> nn.Sequential:
    """8 identical (Linear-like, ReLU-like) pairs: 16 layers, as on the machine."""
    return nn.Sequential(*[w for _ in range(8) for w in (Work(clock, 1.0, 2.0), Work(clock, 0.05, 0.1))])
