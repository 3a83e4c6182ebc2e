"""balance="auto" plans tied layers across stages: Pipe gives a reader stage its own copy of the tied weight."""

from __future__ import annotations

import pytest
import torch
from _fake_clock import FakeClock, Work
from torch import nn

from fastpipe.balance import MEASURED_TOLERANCE, BalanceError, auto_balance, by_time, plan


class Embed(nn.Module):
    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.wte = wte

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids)


class LMHead(nn.Module):
    """The output projection through the embedding's weight (a tied weight, as GPT-2's ``lm_head``)."""

    def __init__(self, wte: nn.Embedding) -> None:
        super().__init__()
        self.wte = wte

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.wte.weight.t()


def gpt2_like(blocks: int = 4) -> nn.Sequential:
    torch.manual_seed(0)
    wte = nn.Embedding(64, 16)
    body = [nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(blocks)]
    return nn.Sequential(Embed(wte), *body, nn.LayerNorm(16), LMHead(wte))


def test_a_tie_between_the_first_and_last_layers_is_planned_across_stages() -> None:
    # Layers 0 and 6 share the embedding: once refused as "1 blocks once tied layers stay together".
    model = gpt2_like()
    balance = auto_balance(model, ["cpu"] * 4, torch.randint(0, 64, (8, 5)), chunks=4, repeats=1)
    assert len(balance) == 4 and sum(balance) == 7 and min(balance) >= 1


def test_tied_layers_are_planned_like_untied_ones() -> None:
    # With a fake clock, a tied use of a layer costs what an untied copy does, so the plan is the same.
    def plan_for(tied: bool) -> list[int]:
        clock = FakeClock()
        heavy = Work(clock, 3.0, 6.0)
        last = heavy if tied else Work(clock, 3.0, 6.0)
        model = nn.Sequential(heavy, *[Work(clock, 1.0, 2.0) for _ in range(6)], last)
        return auto_balance(model, ["cpu"] * 4, torch.randn(8, 4), chunks=4, timer=clock)

    f = [3.0] + [1.0] * 6 + [3.0]
    expected = plan(f, [2 * c for c in f], 4, microbatches=4, schedule="1f1b", tolerance=MEASURED_TOLERANCE)
    assert plan_for(tied=False) == plan_for(tied=True) == expected
    assert len(expected) == 4


def test_a_layer_used_twice_fills_more_stages_than_its_span() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared, nn.Tanh())
    assert auto_balance(model, ["cpu"] * 3, torch.randn(8, 4), chunks=2, repeats=1) in ([2, 1, 1], [1, 2, 1], [1, 1, 2])
    assert sum(by_time(model, torch.randn(4, 4), 4, repeats=1, microbatches=2)) == 4


def test_too_many_devices_says_what_to_do() -> None:
    shared = nn.Linear(4, 4)
    with pytest.raises(BalanceError, match=r"3 layers cannot fill 4 stages.*use at most 3 devices"):
        auto_balance(nn.Sequential(shared, nn.ReLU(), shared), ["cpu"] * 4, torch.randn(8, 4), chunks=2)
