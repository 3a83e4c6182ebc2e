"""``DistributedPipe(memory_limit=...)``: every rank predicts every device, and all refuse alike before any action.

Each rank is a process, so the exact CPU counter (:mod:`fastpipe.memory._cpu_counter`) counts that
rank's device alone (as in tests/memory/test_model_ranks.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import (
    ProductLoss,
    install_counter_or_skip,
    metered_after_a_first_step,
    refuse_the_bare_prediction,
)
from torch import nn

H, ROWS, M = 64, 32, 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)) for _ in range(4)])


def limits_on_ranks(rank: int, world: int, schedule: str, balance: list[int]) -> dict[str, Any]:
    """A free run's prediction, a step refused under it, and a step run under it plus the margin."""
    import fastpipe
    from fastpipe.memory._cpu_counter import install

    x, y = torch.randn(M * ROWS, H), torch.randn(M * ROWS, H)  # before the counter: the data is not the device's
    install()  # before the models exist

    def pipe(limit: int | str) -> fastpipe.DistributedPipe:
        # A fixed policy: under the default "auto" a tight limit picks more recompute instead of refusing.
        return fastpipe.DistributedPipe(model(), balance, chunks=M, schedule=schedule, memory_limit=limit,
                                        checkpoint="except_last")  # fmt: skip

    refusal = refuse_the_bare_prediction(pipe, x, y)
    fits = pipe(refusal.limit)
    opt = torch.optim.Adam(fits.parameters())  # the state the prediction counts
    peak = metered_after_a_first_step(fits, opt, x, y)
    state = [p for p in fits.parameters()] + [t for s in opt.state.values() for t in s.values() if t.dim()]
    held = sum(t.numel() * t.element_size() for t in state)  # alive before the meter started
    fits.close()
    return refusal.report(held + peak.peak)


@pytest.mark.parametrize(("schedule", "balance"), [("1f1b", [2, 2]), ("zb-v", [1, 1, 1, 1])])
def test_every_rank_refuses_a_tight_limit_alike_and_runs_under_the_prediction_plus_margin(
    schedule: str, balance: list[int]
) -> None:
    install_counter_or_skip()  # built here once, so that the ranks only load it
    ranks = check_ok(run_ranks(limits_on_ranks, 2, schedule, balance, timeout=180))
    assert ranks[0]["devices"] == ranks[1]["devices"], "every rank predicts every device from the same figures"
    worker, _ = max(ranks[0]["devices"], key=lambda d: d[1])
    for got in ranks:
        assert got["refused"] == ranks[0]["refused"], "the same error on every rank"
        assert f"device {worker} (stages " in got["refused"] and "over memory_limit=" in got["refused"]
        assert "parameters" in got["refused"] and "optimizer" in got["refused"]
        assert got["untouched"], "no action ran before the refusal"
        assert got["counted"] <= got["limit"], got


def failing_measure_on_ranks(rank: int, world: int) -> str:
    """Stage 1's measurement fails on its rank: both ranks raise instead of waiting for the other."""
    import fastpipe

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("a broken layer")

    layers = [nn.Linear(H, H), nn.Linear(H, H), Broken(), nn.Linear(H, H)]
    pipe = fastpipe.DistributedPipe(nn.Sequential(*layers), [2, 2], chunks=M, memory_limit="1GiB")
    x, y = torch.randn(M * ROWS, H), torch.randn(M * ROWS, H)
    try:
        pipe.train_step(x, y, ProductLoss())
    except (ValueError, fastpipe.PipelineError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        pipe.close()
    return "ran"


def test_a_stage_that_cannot_be_measured_fails_the_step_on_every_rank() -> None:
    install_counter_or_skip()
    got = check_ok(run_ranks(failing_measure_on_ranks, 2, timeout=120))
    assert all("measuring stage 1 for memory_limit raised" in g for g in got), got
    assert got[1].startswith("ValueError") and got[0].startswith("PipelineError: fastpipe: rank 1 (stage 1)")


@pytest.mark.parametrize("dp_shard", ["replicate", "fsdp"])
def test_a_limit_the_ranks_cannot_keep_is_refused_when_the_pipe_is_built(dp_shard: str) -> None:
    from fastpipe.distributed.memory_limit import RankMemoryGuard

    with pytest.raises(ValueError, match="not a size.*GiB"):
        RankMemoryGuard("12 parsecs", dp_shard=dp_shard)


def unet_on_ranks(rank: int, world: int) -> list[Any]:
    """The U-Net of the skip tests, with 'd1' crossing from rank 0's stage to rank 1's."""
    import fastpipe

    sys.path.insert(0, str(Path(__file__).parents[1] / "skips"))
    from _unet import unet

    pipe = fastpipe.DistributedPipe(unet(), [4, 7], chunks=2, memory_limit="1GiB")
    pipe.train_step(torch.randn(8, 6), torch.randn(8, 3), nn.MSELoss())
    assert pipe.memory_guard is not None
    return pipe.memory_guard.last


def test_a_skip_between_ranks_is_counted_on_both_as_one_process_predicts_it() -> None:
    from fastpipe.memory.model import predict_memory
    from fastpipe.memory.receive_buffers import buffered_stages, receive_buffer_bytes
    from fastpipe.memory.stage_bytes import measure_stages
    from fastpipe.model.skip_memory import measure_skips, stage_skip_edges
    from fastpipe.schedule.builders import build

    install_counter_or_skip()
    ranks = check_ok(run_ranks(unet_on_ranks, 2, timeout=120))
    sys.path.insert(0, str(Path(__file__).parents[1] / "skips"))
    from _unet import unet

    x, y = torch.randn(4, 6), torch.randn(4, 3)
    stages = measure_stages(unet(), [4, 7], x, loss_fn=nn.MSELoss(), target=y)
    skips = [(a, b, float(n)) for a, b, n in stage_skip_edges(measure_skips(unet(), x), [4, 7])]
    assert skips, "'d1' crosses the cut"
    sched = build("1f1b", 2, 2)
    # On gloo every received input, output gradient, skip and skip gradient sits in a buffer kept
    # across steps.
    alone = predict_memory(
        sched,
        buffered_stages(sched, stages, "tags"),
        receive_buffers=receive_buffer_bytes(sched, stages, "tags", skips),
        checkpoint="except_last",
        optimizer="adam",
        skips=skips,
        skip_buffers=True,
    )
    assert ranks[0] == ranks[1]
    assert alone[0].skips > 0  # the producer's stash; the consumer's copy is in its buffers
    for got, want in zip(ranks[0], alone):
        assert got.skips == want.skips and got.total == pytest.approx(want.total, rel=0.01)
