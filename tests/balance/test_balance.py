"""The planner is optimal (equals brute force), respects memory, and the profilers run."""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable

import pytest
import torch
from torch import nn

from fastpipe.balance import BalanceError, by_size, by_time, plan, predict, profile_layers


def _brute_force(fwd, bwd, k, m, schedule, memory=None, limit=None, v=1):  # type: ignore[no-untyped-def]
    n = len(fwd)
    best = None
    for cuts in itertools.combinations(range(1, n), k * v - 1):
        bounds = (0, *cuts, n)
        balance = [b - a for a, b in zip(bounds, bounds[1:])]
        if limit is not None and any(sum(memory[a:b]) > limit for a, b in zip(bounds, bounds[1:])):
            continue
        t = predict(balance, fwd, bwd, microbatches=m, schedule=schedule, virtual_stages=v).makespan
        best = t if best is None else min(best, t)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_plan_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 8)
    k = rng.randint(1, min(4, n))
    m = rng.choice([1, 2, 4, 8])
    schedule = ["gpipe", "1f1b", "zb-h1"][seed % 3]
    fwd = [rng.uniform(0.1, 3.0) for _ in range(n)]
    bwd = [rng.uniform(0.1, 5.0) for _ in range(n)]
    balance = plan(fwd, bwd, k, microbatches=m, schedule=schedule)
    assert sum(balance) == n and len(balance) == k and min(balance) >= 1
    got = predict(balance, fwd, bwd, microbatches=m, schedule=schedule).makespan
    assert got == pytest.approx(_brute_force(fwd, bwd, k, m, schedule), rel=1e-9)


def test_plan_interleaved_and_comm_equal_brute_force() -> None:
    rng = random.Random(7)
    fwd = [rng.uniform(0.5, 2.0) for _ in range(7)]
    bwd = [2 * f for f in fwd]
    balance = plan(fwd, bwd, 2, microbatches=4, schedule="interleaved", virtual_stages=2)
    assert len(balance) == 4
    got = predict(balance, fwd, bwd, microbatches=4, schedule="interleaved", virtual_stages=2).makespan
    assert got == pytest.approx(_brute_force(fwd, bwd, 2, 4, "interleaved", v=2))
    with_comm = plan(fwd, bwd, 3, microbatches=4, schedule="1f1b", comm=0.7)
    assert predict(with_comm, fwd, bwd, microbatches=4, schedule="1f1b", comm=0.7).makespan == pytest.approx(
        min(
            predict(
                [b - a for a, b in zip((0, *c), (*c, 7))], fwd, bwd, microbatches=4, schedule="1f1b", comm=0.7
            ).makespan
            for c in itertools.combinations(range(1, 7), 2)
        )
    )


