"""Activation offload under asynchronous ``fit``: the window's stream gets the pipe's ``P`` actions.

As in tests/runtime/test_offload.py, a policy is forced on the CPU stages, so that the saved
tensors take ``fastpipe._C``'s host backend as a GPU stage's do.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

import fastpipe
from fastpipe.runtime.host_copies import CopyPath
from fastpipe.runtime.offload import OffloadPolicy

M, N = 4, 3  # micro-batches per mini-batch, mini-batches per window


def mlp(width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(4)]
    )


def batches(width: int = 32, rows: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(M * rows, width, generator=g), torch.randn(M * rows, width, generator=g)) for _ in range(2 * N)
    ]


def forced(pipe: fastpipe.Pipe, fraction: float) -> fastpipe.Pipe:
    for stage in pipe._stages:
        stage.offload = OffloadPolicy(fraction, force=True) if fraction else None
    return pipe


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    count = [0]
    original = CopyPath.to_host

    def to_host(path: CopyPath, t: torch.Tensor) -> Any:
        count[0] += t.numel() * t.element_size()
        return original(path, t)

    monkeypatch.setattr(CopyPath, "to_host", to_host)
    return count


@pytest.mark.parametrize("consistency", ["sync", "stash", "predict"])
def test_fit_with_offload_trains_bitwise_as_without_and_copies_to_the_host(consistency: str, sent: list[int]) -> None:
    runs = []
    for fraction in (0.0, 0.5):
        pipe = forced(fastpipe.Pipe(mlp(), [2, 2], chunks=M, checkpoint="never"), fraction)
        try:
            sent[0] = 0
            opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
            losses = [
                float(loss) for loss in pipe.fit(batches(), ProductLoss(), opt, consistency=consistency, window=N)
            ]
            runs.append((losses, [p.detach().clone() for p in pipe.parameters()], sent[0]))
        finally:
            pipe.close()
    (plain, plain_params, none), (offloaded, params, some) = runs
    assert plain == offloaded and all(torch.equal(a, b) for a, b in zip(plain_params, params))
    assert none == 0 < some


def _counted_and_predicted(data: list[tuple[torch.Tensor, torch.Tensor]], fraction: float) -> tuple[int, Any]:
    """The second window's counted peak on the one device, from before the pipe existed, and its prediction."""
    from fastpipe.memory import _cpu_counter
    from fastpipe.memory.accounting import PeakMeter

    gc.collect()
    base = _cpu_counter.allocated()
    pipe = forced(fastpipe.Pipe(mlp(64), [2, 2], devices=["cpu"], virtual_stages=2, schedule="interleaved",
                                chunks=M, checkpoint="never"), fraction)  # fmt: skip
    try:
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
        run = pipe.fit(data, ProductLoss(), opt, consistency="stash", window=N, memory_limit="1TiB")
        for _ in range(N):
            next(run)
        gc.collect()
        with PeakMeter("cpu") as meter:
            next(run)
        assert run.memory_guard is not None
        (device,) = run.memory_guard.last
        return meter.result.peak_total - base, device
    finally:
        pipe.close()


def test_the_fit_guard_counts_the_offload_and_the_counted_peak_agrees() -> None:
    data = batches(64, 64)  # before the counter: the data is the caller's, not the device's
    install_counter_or_skip()
    (plain, plain_device), (offloaded, device) = (_counted_and_predicted(data, f) for f in (0.0, 1.0))
    print(f"fit offload 1.0: {plain} -> {offloaded} counted, {plain_device.total} -> {device.total} predicted")
    assert plain_device.total == pytest.approx(plain, rel=0.05), (plain, plain_device)
    assert device.offloaded > 0 == plain_device.offloaded and device.total < plain_device.total
    # A device copy is dropped when its host copy has landed, which a busy host delays: the count
    # with offload lies between its prediction and the plain one, where it depends on that timing.
    assert device.total <= offloaded * 1.05 and offloaded <= plain_device.total * 1.05


def _fit(pipe: fastpipe.Pipe, limit: int | str) -> tuple[list[float], list[torch.Tensor], Any]:
    try:
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
        run = pipe.fit(batches(), ProductLoss(), opt, consistency="stash", window=N, memory_limit=limit)
        losses = [float(loss) for loss in run]
        return losses, [p.detach().clone() for p in pipe.parameters()], run.memory_guard
    finally:
        pipe.close()


def test_fit_chooses_auto_offload_under_a_limit_only_offload_meets(sent: list[int]) -> None:
    def pipe(offload: Any = None) -> fastpipe.Pipe:
        # Four stages: with two, each stage's backwards follow its forwards too closely to gain from offload.
        return fastpipe.Pipe(mlp(), [1, 1, 1, 1], chunks=M, checkpoint="never", offload=offload)

    plain, plain_params, guard = _fit(pipe(), "1TiB")
    _, _, whole = _fit(forced(pipe(), 1.0), "1TiB")
    least, most = (max(d.total for d in g.last) * 1.05 for g in (whole, guard))
    assert least < most
    limit = int((least + most) / 2)
    with pytest.raises(ValueError, match=r"over memory_limit.*offload='auto'"):  # without offload nothing fits
        _fit(pipe(), limit)
    auto = pipe("auto")
    auto._offload.movable = [True] * 4  # CPU stages take _C's host path, as a GPU stage's do
    sent[0] = 0
    losses, params, chosen = _fit(auto, limit)
    ((key, shares),) = chosen.offload.items()
    assert any(0 < f for f in shares) and all(f <= 1 for f in shares), shares
    assert all(d.total * 1.05 <= limit for d in chosen.last) and sent[0] > 0
    assert losses == plain and all(torch.equal(a, b) for a, b in zip(plain_params, params))
