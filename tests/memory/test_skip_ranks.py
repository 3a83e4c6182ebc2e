"""A skip between gloo ranks: each rank's counted peak against the peak its ``DistributedPipe`` guard predicts.

``Linear · GELU · Linear · stash · Linear · Tanh · Linear · pop(add)`` cut in two: the stash is the
first rank's output, popped at the second rank's end. Over gloo the skip and its gradient arrive in
receive buffers kept between steps (the counted third step starts with them), so the comparison
leaves the predicted ``receive_buffers`` out. Before the model knew that, it over-predicted the
consumer by the skips it held (0.86x), and a recomputed producer by the stashes it no longer keeps.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

H, ROWS, M = 64, 32, 4


class _Add(nn.Module):
    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return x + a


def _model() -> nn.Sequential:
    import fastpipe

    torch.manual_seed(0)
    return fastpipe.Sequential(
        nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H), fastpipe.stash("a"),
        nn.Linear(H, 4 * H), nn.Tanh(), nn.Linear(4 * H, H), fastpipe.pops(_Add(), "a"),
    )  # fmt: skip


def counted_and_predicted(rank: int, world: int, schedule: str, checkpoint: str, batch: int) -> tuple[int, int]:
    import fastpipe
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.accounting import PeakMeter

    x, y = torch.randn(M * ROWS, H), torch.randn(M * ROWS, H)  # before the counter: the data is not the device's
    install()
    pipe = fastpipe.DistributedPipe(
        _model(), [4, 4], chunks=M, schedule=schedule, checkpoint=checkpoint, wgrad_batch=batch, memory_limit="1TiB"
    )
    for _ in range(2):  # the first steps build the receive buffers later steps reuse
        pipe.train_step(x, y, ProductLoss())
        pipe.zero_grad(set_to_none=True)
    gc.collect()
    with PeakMeter("cpu") as meter:
        pipe.train_step(x, y, ProductLoss())
    d = pipe.memory_guard.last[rank]
    assert d.receive_buffers >= 2 * M * ROWS * H * 4  # activations or gradients, and the skip's
    return meter.result.peak, d.total - d.parameters - d.optimizer - d.receive_buffers


@pytest.mark.parametrize(
    ("schedule", "checkpoint", "batch"),
    [("zb-h1", "always", 2), ("gpipe", "except_last", 1), ("zb-h2", "never", 1)],
    ids=lambda v: str(v),
)
def test_each_ranks_peak_with_a_skip_between_ranks(schedule: str, checkpoint: str, batch: int) -> None:
    install_counter_or_skip()
    found = check_ok(run_ranks(counted_and_predicted, 2, schedule, checkpoint, batch, timeout=120))
    for rank, (counted, predicted) in enumerate(found):  # the misses were over-predictions: 0.95 holds them
        # A send's buffer lives until gloo's reaper thread lets go of it: what a rank sends and
        # drops (a recomputed stage's output and stash, an input gradient) was seen up to two
        # micro-batches late (1 run in 6); on a loaded host, allow all M.
        late = M * ROWS * H * 4
        assert 0.95 * predicted <= counted <= 1.05 * predicted + late, (schedule, rank, counted, predicted)
