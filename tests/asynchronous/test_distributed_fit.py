"""DistributedPipe.fit: the same losses and weights as Pipe.fit, and a dead rank becomes PipelineError in time."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe

BOUND = 4.0  # the runtime's timeout in the fault test, in seconds
# The fit tests hold the ranks' fit against the same fit in this process. The ranks run one thread
# each and this process as many as the user's, so the GEMMs may take other kernels: equal up to
# rounding. Reductions on the way: three Linears' inputs (8, 16, 16), the loss's mean over 12 x 4
# values and the 12 rows a weight gradient sums over.
K = 8 + 16 + 16 + 12 * 4 + 12


class Trap(nn.Module):
    """Identity until its ``calls``-th forward, where the process dies."""

    def __init__(self, calls: int) -> None:
        super().__init__()
        self.calls, self.seen = calls, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if self.seen == self.calls:
            os._exit(1)
        return x


def model(trap: int = 0) -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.Tanh(),
        Trap(trap) if trap else nn.Identity(),
        nn.Linear(16, 4),
    )


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(12, 8, generator=g), torch.randn(12, 4, generator=g)) for _ in range(5)]


def _fit(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(model(), [2, 4], chunks=2, checkpoint="except_last")
    opt = torch.optim.Adam(pipe.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    batches = [(x if rank == 0 else None, y if rank == 1 else None) for x, y in data()]
    run = pipe.fit(batches, nn.MSELoss(), opt, consistency="predict", scheduler=sched, window=2)
    losses = [loss.item() for loss in run]
    pipe.close()
    return {
        "losses": losses,
        "state": {k: v.clone() for k, v in pipe.state_dict().items()},
        "copies": run.weight_copy_bytes,
    }


def test_distributed_fit_equals_local_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    # The order-matched transport (what NCCL runs) must also carry the stream's plan, U actions included;
    # the tag-matched one runs in the fault test below.
    monkeypatch.setenv("FASTPIPE_P2P", "ordered")
    outcomes = check_ok(run_ranks(_fit, 2, timeout=90))
    pipe = Pipe(model(), balance=[2, 4], chunks=2, checkpoint="except_last")
    opt = torch.optim.Adam(pipe.parameters(), lr=3e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    run = pipe.fit(data(), nn.MSELoss(), opt, consistency="predict", scheduler=sched, window=2)
    losses = [loss.item() for loss in run]
    assert outcomes[0]["losses"] == outcomes[1]["losses"]  # every rank reports the last stage's loss
    assert_close_reordered(torch.tensor(outcomes[0]["losses"]), torch.tensor(losses), k=K)
    state = pipe.state_dict()
    for rank, outcome in enumerate(outcomes):
        for k, v in outcome["state"].items():
            assert_close_reordered(v, state[k], k=K, msg=f"rank {rank}: {k}")
        assert outcome["copies"] == {rank: run.weight_copy_bytes[rank]}
    assert run.weight_copy_bytes[0] > 0  # stage 0 ran on predictions


def bn_model() -> nn.Sequential:
    torch.manual_seed(5)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, momentum=None),
        nn.Linear(16, 4),
    )


def _fit_bn(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(bn_model(), [3, 3], chunks=2, checkpoint="except_last", deferred_batch_norm=True)
    opt = torch.optim.Adam(pipe.parameters(), lr=3e-2)
    batches = [(x if rank == 0 else None, y if rank == 1 else None) for x, y in data()]
    losses = [loss.item() for loss in pipe.fit(batches, nn.MSELoss(), opt, consistency="predict", window=3)]
    pipe.close()
    return {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()}}


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """This process on one intra-op thread, as each rank runs (tests/_dist_utils.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def test_distributed_fit_with_deferred_batch_norm_equals_local_fit() -> None:
    # The running statistics are committed per mini-batch at each rank's update, as in Pipe.fit.
    outcomes = check_ok(run_ranks(_fit_bn, 2, timeout=90))
    # A bias that feeds a BatchNorm has a true gradient of 0: what autograd computes for it is
    # rounding noise, which Adam turns into steps of about lr (and the running mean follows).
    # Those values agree only where the arithmetic is identical, so the local fit runs on one
    # thread, as each rank does: the same GEMMs on the same shapes, bit for bit.
    with _one_thread():
        pipe = Pipe(bn_model(), balance=[3, 3], chunks=2, checkpoint="except_last", deferred_batch_norm=True)
        opt = torch.optim.Adam(pipe.parameters(), lr=3e-2)
        losses = [loss.item() for loss in pipe.fit(data(), nn.MSELoss(), opt, consistency="predict", window=3)]
        pipe.close()
    assert outcomes[0]["losses"] == outcomes[1]["losses"] == losses
    state = pipe.state_dict()
    for rank, outcome in enumerate(outcomes):
        assert any("running_var" in k for k in outcome["state"]), rank
        for k, v in outcome["state"].items():
            assert torch.equal(v, state[k]), (rank, k)
    assert int(state["4.num_batches_tracked"]) == len(data())


def _dies(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(model(trap=9), [2, 4], chunks=2, checkpoint="never", timeout=BOUND)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    start = time.monotonic()
    try:
        for _ in pipe.fit(data(), nn.MSELoss(), opt, consistency="stash", window=5):
            pass
    except BaseException as exc:
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    finally:
        pipe.close()
    return {"type": None}


def test_dead_rank_mid_stream_becomes_pipeline_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FASTPIPE_P2P", raising=False)
    outcomes = run_ranks(_dies, 2, timeout=60)
    assert "died" in outcomes[1]
    result = outcomes[0]["ok"]
    assert result["type"] == "PipelineError", result
    assert "rank 1" in result["message"], result["message"]
    assert result["elapsed"] < BOUND + 2.0, result


def _pp_dp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fastpipe.distributed_pipe import DistributedPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    half = slice(mesh.get_local_rank("dp") * 6, mesh.get_local_rank("dp") * 6 + 6)  # each replica: half a batch
    out = {}
    for consistency in ("sync", "predict"):
        pipe = DistributedPipe(model(), [2, 4], chunks=2, mesh=mesh, timeout=20)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
        batches = [(x[half] if pipe.is_first else None, y[half] if pipe.is_last else None) for x, y in data()]
        losses = [loss.item() for loss in pipe.fit(batches, nn.MSELoss(), opt, consistency=consistency, window=3)]
        out[consistency] = {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()}}
        pipe.close()
    return out


def test_pipeline_times_data_parallel_fit() -> None:
    outcomes = check_ok(run_ranks(_pp_dp, 4, timeout=120))
    # sync on 2 replicas of half batches = sync on the whole batch (micro-batches of 3 rows either way)
    pipe = Pipe(model(), balance=[2, 4], chunks=4)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses = [loss.item() for loss in pipe.fit(data(), nn.MSELoss(), opt, consistency="sync")]
    state = pipe.state_dict()
    for outcome in outcomes:
        assert outcome["sync"]["losses"] == pytest.approx(losses, rel=1e-5)
        for k, v in outcome["sync"]["state"].items():
            torch.testing.assert_close(v, state[k], rtol=1e-5, atol=1e-6)
    # predict: the replicas of a stage hold the same weights, and every rank saw the same losses
    mesh_ranks = {0: [0, 1], 1: [2, 3]}  # pp x dp, row-major: ranks 0, 1 hold stage 0
    for stage, ranks in mesh_ranks.items():
        a, b = (outcomes[r]["predict"]["state"] for r in ranks)
        assert all(torch.equal(a[k], b[k]) for k in a), stage
    assert outcomes[0]["predict"]["losses"] == outcomes[2]["predict"]["losses"]


def _virtual(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    out = {}
    for consistency in ("sync", "predict", "stash"):
        # 4 stages on 2 ranks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3 (interleaved)
        pipe = DistributedPipe(model(), [1, 2, 1, 2], chunks=2, schedule="interleaved", checkpoint="except_last")
        opt = torch.optim.Adam(pipe.parameters(), lr=3e-2)
        batches = [(x if pipe.is_first else None, y if pipe.is_last else None) for x, y in data()]
        run = pipe.fit(batches, nn.MSELoss(), opt, consistency=consistency, window=3)
        losses = [loss.item() for loss in run]
        out[consistency] = {
            "losses": losses,
            "state": {k: v.clone() for k, v in pipe.state_dict().items()},
            "copies": run.weight_copy_bytes,
            "bound": run.weight_copy_bound,
        }
        pipe.close()
    return out


def test_virtual_stages_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FASTPIPE_P2P", "ordered")
    outcomes = check_ok(run_ranks(_virtual, 2, timeout=120))
    # sync: each stage sums its micro-batches in the same order under the interleaved and the plain 1F1B,
    # so the virtual-stage run equals a local 4-stage fit up to the thread counts' rounding (see K).
    pipe = Pipe(model(), balance=[1, 2, 1, 2], chunks=2, checkpoint="except_last")
    opt = torch.optim.Adam(pipe.parameters(), lr=3e-2)
    losses = [loss.item() for loss in pipe.fit(data(), nn.MSELoss(), opt, consistency="sync", window=3)]
    state = pipe.state_dict()
    for outcome in outcomes:
        assert_close_reordered(torch.tensor(outcome["sync"]["losses"]), torch.tensor(losses), k=K)
        for k, v in outcome["sync"]["state"].items():
            assert_close_reordered(v, state[k], k=K, msg=k)
    for consistency in ("predict", "stash"):
        a, b = outcomes[0][consistency], outcomes[1][consistency]
        assert a["losses"] == b["losses"] and all(map(torch.isfinite, map(torch.tensor, a["losses"])))
        # The stream ran asynchronously: other weights than the same ranks' sync run (the same arithmetic).
        assert a["losses"] != outcomes[0]["sync"]["losses"]
        # Each rank's first virtual stage (0 on rank 0, 1 on rank 1) runs ahead of its updates; the copies
        # it held are the schedule's bound, read independently from the interleaved stream.
        for rank, outcome in enumerate(outcomes):
            got = outcome[consistency]
            assert got["copies"] == got["bound"] and got["copies"][rank] > 0, (rank, consistency, got)
            assert set(got["copies"]) == {rank, rank + 2}


def _moves(rank: int, world: int) -> list:
    # Each rank watches the function that puts batches on its device (a GPU under NCCL; the CPU here).
    import fastpipe.asynchronous.distributed as distributed_fit
    import fastpipe.asynchronous.fit_run as local_fit
    from fastpipe.distributed_pipe import DistributedPipe

    moves: list = []
    real = local_fit.to_device

    def spy(value: object, device: torch.device) -> object:
        moves.append((tuple(value.shape), str(device)))  # type: ignore[attr-defined]
        return real(value, device)

    distributed_fit.to_device = spy  # inputs, on stage 0's rank
    local_fit.to_device = spy  # targets, on the last stage's rank
    pipe = DistributedPipe(model(), [2, 4], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    batches = [(x if rank == 0 else None, y if rank == 1 else None) for x, y in data()[:2]]
    assert len(list(pipe.fit(batches, nn.MSELoss(), opt, consistency="stale", window=2))) == 2
    pipe.close()
    return moves


def test_distributed_fit_puts_inputs_and_targets_on_the_stage_devices() -> None:
    first, last = check_ok(run_ranks(_moves, 2, timeout=90))
    assert first == [((6, 8), "cpu")] * 4  # 2 mini-batches x 2 micro-batches of input
    assert last == [((6, 4), "cpu")] * 4  # and of targets
