"""What a step keeps per micro-batch until it ends: its result, in a storage of the result's size."""

from __future__ import annotations

import gc

import torch
from _memory_utils import install_counter_or_skip
from torch import nn

from fastpipe import Pipe

H, ROWS = 256, 128


def counted_peak(loss_fn: nn.Module, chunks: int) -> int:
    from fastpipe.memory.accounting import PeakMeter

    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(nn.Linear(H, H), nn.GELU(), nn.Linear(H, H)), [3], chunks=chunks, checkpoint="never")
    x, y = torch.randn(chunks * ROWS, H), torch.randn(chunks * ROWS, H)
    try:
        pipe.train_step(x, y, loss_fn)
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cpu") as meter:
            pipe.train_step(x, y, loss_fn)
    finally:
        pipe.close()
    return meter.result.peak


def test_mse_loss_holds_no_buffer_per_micro_batch_under_1f1b() -> None:
    install_counter_or_skip()
    # torch's mse_loss returns a 0-d view of an input-sized buffer (128 KiB here); one stage
    # under 1F1B holds one micro-batch at a time, so 8 micro-batches peak where 2 do.
    assert torch.nn.functional.mse_loss(torch.randn(ROWS, H), torch.randn(ROWS, H)).untyped_storage().nbytes() > 4
    two, eight = counted_peak(nn.MSELoss(), 2), counted_peak(nn.MSELoss(), 8)
    assert eight - two < 4096, (two, eight)
