"""``Pipe(..., schedule="auto")``: it measures once, runs the search's choice, and trains like the plain model."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from _eight_layers import K, model
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.balance import profile_layers
from fastpipe.memory.limit import MARGIN
from fastpipe.schedule import SCHEDULES
from fastpipe.step.auto_schedule import AutoSchedule


def reference(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    ref = model()
    loss = nn.MSELoss()(ref(x), y)
    loss.backward()
    return loss.detach(), [p.grad for p in ref.parameters() if p.grad is not None]


def ticking(memory_limit: float | None = None) -> AutoSchedule:
    """A search whose profiler's clock moves one unit per reading: every layer's F and backward cost 1.

    With a W share of 0.4, for 4 stages of 2 layers and 8 micro-batches, zb-h2 and the greedy
    schedule tie for the fastest at 38 units (zb-h1: 39.2). Under a limit of 8,000 device bytes
    zb-h2 (9,392 predicted on stage 1's device: 4,864 of parameters, gradients and Adam's state,
    the rest activations and W records) no longer fits, and the greedy schedule built for the
    bytes left does, at the same speed, in every checkpoint mode.
    """
    clock = itertools.count()
    return AutoSchedule(memory_limit, weight_share=0.4, timer=lambda: float(next(clock)))


def assert_matches_plain(pipe: Pipe, x: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> None:
    loss_ref, grads_ref = reference(x, y)
    assert_close_reordered(loss, loss_ref, k=K)
    for (name, p), g in zip(pipe.named_parameters(), grads_ref):
        assert_close_reordered(p.grad, g, k=K, msg=name)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("batch", [16, 15])  # 15 in 8 chunks: seven of 2 and one of 1
def test_the_greedy_choice_trains_like_the_plain_model(checkpoint: str, batch: int) -> None:
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    pipe = Pipe(model(), balance=[2, 2, 2, 2], chunks=8, checkpoint=checkpoint, schedule=ticking(8000))
    loss = pipe.train_step(x, y, nn.MSELoss())
    choice = pipe.auto_schedule.choice
    assert choice is not None and choice.chosen.name == "greedy"
    assert max(choice.chosen.peak_memory) * (1 + MARGIN) <= 8000
    assert choice.chosen.time < min(c.time for c in choice.candidates if c.name != "greedy" and c.fits)
    assert_matches_plain(pipe, x, y, loss)


def test_auto_measures_once_and_remembers_each_choice() -> None:
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    pipe = Pipe(model(), balance=[2, 2, 2, 2], chunks=8, schedule="auto")
    loss = pipe.train_step(x, y, nn.MSELoss())
    auto = pipe.auto_schedule
    costs, choice = auto.costs, auto.choice
    assert costs is not None and choice is not None
    assert costs.num_stages == 4 and all(a > 0 for a in costs.activation)  # bytes saved for backward
    assert choice.chosen.name in (*SCHEDULES, "greedy")
    assert_matches_plain(pipe, x, y, loss)
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.train_step(x, y, nn.MSELoss())
    assert auto.costs is costs and auto.choice is choice  # no second profile, no second search
    assert_matches_plain(pipe, x, y, loss)
    with pytest.warns(UserWarning, match="6 micro-batches"):
        pipe.train_step(torch.randn(6, 8), torch.randn(6, 8), nn.MSELoss())
    assert sorted(auto.choices) == [6, 8] and auto.choice is auto.choices[6] and auto.costs is costs


def test_train_step_takes_auto_on_a_pipe_built_for_a_named_schedule() -> None:
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    pipe = Pipe(model(), balance=[2, 2, 2, 2], chunks=8, schedule="1f1b")
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule="auto")
    assert pipe.auto_schedule.choice is not None
    assert_matches_plain(pipe, x, y, loss)
    searched = ticking(8000)
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=searched)  # a search of its own, for this call
    assert searched.choice is not None and searched.choice.chosen.name == "greedy"
    assert_matches_plain(pipe, x, y, loss)


def test_the_memory_limit_holds_and_one_nothing_fits_is_refused() -> None:
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    pipe = Pipe(model(), balance=[2, 2, 2, 2], chunks=8, schedule=ticking())
    pipe.train_step(x, y, nn.MSELoss())
    auto = pipe.auto_schedule
    assert auto.choice is not None and auto.costs is not None
    costs, free = auto.costs, auto.choice
    limit = int(max(free.chosen.peak_memory))  # the fastest schedule's peak, without the margin: a leaner one wins
    auto.memory_limit = limit  # drops the choices, keeps the costs
    assert auto.choices == {} and auto.costs is costs
    for p in pipe.parameters():
        p.grad = None
    loss = pipe.train_step(x, y, nn.MSELoss())
    assert auto.costs is costs and auto.choice is not free
    devices = auto.devices[auto.choice.chosen.label]
    assert max(d.total for d in devices) * (1 + MARGIN) <= limit
    assert_matches_plain(pipe, x, y, loss)
    with pytest.raises(ValueError, match="not a size"):
        auto.memory_limit = -1.0
    tiny = Pipe(model(), balance=[2, 2, 2, 2], chunks=8, schedule=AutoSchedule(memory_limit=1))
    with pytest.raises(
        ValueError, match=r"no schedule fits memory_limit=1 B on every device; the leanest, .*parameters"
    ):
        tiny.train_step(x, y, nn.MSELoss())


def test_auto_balance_with_auto_schedule() -> None:
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    pipe = Pipe(model(), balance="auto", devices=["cpu"] * 2, chunks=4, schedule="auto", sample=x)
    loss = pipe.train_step(x, y, nn.MSELoss())
    assert len(pipe.balance) == 2 and pipe.auto_schedule.choice is not None
    assert_matches_plain(pipe, x, y, loss)


def test_the_profile_leaves_deferred_batch_norm_statistics_alone() -> None:
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], chunks=4, deferred_batch_norm=True, schedule="auto")
    x, y = torch.randn(16, 6) * 3 + 1, torch.randn(16, 4)
    pipe.train_step(x, y, nn.MSELoss())  # profiles, then runs the step
    ref(x)
    assert pipe.auto_schedule.choice is not None
    for key, value in ref.state_dict().items():
        if "running" in key or "num_batches" in key:
            # Per-channel sums over 16 rows, per micro-batch then added, against one pass.
            assert_close_reordered(pipe.state_dict()[key], value, k=16 + 6, msg=key)


class Join(nn.Module):
    """Adds the skip it pops to its input."""

    def forward(self, x: torch.Tensor, **skips: torch.Tensor) -> torch.Tensor:
        return x + skips["early"]


def test_a_skip_counts_on_the_stages_that_hold_it_and_trains_like_the_plain_model() -> None:
    torch.manual_seed(2)
    layers = [nn.Linear(8, 8), fastpipe.stash("early"), nn.Linear(8, 8), nn.Tanh(), fastpipe.pops(Join(), "early")]
    ref = fastpipe.Sequential(*layers)
    pipe = Pipe(copy.deepcopy(ref), balance=[2, 2, 1], chunks=4, schedule="auto")
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    loss = pipe.train_step(x, y, nn.MSELoss())
    loss_ref = nn.MSELoss()(ref(x), y)
    loss_ref.backward()
    assert_close_reordered(loss, loss_ref.detach(), k=8 * 3 + 16)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=8 * 3 + 16)
    costs = pipe.auto_schedule.costs
    assert costs is not None
    skip = 4 * 8 * 4  # one micro-batch of 4 rows, 8 floats each
    saved = profile_layers(ref, x[:4]).activation_bytes  # per layer, skips not included
    assert costs.activation == (saved[0] + saved[1] + skip, saved[2] + saved[3], saved[4] + skip)


class Masked(nn.Module):
    """Takes a per-sample mask and a table shared by every sample as side inputs."""

    fastpipe_side_inputs = ("mask", "table")

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * mask + table


def test_side_inputs_reach_the_profile_and_the_step() -> None:
    torch.manual_seed(4)
    ref = fastpipe.Sequential(Masked(), nn.Linear(8, 8), Masked(), Masked())
    pipe = Pipe(copy.deepcopy(ref), balance=[2, 1, 1], chunks=4, schedule="auto")
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    side = {"mask": (torch.rand(8, 8) > 0.3).float(), "table": torch.randn(1, 8)}
    loss = pipe.train_step(x, y, nn.MSELoss(), **side)
    loss_ref = nn.MSELoss()(ref(x, **side), y)
    loss_ref.backward()
    assert pipe.auto_schedule.choice is not None
    assert_close_reordered(loss, loss_ref.detach(), k=8 * 4 + 8)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=8 * 4 + 8)


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: Pipe(model(), balance=[2] * 4, schedule="auto", virtual_stages=2), ValueError, "drop virtual_stages"),
        (lambda: Pipe(model(), balance=[2] * 4, schedule=3), TypeError, "schedule must be a schedule's name"),
        (lambda: Pipe(model(), balance=[2] * 4, schedule="2f2b"), ValueError, "unknown schedule"),
        (lambda: AutoSchedule(memory_limit=0), ValueError, "not a size.*GiB"),
        (lambda: AutoSchedule(memory_limit="1 parsec"), ValueError, "not a size.*GiB"),
        (lambda: AutoSchedule(weight_share=1.0), ValueError, "weight_share must be in"),
    ],
)
def test_bad_arguments_are_refused(make: object, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        make()  # type: ignore[operator]
