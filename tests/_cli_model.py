"""A tiny model for the `fastpipe plan --model` test (imported by module path)."""

from torch import nn


def build() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 16))


def not_sequential() -> nn.Module:
    return nn.Linear(2, 2)
