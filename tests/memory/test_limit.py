"""``Pipe(memory_limit=...)``: device bytes, checked against the model before a step runs."""

from __future__ import annotations

import gc

import pytest
import torch
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.limit import MARGIN

H, ROWS, M = 64, 32, 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H), nn.LayerNorm(H), nn.Linear(H, H))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M * ROWS, H, generator=g), torch.randn(M * ROWS, H, generator=g)


def predicted_total(balance: list[int], schedule: str = "1f1b") -> int:
    pipe = Pipe(model(), balance, chunks=M, schedule=schedule, memory_limit="1TiB")
    try:
        pipe.train_step(*data(), ProductLoss())
        (devices,) = pipe.memory_guard.predicted.values()  # type: ignore[union-attr]
    finally:
        pipe.close()
    return max(d.total for d in devices)


def test_a_limit_below_the_prediction_raises_before_the_step_naming_device_and_parts() -> None:
    need = predicted_total([3, 2])
    pipe = Pipe(model(), [3, 2], chunks=M, memory_limit=need, checkpoint="never")  # the margin is not kept free
    try:
        with pytest.raises(ValueError, match=r"device \d \(stages \d\) needs .* over memory_limit=.*: parameters"):
            pipe.train_step(*data(), ProductLoss())
        assert all(p.grad is None for p in pipe.parameters()), "no action ran"
    finally:
        pipe.close()


def test_a_limit_with_the_margin_runs_and_the_counted_peak_stays_under_it() -> None:
    from fastpipe.memory.accounting import PeakMeter

    x, y = data()
    install_counter_or_skip()  # before the model exists
    limit = int(predicted_total([5]) * (1 + MARGIN)) + 1
    pipe = Pipe(model(), [5], chunks=M, memory_limit=limit)
    try:
        pipe.train_step(x, y, ProductLoss())
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cpu") as meter:  # one stage: the process's CPU bytes are the device's
            pipe.train_step(x, y, ProductLoss())
    finally:
        pipe.close()
    params = sum(p.numel() * p.element_size() for p in pipe.parameters())
    assert params + meter.result.peak <= limit


@pytest.mark.parametrize("limit", ["64MiB", "0.5 GiB", 1 << 26, 2.5e8])
def test_a_limit_takes_sizes_as_people_write_them(limit: object) -> None:
    pipe = Pipe(model(), [3, 2], chunks=M, memory_limit=limit)  # type: ignore[arg-type]
    try:
        pipe.train_step(*data(), ProductLoss())
    finally:
        pipe.close()


@pytest.mark.parametrize("limit", ["12 parsecs", "-1GiB", -5, 0, "GiB"])
def test_a_malformed_limit_is_refused_when_the_pipe_is_built(limit: object) -> None:
    with pytest.raises(ValueError, match="GiB"):
        Pipe(model(), [3, 2], chunks=M, memory_limit=limit)  # type: ignore[arg-type]


def test_optimizer_state_host_counts_no_state_so_a_limit_adam_exceeds_fits() -> None:
    def guarded(limit: object, state: str) -> list:
        pipe = Pipe(model(), [3, 2], chunks=M, memory_limit=limit, checkpoint="never", optimizer_state=state)
        try:
            pipe.train_step(*data(), ProductLoss())
            return pipe.memory_guard.last  # type: ignore[union-attr]
        finally:
            pipe.close()

    adam, host = guarded("1TiB", "adam"), guarded("1TiB", "host")
    assert all(d.optimizer == 2 * d.parameters for d in adam) and all(d.optimizer == 0 for d in host)
    limit = int(max(d.total for d in host) * (1 + MARGIN)) + 1
    assert limit < max(d.total for d in adam)
    with pytest.raises(ValueError, match="optimizer"):
        guarded(limit, "adam")
    assert max(d.total for d in guarded(limit, "host")) == max(d.total for d in host)


def test_an_unknown_optimizer_state_is_refused_when_the_pipe_is_built() -> None:
    with pytest.raises(ValueError, match="unknown optimizer 'lion'.*'host'"):
        Pipe(model(), [3, 2], chunks=M, optimizer_state="lion")
