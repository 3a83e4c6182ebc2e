"""Measuring a stage's bytes leaves nothing alive: ``memory_limit``'s first step must not hold more than it predicts."""

from __future__ import annotations

import gc

import torch
from _memory_utils import install_counter_or_skip
from torch import nn


class _TokenMix(nn.Module):
    """An integer input's path: embedding, then a layer whose output its own backward saves."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.proj = nn.Linear(32, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(ids)))


def test_measuring_a_stage_fed_integers_frees_every_saved_tensor() -> None:
    install_counter_or_skip()
    from fastpipe.memory import _cpu_counter
    from fastpipe.memory.stage_bytes import measure_stages

    torch.manual_seed(0)
    stage = nn.Sequential(_TokenMix(), nn.GELU(), nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    ids = torch.randint(0, 64, (2, 16))
    measure_stages(stage, [len(stage)], ids)  # the counter's first use builds what it keeps
    gc.collect()
    before = _cpu_counter.allocated()
    for _ in range(3):
        (found,) = measure_stages(stage, [len(stage)], ids)
    gc.collect()
    assert found.activation > 0
    assert _cpu_counter.allocated() - before == 0
