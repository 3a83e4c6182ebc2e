"""Profiling (``profile_layers``, ``balance="auto"``) leaves the model's buffers as they were: the
same tensors, the same values and, where a layer only reads a buffer, the same version counter,
which a pipeline reads as a write into a buffer shared across stages."""

from __future__ import annotations

import torch
from torch import nn

import fastpipe
from fastpipe.balance import auto_balance, profile_layers


class Table(nn.Module):
    """A constant table the layer only reads, like a rotary embedding's."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.linspace(0.5, 1.5, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.table


class Counting(nn.Module):
    """Rebinds its buffer on every call instead of writing into it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return x * 2


class Join(nn.Module):
    def forward(self, x: torch.Tensor, **skips: torch.Tensor) -> torch.Tensor:
        return x + skips["early"]


def test_a_buffer_only_read_keeps_its_tensor_and_version() -> None:
    table = Table()
    model = nn.Sequential(table, nn.Linear(4, 4), table, nn.BatchNorm1d(4))
    tensor, version = table.table, table.table._version
    profile_layers(model, torch.randn(8, 4), repeats=1)
    assert table.table is tensor
    assert table.table._version == version


def test_a_rebound_buffer_gets_its_own_tensor_back() -> None:
    counting = Counting()
    before = counting.calls
    profile_layers(nn.Sequential(nn.Linear(4, 4), counting), torch.randn(8, 4), repeats=2)
    assert counting.calls is before and float(before) == 0.0


def test_measuring_skips_under_a_memory_limit_moves_no_statistics_or_generator() -> None:
    torch.manual_seed(3)
    model = fastpipe.Sequential(
        nn.Linear(4, 4),
        nn.Dropout(0.5),
        fastpipe.stash("early"),
        nn.Linear(4, 4),
        nn.BatchNorm1d(4),
        fastpipe.pops(Join(), "early"),
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 4) * 3 + 1
    rng = torch.get_rng_state()
    auto_balance(model, ["cpu"] * 2, sample, chunks=2, memory_limit=2**30, repeats=1)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
