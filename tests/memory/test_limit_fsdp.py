"""``DistributedPipe(memory_limit=..., dp_shard="fsdp")``: sharded stages are predicted, refused alike, and fit.

4 gloo ranks (2 pipeline ranks x 2 replicas). Each rank is a process, so the exact CPU counter
(:mod:`fastpipe.memory._cpu_counter`) counts that rank's device alone.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss, install_counter_or_skip, refuse_the_bare_prediction
from torch import nn

H, HIDDEN, ROWS, M = 64, 255, 32, 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, H)) for _ in range(4)])


def limits_on_ranks(rank: int, world: int) -> dict[str, Any]:
    """A free run's prediction, a step refused under it, and steps run under it plus the margin."""
    from torch.distributed.device_mesh import init_device_mesh

    import fastpipe
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.accounting import PeakMeter

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    x, y = torch.randn(M * ROWS, H), torch.randn(M * ROWS, H)  # before the counter: the data is not the device's
    install()  # before the models exist

    def pipe(limit: int | str) -> fastpipe.DistributedPipe:
        return fastpipe.DistributedPipe(
            model(), [2, 2], chunks=M, schedule="1f1b", mesh=mesh, dp_shard="fsdp", memory_limit=limit
        )

    refusal = refuse_the_bare_prediction(pipe, x, y)
    fits = pipe(refusal.limit)
    opt = torch.optim.Adam(fits.parameters())  # the state the prediction counts
    counted = 0
    for _ in range(2):  # the first step builds what later steps reuse (receive buffers, Adam's state)
        gc.collect()
        with PeakMeter("cpu") as meter:
            fits.train_step(x, y, ProductLoss())
            opt.step()
        opt.zero_grad(set_to_none=True)
        counted = max(counted, meter.result.start + meter.result.peak)  # everything this rank holds
    fits.close()
    return refusal.report(counted)


def test_every_rank_refuses_a_tight_limit_alike_naming_the_sharded_parts_and_runs_under_the_margin() -> None:
    install_counter_or_skip()  # built here once, so that the ranks only load it
    ranks = check_ok(run_ranks(limits_on_ranks, 4, timeout=600))
    assert all(got["devices"] == ranks[0]["devices"] for got in ranks), "every rank predicts every device alike"
    worker, _ = max(ranks[0]["devices"], key=lambda d: d[1])
    for got in ranks:
        message = got["refused"]
        assert message == ranks[0]["refused"], "the same error on every rank"
        assert f"device {worker} (stages " in message and "over memory_limit=" in message
        for part in ("parameters", "optimizer", "gathered", "reduce_scatter", "dp_shard='fsdp' over 2 replicas"):
            assert part in message, (part, message)
        assert got["untouched"], "no action ran before the refusal"
        assert got["counted"] <= got["limit"], got
