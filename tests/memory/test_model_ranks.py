"""The memory model against each rank's counted bytes: one stage (or a V of two) per gloo rank.

Each rank is a process, so the exact CPU counter (:mod:`fastpipe.memory._cpu_counter`) counts
that rank's device alone: what its stages, their W records, its receive buffers and its
transport hold. The prediction is :func:`fastpipe.memory.model.predict_memory` over stage bytes
measured in this process by :func:`fastpipe.memory.stage_bytes.measure_stages`.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

H, ROWS, M = 64, 32, 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)) for _ in range(4)])


def counted_peak(rank: int, world: int, schedule: str, balance: list[int], checkpoint: str, batch: int) -> int:
    import fastpipe
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.accounting import PeakMeter

    x, y = torch.randn(M * ROWS, H), torch.randn(M * ROWS, H)  # before the counter: the data is not the device's
    install()  # before the model exists
    pipe = fastpipe.DistributedPipe(
        model(), balance, chunks=M, schedule=schedule, checkpoint=checkpoint, wgrad_batch=batch
    )
    pipe.train_step(x, y, ProductLoss())  # the first step builds what later steps reuse (receive buffers)
    pipe.zero_grad(set_to_none=True)
    gc.collect()
    with PeakMeter("cpu") as meter:
        pipe.train_step(x, y, ProductLoss())
    return meter.result.peak


def predicted(schedule: str, balance: list[int], checkpoint: str, batch: int, world: int) -> list[int]:
    from fastpipe.memory.model import predict_memory
    from fastpipe.memory.stage_bytes import measure_stages
    from fastpipe.schedule.builders import build

    x, y = torch.randn(ROWS, H), torch.randn(ROWS, H)
    stages = measure_stages(model(), balance, x, loss_fn=ProductLoss(), target=y)
    per_worker = len(balance) // world
    built = build(schedule, world, M, **({"virtual_stages": per_worker} if per_worker > 1 else {}))
    return [d.total - d.parameters for d in predict_memory(built, stages, checkpoint=checkpoint, wgrad_batch=batch)]


CASES = [
    ("gpipe", [2, 2], "never", 1),
    ("1f1b", [2, 2], "except_last", 1),
    ("1f1b", [2, 2], "always", 1),
    ("zb-h1", [2, 2], "never", 2),
    ("zb-h1", [2, 2], "always", 1),
    ("zb-h2", [2, 2], "never", 1),
    ("zb-v", [1, 1, 1, 1], "never", 2),
    ("interleaved", [1, 1, 1, 1], "never", 1),
    ("dualpipev", [1, 1, 1, 1], "never", 1),
]


@pytest.mark.parametrize(("schedule", "balance", "checkpoint", "batch"), CASES, ids=lambda v: str(v))
def test_each_ranks_predicted_peak_is_within_5_percent_of_its_counted_peak(
    schedule: str, balance: list[int], checkpoint: str, batch: int
) -> None:
    install_counter_or_skip()  # built here once, so that the ranks only load it
    counted = check_ok(run_ranks(counted_peak, 2, schedule, balance, checkpoint, batch, timeout=120))
    model_peaks = predicted(schedule, balance, checkpoint, batch, world=2)
    # dualpipev's worker 1 is over-predicted by one hidden activation (4.9%), and the receive
    # buffers' timing moves a rank's count by a few kB from run to run.
    tolerance = 0.06 if schedule == "dualpipev" else 0.05
    for rank, (got, want) in enumerate(zip(counted, model_peaks)):
        assert want == pytest.approx(got, rel=tolerance), (schedule, rank, got, want)
