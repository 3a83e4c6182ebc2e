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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_host_optimizer_keeps_adams_state_off_a_cuda_device_and_steps_as_adam_does() -> None:
    import copy

    from fastpipe import HostOptimizer

    plain = model()[0].cuda()
    hosted = copy.deepcopy(plain)
    x, y = torch.randn(ROWS, D, device="cuda:0"), torch.randn(ROWS, D, device="cuda:0")
    on_device = torch.optim.Adam(plain.parameters(), lr=1e-3)
    on_host = HostOptimizer(torch.optim.Adam, hosted.parameters(), lr=1e-3)
    for _ in range(3):
        for m, opt in ((plain, on_device), (hosted, on_host)):
            opt.zero_grad()
            ProductLoss()(m(x), y).backward()
            opt.step()
    torch.cuda.synchronize()
    for p, q in zip(plain.parameters(), hosted.parameters()):
        # The host's Adam rounds apart from the device's: ulps of a 1e-3 step, where a lost update is 1e-3.
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    state = [t for s in on_host.inner.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
    assert state and all(t.device.type == "cpu" for t in state)
    assert all(h.is_pinned() for h in on_host.host_params)  # the copies run at the link's speed
