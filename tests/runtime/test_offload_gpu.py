"""Activation offload on CUDA: pinned blocks, the D2H/H2D copy streams, the allocator's peak.

Both stages run on ``cuda:0`` (one GPU), so the allocator's peak is the whole pipe's. The
measured figures (peak with and without offload, the step times, the copy bandwidth) are
printed for bench/RESULTS.md; the assertions are the gradients, bit for bit, and a lower peak.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch
from _memory_utils import ProductLoss
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.offload_bytes import copy_bandwidth

pytestmark = [pytest.mark.gpu, pytest.mark.time_limit(120)]

D, H, M, ROWS = 1024, 4096, 8, 256
SCHEDULES = [("gpipe", 1, [4, 4]), ("1f1b", 1, [4, 4]), ("zb-h1", 1, [4, 4]), ("zb-v", 2, [2, 2, 2, 2])]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, H), nn.GELU(), nn.Linear(H, D), nn.Tanh())])


def run(
    offload: float, name: str, virtual: int, balance: list[int], checkpoint: str
) -> tuple[list[torch.Tensor], int, float]:
    """The gradients, the allocator's peak and the time of a second step (the first creates the sums)."""
    x, y = torch.randn(M * ROWS, D), torch.randn(M * ROWS, D, device="cuda:0")
    devices = ["cuda:0"] * len(balance)
    pipe = Pipe(
        model(),
        balance,
        devices=devices,
        chunks=M,
        schedule=name,
        virtual_stages=virtual,
        checkpoint=checkpoint,
        offload=offload,
    )
    try:
        pipe.train_step(x, y, ProductLoss())
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        began = time.perf_counter()
        pipe.train_step(x, y, ProductLoss())
        torch.cuda.synchronize()
        took = time.perf_counter() - began
        peak = torch.cuda.max_memory_allocated() - start
        return [p.grad.detach().cpu() for p in pipe.parameters()], peak, took
    finally:
        pipe.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
@pytest.mark.parametrize("name, virtual, balance", SCHEDULES)
def test_offload_on_cuda_keeps_gradients_bitwise_and_lowers_the_peak(name, virtual, balance, checkpoint) -> None:
    plain, peak, took = run(0.0, name, virtual, balance, checkpoint)
    offloaded, peak_offloaded, took_offloaded = run(0.5, name, virtual, balance, checkpoint)
    for a, b in zip(plain, offloaded):
        assert torch.equal(a, b)
    mib = float(1 << 20)
    print(
        f"\n{name} {checkpoint}: peak {peak / mib:.1f} MiB without offload, {peak_offloaded / mib:.1f} MiB with 0.5; "
        f"step {took * 1e3:.1f} ms against {took_offloaded * 1e3:.1f} ms"
    )
    if checkpoint == "never":
        assert peak_offloaded < peak


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_copy_bandwidth_on_cuda_is_measured() -> None:
    bandwidth = copy_bandwidth("cuda:0", nbytes=256 << 20, repeats=5)
    print(f"\n{bandwidth}")
    assert bandwidth.to_host > 1e9 and bandwidth.to_device > 1e9  # pinned copies over PCIe or NVLink-C2C