def test_plan_respects_memory_limit() -> None:
    fwd = [1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    bwd = [2 * f for f in fwd]
    memory = [4.0, 4.0, 4.0, 1.0, 1.0, 1.0]
    free = plan(fwd, bwd, 2, microbatches=4, schedule="1f1b")
    limited = plan(fwd, bwd, 2, microbatches=4, schedule="1f1b", memory=memory, memory_limit=8.0)
    assert free == [5, 1]
    assert limited != free
    start = 0
    for size in limited:
        assert sum(memory[start : start + size]) <= 8.0
        start += size
    expected = _brute_force(fwd, bwd, 2, 4, "1f1b", memory, 8.0)
    assert predict(limited, fwd, bwd, microbatches=4, schedule="1f1b").makespan == pytest.approx(expected)
    with pytest.raises(BalanceError, match="no partition into 2 stages fits memory_limit=3.0"):
        plan(fwd, bwd, 2, microbatches=4, memory=memory, memory_limit=3.0)


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(BalanceError, match="cannot fill 4 stages"):
        plan([1.0, 1.0], [1.0, 1.0], 4, microbatches=4)
    with pytest.raises(BalanceError, match="costs_bwd has 1"):
        plan([1.0, 1.0], [1.0], 1, microbatches=4)
    with pytest.raises(BalanceError, match="unknown schedule"):
        plan([1.0, 1.0], [1.0, 1.0], 2, microbatches=4, schedule="nope")
    with pytest.raises(BalanceError, match="microbatches % stages == 0"):
        plan([1.0] * 8, [1.0] * 8, 2, microbatches=3, schedule="interleaved", virtual_stages=2)


def test_plan_handles_forty_layers_eight_stages_quickly() -> None:
    rng = random.Random(3)
    fwd = [rng.uniform(0.5, 2.0) for _ in range(40)]
    balance = plan(fwd, [2 * f for f in fwd], 8, microbatches=32, schedule="1f1b")
    assert sum(balance) == 40 and len(balance) == 8


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def test_profile_layers_measures_time_and_memory() -> None:
    model = _model()
    sample = torch.randn(16, 8)
    profile = profile_layers(model, sample, repeats=2)
    assert len(profile.forward) == len(profile.backward) == 5
    assert all(t >= 0 for t in profile.forward + profile.backward)
    assert profile.parameter_bytes == [(8 * 64 + 64) * 4, 0, (64 * 64 + 64) * 4, 0, (64 * 4 + 4) * 4]
    assert profile.activation_bytes[0] == 16 * 8 * 4  # Linear saves its input, not its weight
    assert profile.activation_bytes[1] > 0  # ReLU saves its output
    assert all(p.grad is None for p in model.parameters())


def test_profile_of_a_slice_counts_the_slice() -> None:
    # auto_balance profiles the first rows of the mini-batch: a view into the whole sample's storage.
    sample = torch.randn(64, 8)
    profile = profile_layers(_model(), sample[:16], repeats=1)
    assert profile.activation_bytes[0] == 16 * 8 * 4


def test_by_time_and_by_size_return_valid_balances() -> None:
    model = _model()
    sample = torch.randn(16, 8)
    for balance in (
        by_time(model, sample, 2, repeats=1, microbatches=4, schedule="1f1b"),
        by_size(model, sample, 2, param_scale=4.0),
    ):
        assert sum(balance) == 5 and len(balance) == 2 and min(balance) >= 1
    # Memory is dominated by the 64x64 layer with Adam-like scaling; it sits alone or with small layers.
    assert by_size(model, sample, 5) == [1, 1, 1, 1, 1]


def test_auto_balance_for_pipe() -> None:
    from fastpipe.balance import auto_balance

    model = _model()
    sample = torch.randn(32, 8)
    balance = auto_balance(model, ["cpu", "cpu"], sample, chunks=4, schedule="1f1b", repeats=1)
    assert sum(balance) == 5 and len(balance) == 2
    balance = auto_balance(
        model, ["cpu"] * 4, sample, chunks=4, schedule="interleaved", virtual_stages=2, repeats=1, memory_limit=1e9
    )
    assert sum(balance) == 5 and len(balance) == 4
    with pytest.raises(
        BalanceError, match=r"no balance into 2 stages fits memory_limit=10 B per device: stage \d needs"
    ):
        auto_balance(model, ["cpu", "cpu"], sample, chunks=4, memory_limit=10.0, repeats=1)


def _in_place_inside() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))


def _in_place_first() -> nn.Sequential:
    return nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 8))


@pytest.mark.parametrize("make", [_in_place_inside, _in_place_first], ids=["inside", "first"])
def test_profilers_take_layers_that_write_into_their_input(make: Callable[[], nn.Sequential]) -> None:
    # Each layer is profiled on a copy that is not a leaf, as inside a stage, so autograd allows
    # ReLU(inplace=True); the caller's sample stays as it was.
    from fastpipe import Pipe

    torch.manual_seed(0)
    model, sample = make(), torch.randn(8, 8)
    kept = sample.clone()
    profile = profile_layers(model, sample, repeats=2)
    assert len(profile.forward) == len(model)
    assert all(profile.activation_bytes[i] > 0 for i, layer in enumerate(model) if isinstance(layer, nn.ReLU))
    assert sum(by_time(model, sample, 2, repeats=1, microbatches=2)) == len(model)
    assert sum(by_size(model, sample, 2)) == len(model)
    assert sum(Pipe(make(), balance="auto", devices=["cpu"] * 2, chunks=2, sample=sample).balance) == len(model)
    assert torch.equal(sample, kept)


def test_auto_balance_with_an_in_place_layer_trains_like_the_model() -> None:
    from fastpipe import Pipe

    torch.manual_seed(0)
    model = _in_place_inside()
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = Pipe(model, balance="auto", devices=["cpu"] * 2, chunks=2, sample=x)
    loss = pipe.train_step(x, y, nn.MSELoss())
    ref_loss = nn.MSELoss()(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
