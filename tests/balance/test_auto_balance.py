"""Pipe(balance="auto") profiles the layers and lets the planner split them."""

import pytest
import torch
from torch import nn

from fastpipe import Pipe


def lopsided():
    # One layer far heavier than the rest: a balanced split isolates it.
    return nn.Sequential(
        nn.Linear(32, 32),
        nn.Linear(32, 32),
        nn.Linear(32, 1024),
        nn.Linear(1024, 1024),
        nn.Linear(1024, 32),
        nn.Linear(32, 32),
    )


def test_auto_balance_sums_and_trains():
    torch.manual_seed(0)
    pipe = Pipe(lopsided(), balance="auto", devices=["cpu"] * 3, chunks=4, sample=torch.randn(64, 32))
    assert sum(pipe.balance) == 6 and len(pipe.balance) == 3 and min(pipe.balance) >= 1
    loss = pipe.train_step(torch.randn(64, 32), torch.randn(64, 32), nn.MSELoss())
    assert torch.isfinite(loss)


def test_auto_balance_interleaved_has_a_stage_per_virtual_stage():
    pipe = Pipe(
        lopsided(),
        balance="auto",
        devices=["cpu"] * 4,
        chunks=4,
        sample=torch.randn(16, 32),
        schedule="interleaved",
        virtual_stages=2,
    )
    assert len(pipe.balance) == 4
    pipe.train_step(torch.randn(16, 32), torch.randn(16, 32), nn.MSELoss())


def test_auto_balance_errors():
    with pytest.raises(ValueError, match="needs sample="):
        Pipe(lopsided(), balance="auto", devices=["cpu"] * 2)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"devices=\['cpu'\] \* K"):
            Pipe(lopsided(), balance="auto", sample=torch.randn(8, 32))
    with pytest.raises(ValueError, match="cannot fill"):
        Pipe(lopsided(), balance="auto", devices=["cpu"] * 7, sample=torch.randn(8, 32))
    with pytest.raises(TypeError, match="list of layer counts or 'auto'"):
        Pipe(lopsided(), balance="even", devices=["cpu"] * 2)
