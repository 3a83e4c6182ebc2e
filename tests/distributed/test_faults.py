"""Never hang: a dead, failing or stuck rank makes every other rank raise PipelineError in time."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from torch import nn

HIDDEN = 8
BOUND = 4.0  # the runtime's timeout in these tests, in seconds


class Trap(nn.Module):
    """Identity, until its ``calls``-th forward, where it dies, raises, stalls or poisons."""

    def __init__(self, how: str, calls: int) -> None:
        super().__init__()
        self.how, self.calls, self.seen = how, calls, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if self.seen == self.calls:
            if self.how == "exit":
                os._exit(1)
            if self.how == "raise":
                raise ValueError("bad value in the trap")
            if self.how == "stall":
                time.sleep(BOUND + 3.0)  # longer than the bound, then it carries on
        return x


def make_model(trap_stage: int, how: str, calls: int, stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for s in range(stages):
        layers += [nn.Linear(HIDDEN, HIDDEN), Trap(how, calls) if s == trap_stage else nn.Identity()]
    return nn.Sequential(*layers)


def _faulty(rank: int, world: int, trap_stage: int, how: str) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(
        make_model(trap_stage, how, 7, world), [2] * world, chunks=4, schedule="1f1b", checkpoint="never", timeout=BOUND
    )
    x, y = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    pipe.train_step(x, y, nn.MSELoss())  # 4 forwards: fine
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.MSELoss())  # the trap fires in micro-batch 2
    except BaseException as exc:
        elapsed = time.monotonic() - start
        if how == "raise" and rank == trap_stage:
            time.sleep(3.0)  # stay connected: the peers must learn of the error through the store
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": elapsed}
    finally:
        pipe.close()
    return {"type": None, "elapsed": time.monotonic() - start}


@pytest.mark.parametrize("world,dead", [(2, 1), (4, 2)])
def test_rank_that_exits_mid_step_makes_the_others_raise_in_time(world: int, dead: int, transport: str) -> None:
    outcomes = run_ranks(_faulty, world, dead, "exit", timeout=60)
    assert "died" in outcomes[dead]
    for rank, outcome in enumerate(outcomes):
        if rank == dead:
            continue
        assert "ok" in outcome, (rank, outcome)
        assert outcome["exitcode"] == 0, (rank, outcome)  # destroyed its process group and exited in time
        result = outcome["ok"]
        assert result["type"] == "PipelineError", (rank, result)
        assert f"rank {dead}" in result["message"], (rank, result["message"])
        assert result["elapsed"] < BOUND + 2.0, (rank, result)


def test_rank_that_raises_keeps_its_error_and_the_others_get_pipeline_error(transport: str) -> None:
    results = check_ok(run_ranks(_faulty, 2, 1, "raise", timeout=60))
    assert results[1]["type"] == "ValueError"
    assert "bad value in the trap" in results[1]["message"]
    assert results[0]["type"] == "PipelineError"
    assert "rank 1" in results[0]["message"] and "stage 1" in results[0]["message"]
    assert "ValueError" in results[0]["message"]
    assert results[0]["elapsed"] < 2.0  # told through the store while rank 1 is alive, not by the timeout


def test_stuck_rank_is_reported_after_the_bound(transport: str) -> None:
    outcomes = run_ranks(_faulty, 2, 0, "stall", timeout=60)
    result = outcomes[1]["ok"]
    assert result["type"] == "PipelineError"
    assert "rank 0" in result["message"] and "within" in result["message"]
    assert BOUND - 0.5 < result["elapsed"] < BOUND + 2.0


def _cold_first_step(rank: int, world: int) -> float:
    from fastpipe.distributed_pipe import DistributedPipe

    # Stage 1's first forward stalls past the bound, as a first-launch Triton compile may.
    model = make_model(1, "stall", 1, world)
    pipe = DistributedPipe(model, [2] * world, chunks=2, schedule="1f1b", checkpoint="never", timeout=BOUND)
    x, y = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    start = time.monotonic()
    pipe.train_step(x, y, nn.MSELoss())
    elapsed = time.monotonic() - start
    pipe.train_step(x, y, nn.MSELoss())  # later steps run as usual (their bound: the stuck-rank test)
    pipe.close()
    return elapsed


def test_the_first_step_waits_under_its_own_longer_bound(transport: str) -> None:
    for elapsed in check_ok(run_ranks(_cold_first_step, 2, timeout=60)):
        assert elapsed > BOUND  # a peer waited past `timeout` for the cold stage, and did not fail


def _cold_first_step_under_the_normal_bound(rank: int, world: int) -> dict:
    from fastpipe import PipelineError
    from fastpipe.distributed_pipe import DistributedPipe

    model = make_model(1, "stall", 1, world)
    pipe = DistributedPipe(model, [2] * world, chunks=2, schedule="1f1b", timeout=BOUND, first_step_timeout=BOUND)
    x, y = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
    try:
        pipe.train_step(x, y, nn.MSELoss())
        return {"type": None}
    except PipelineError as exc:
        return {"type": "PipelineError", "message": str(exc)}


def test_first_step_timeout_sets_the_first_steps_bound(transport: str) -> None:
    # The same cold stage as above, with the first step held to the normal bound: the peer fails.
    results = check_ok(run_ranks(_cold_first_step_under_the_normal_bound, 2, timeout=60))
    assert any(r["type"] == "PipelineError" for r in results), results


def _nan(rank: int, world: int) -> list:
    from fastpipe import PipelineError
    from fastpipe.distributed_pipe import DistributedPipe

    out: list = []
    for mode in ("raise", "skip"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN))
        pipe = DistributedPipe(model, [1, 1], chunks=4, schedule="1f1b", timeout=BOUND, on_nan=mode)
        x, y = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
        bad = y.clone()
        bad[5, 0] = float("nan")  # micro-batch 2 (samples 4..5)
        try:
            loss = pipe.train_step(x, bad, nn.MSELoss())
            out.append((mode, "returned", loss.item(), [p.grad is None for p in pipe.parameters()]))
        except PipelineError as exc:
            out.append((mode, "raised", str(exc), [p.grad is None for p in pipe.parameters()]))
        # the group is still usable afterwards
        out.append((mode, "next", pipe.train_step(x, y, nn.MSELoss()).item(), None))
    return out


def test_nan_loss_is_reported_with_step_and_microbatch_then_raise_or_skip() -> None:
    for results in check_ok(run_ranks(_nan, 2, timeout=60)):
        (m1, what1, msg, no_grads1), (_, next1, loss1, _), (m2, what2, loss2, no_grads2), (_, _, loss3, _) = results
        assert (m1, what1) == ("raise", "raised")
        assert "step 1" in msg and "micro-batch 2" in msg, msg
        assert all(no_grads1)
        assert (m2, what2) == ("skip", "returned")
        assert loss2 != loss2  # nan
        assert all(no_grads2)  # the skipped step left no gradients
        assert loss1 == loss1 and loss3 == loss3


def _dies_before_save(rank: int, world: int, path: str) -> dict:
    import fastpipe
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(
        make_model(-1, "none", 0, world), [2] * world, chunks=2, schedule="1f1b", checkpoint="never", timeout=BOUND
    )
    pipe.train_step(torch.randn(4, HIDDEN), torch.randn(4, HIDDEN), nn.MSELoss())
    if rank == world - 1:
        os._exit(1)  # never reaches save: the others must not wait for it forever
    start = time.monotonic()
    try:
        fastpipe.save(pipe, path)
    except BaseException as exc:
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None}


def test_rank_dead_before_save_makes_the_others_raise(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    outcomes = run_ranks(_dies_before_save, 2, path, timeout=60)
    assert "died" in outcomes[1] or "error" in outcomes[1], outcomes[1]
    assert "ok" in outcomes[0], outcomes[0]
    got = outcomes[0]["ok"]
    assert got["type"] == "PipelineError", got
    assert "save" in got["message"] and got["elapsed"] < BOUND + 10
    assert not os.path.exists(path)


def _calls_forward(rank: int, world: int) -> str:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(make_model(-1, "none", 0, world), [2] * world, chunks=2, timeout=BOUND)
    try:
        pipe(torch.randn(4, HIDDEN))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_forward_is_refused_with_a_hint() -> None:
    for message in check_ok(run_ranks(_calls_forward, 2)):
        assert message.startswith("PipelineError") and "train_step" in message


def _refusal(world: int, **kwargs: object) -> dict:
    """Build a DistributedPipe expected to be refused: its message and how long that took."""
    from fastpipe.distributed_pipe import DistributedPipe

    start = time.monotonic()
    try:
        DistributedPipe(make_model(-1, "none", 0, world), [2] * world, timeout=BOUND, **kwargs)
    except ValueError as exc:
        return {"message": str(exc), "elapsed": time.monotonic() - start}
    return {"message": "no error"}


def _mismatched(rank: int, world: int) -> dict:
    return _refusal(world, chunks=4 if rank == 0 else 2, schedule="1f1b")


def test_ranks_built_with_different_settings_are_refused_at_once() -> None:
    for result in check_ok(run_ranks(_mismatched, 2, timeout=60)):
        assert "disagree on chunks" in result["message"], result
        assert "rank 0: 4" in result["message"] and "rank 1: 2" in result["message"]
        assert result["elapsed"] < BOUND


def _transport_differs(rank: int, world: int) -> dict:
    os.environ["FASTPIPE_P2P"] = "ordered" if rank == 1 else "tags"
    return _refusal(world, chunks=2)


def test_ranks_with_different_transports_are_refused_at_once() -> None:
    for result in check_ok(run_ranks(_transport_differs, 2, timeout=60)):
        assert "disagree on the transport" in result["message"], result
        assert "rank 0: tags" in result["message"] and "rank 1: ordered" in result["message"]
        assert result["elapsed"] < BOUND


class BigTag(nn.Module):
    """Adds a non-tensor item too big for a header on the 2nd micro-batch of the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> Any:
        self.calls += 1
        return (x, "x" * (4000 if self.calls == 6 else 1))


class DropTag(nn.Module):
    def forward(self, value: tuple) -> torch.Tensor:
        return value[0]


def _unsendable(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), BigTag(), DropTag(), nn.Linear(HIDDEN, HIDDEN))
    pipe = DistributedPipe(model, [2, 2], chunks=4, schedule="1f1b", checkpoint="never", timeout=BOUND)
    x, y = torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    pipe.train_step(x, y, nn.MSELoss())
    start = time.monotonic()
    try:
        pipe.train_step(x, y, nn.MSELoss())
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        if rank == 0:
            time.sleep(3.0)  # stay alive: the peer must learn of it from the abort header, not a lost connection
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - start}
    return {"type": None}


def test_a_value_that_cannot_be_sent_fails_the_peer_at_once(transport: str) -> None:
    sender, receiver = check_ok(run_ranks(_unsendable, 2, timeout=60))
    assert sender["type"] == "ValueError" and "header" in sender["message"], sender
    assert receiver["type"] == "PipelineError" and "rank 0" in receiver["message"], receiver
    assert receiver["elapsed"] < 2.0, receiver  # the abort header, not the 4 s bound
