"""An eight-layer model without randomness in its forward, for the schedule tests that compare with the plain model."""

from __future__ import annotations

import torch
from torch import nn

# Reductions from input to loss plus the rows a weight gradient sums over (see tests/fp_tolerance.py).
K = 8 + 16 + 16 + 16 + 8 + 8 * 16 + 16


def model() -> nn.Sequential:
    """Seeded: every call builds the same weights."""
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(),
        nn.LayerNorm(16),
        nn.Linear(16, 16),
        nn.Tanh(),
        nn.Linear(16, 8),
        nn.Linear(8, 8),
        nn.ReLU(),
    )
