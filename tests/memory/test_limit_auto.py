"""``memory_limit`` in device bytes for what ``Pipe`` plans itself: ``schedule="auto"`` and ``balance="auto"``.

What is chosen must be what the step's own check (``Pipe(memory_limit=)``) lets through: every
device's prediction plus the margin within the limit.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from _memory_utils import ProductLoss
from torch import nn

from fastpipe import AutoSchedule, Pipe
from fastpipe.balance import BalanceError
from fastpipe.memory.limit import MARGIN

H, ROWS = 32, 8


def eight() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H)) for _ in range(8)])


def data(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(m * ROWS, H, generator=g), torch.randn(m * ROWS, H, generator=g)


def ticking() -> AutoSchedule:
    """A search whose profiler's clock moves one unit per reading: every layer costs the same."""
    clock = itertools.count()
    return AutoSchedule(weight_share=0.4, timer=lambda: float(next(clock)))


def step_peaks(pipe: Pipe) -> list[int]:
    guard = pipe._recompute.guard
    assert guard is not None
    return [d.total for d in guard.last]


def test_the_pipes_limit_judges_schedule_auto_in_device_bytes() -> None:
    x, y = data(8)
    free = Pipe(eight(), [4, 4], chunks=8, checkpoint="never", schedule=ticking(), memory_limit="1GiB")
    free.train_step(x, y, ProductLoss())
    fastest = free.auto_schedule.choice
    assert fastest is not None and fastest.memory_limit == 2**30
    limit = int(max(fastest.chosen.peak_memory))  # the fastest schedule's peak, without the margin
    pipe = Pipe(eight(), [4, 4], chunks=8, checkpoint="never", schedule=ticking(), memory_limit=limit)
    pipe.train_step(x, y, ProductLoss())  # the step's check lets the choice through
    choice = pipe.auto_schedule.choice
    assert choice is not None and choice.memory_limit == limit
    assert choice.chosen.schedule != fastest.chosen.schedule
    assert max(step_peaks(pipe)) * (1 + MARGIN) <= limit
    assert max(choice.chosen.peak_memory) == max(step_peaks(pipe))  # the search's figures are the check's


def test_auto_schedule_takes_sizes_and_names_the_device_when_nothing_fits() -> None:
    assert AutoSchedule(memory_limit="1.5 KiB").memory_limit == 1536
    x, y = data(8)
    pipe = Pipe(eight(), [4, 4], chunks=8, schedule=AutoSchedule(memory_limit="64KiB"))
    with pytest.raises(ValueError, match=r"no schedule fits memory_limit=64.00 KiB on every device; the leanest, .*"):
        pipe.train_step(x, y, ProductLoss())
    with pytest.raises(ValueError, match=r"device \d \(stages .*\) needs .* parameters .* optimizer"):
        pipe.train_step(x, y, ProductLoss())
    assert all(p.grad is None for p in pipe.parameters()), "no action ran"


def lopsided() -> nn.Sequential:
    """Two wide layers first (most of the bytes), two narrow ones after: the even cut puts both wide ones together."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(H, 8 * H), nn.Linear(8 * H, H), nn.Linear(H, H), nn.Tanh())


def test_balance_auto_plans_a_cut_whose_devices_fit_and_refuses_one_that_cannot() -> None:
    x, y = data(4)
    wide = [lopsided()[i].weight.numel() * 4 for i in (0, 1)]  # the wide layers' parameters, bytes
    # Each wide layer's parameters, gradients and Adam's moments, 4x, fit a device alone, not together.
    limit = int(4 * max(wide) * 1.6)
    pipe = Pipe(lopsided(), "auto", devices=["cpu"] * 2, chunks=4, sample=x, memory_limit=limit)
    assert pipe.balance == [1, 3]
    pipe.train_step(x, y, ProductLoss())  # the step's check agrees
    assert max(step_peaks(pipe)) * (1 + MARGIN) <= limit
    even = Pipe(lopsided(), [2, 2], chunks=4, memory_limit=limit)
    with pytest.raises(ValueError, match=r"device 0 \(stages 0\) needs"):
        even.train_step(x, y, ProductLoss())
    with pytest.raises(BalanceError, match=r"stage 0 needs at least .* \(layer 0 alone\).*: parameters .*optimizer"):
        Pipe(lopsided(), "auto", devices=["cpu"] * 2, chunks=4, sample=x, memory_limit=3 * wide[0])


def test_balance_auto_checks_whole_devices_of_several_stages() -> None:
    from fastpipe.balance import plan
    from fastpipe.balance.auto import plan_within
    from fastpipe.balance.device_need import StageNeed, layer_bytes
    from fastpipe.schedule import build

    x, _ = data(4)
    model = eight()[:6]
    ones = [1.0] * len(model)
    need = StageNeed(layer_bytes(model, x[:ROWS], {}), build("interleaved", 2, 4, virtual_stages=2), wgrad_batch=2)
    cuts = [list(c) for c in itertools.product(range(1, 4), repeat=4) if sum(c) == len(model)]
    least = min(max(d.total for d in need.devices(c)) for c in cuts) * (1 + MARGIN)
    under = int(least) - 1
    # Each stage alone fits under it, two on one device do not: a plan by stages alone is refused whole.
    alone = plan(
        ones, ones, 2, microbatches=4, schedule="interleaved", virtual_stages=2, memory_limit=under, stage_memory=need
    )
    assert any(d.total * (1 + MARGIN) > under for d in need.devices(alone)), alone
    with pytest.raises(BalanceError, match="no balance keeps every device of 2 workers with 2 stages each"):
        plan_within(ones, ones, need, under, schedule="interleaved")
    balance = plan_within(ones, ones, need, int(least) + 1, schedule="interleaved")
    assert all(d.total * (1 + MARGIN) <= least + 1 for d in need.devices(balance)), balance
