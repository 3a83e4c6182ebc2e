"""The memory model against the CUDA caching allocator: the GPU stage of a CPU + GPU pipe.

Stage 0 runs on the CPU and stage 1 on ``cuda:0``, so the allocator's peak during a step is
stage 1's device alone. Its prediction comes from stage bytes measured with the model on the
GPU. The allocator rounds blocks up (512 B, and 2 MiB segments are not counted: allocated
bytes only), so the prediction may undercount by a block per tensor; 5% as on CPU.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _memory_utils import ProductLoss
from torch import nn

from fastpipe import Pipe

pytestmark = [pytest.mark.gpu, pytest.mark.time_limit(60)]

D, H, M, ROWS = 512, 2048, 8, 64


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, H), nn.GELU(), nn.Linear(H, D)) for _ in range(4)])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_the_gpu_stages_predicted_peak_is_within_5_percent_of_the_allocators(schedule: str) -> None:
    from fastpipe.memory.accounting import PeakMeter
    from fastpipe.memory.model import predict_memory
    from fastpipe.memory.stage_bytes import measure_stages
    from fastpipe.schedule.builders import build

    x, y = torch.randn(M * ROWS, D), torch.randn(M * ROWS, D, device="cuda:0")
    pipe = Pipe(model(), [2, 2], devices=["cpu", "cuda:0"], chunks=M, schedule=schedule, checkpoint="never")
    try:
        pipe.train_step(x, y, ProductLoss())
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cuda:0") as meter:
            pipe.train_step(x, y, ProductLoss())
    finally:
        pipe.close()
    on_gpu = model().to("cuda:0")
    stages = measure_stages(on_gpu, [2, 2], x[:ROWS].to("cuda:0"), loss_fn=ProductLoss(), target=y[:ROWS])
    batch = pipe._stages[-1].wgrad_batch  # the runtime's, on this device
    device = predict_memory(build(schedule, 2, M), stages, checkpoint="never", wgrad_batch=batch)[1]
    predicted = device.total - device.parameters
    print(f"{schedule}: allocator {meter.result.peak} B, predicted {predicted} B ({device})")
    assert predicted == pytest.approx(meter.result.peak, rel=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_memory_limit_measures_a_pipe_whose_stages_sit_on_two_devices() -> None:
    # Stage 1 must receive stage 0's CPU output on the GPU while measured, as the pipe hands it on.
    pipe = Pipe(model(), [2, 2], devices=["cpu", "cuda:0"], chunks=4, checkpoint="never", memory_limit="64GiB")
    x, y = torch.randn(4 * ROWS, D), torch.randn(4 * ROWS, D)
    pipe.train_step(x, y, ProductLoss())
    assert len(pipe.memory_guard.last) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_default_pipe_on_cuda_is_held_to_the_devices_capacity_and_recomputes_nothing_there() -> None:
    free, total = torch.cuda.mem_get_info(0)
    pipe = Pipe(model(), [2, 2], devices=["cuda:0", "cuda:0"], chunks=4)
    try:
        guard = pipe.memory_guard
        assert guard is not None and free <= guard.limit <= total and "capacity of cuda:0" in str(guard.source)
        x, y = torch.randn(4 * ROWS, D, device="cuda:0"), torch.randn(4 * ROWS, D, device="cuda:0")
        pipe.train_step(x, y, ProductLoss())
        assert pipe.checkpoint_chosen == "never"  # a few MiB fit any GPU
        ProductLoss()(pipe(x), y).backward()  # a training forward is checked under the same guard
    finally:
        pipe.close()
