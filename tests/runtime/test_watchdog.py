"""Bounded waits (fastpipe.distributed.watchdog) with fake Work handles: the polling path NCCL takes, on CPU."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist
from _dist_utils import check_ok, run_ranks
from torch import nn

from fastpipe.distributed.watchdog import SendReaper, Watchdog
from fastpipe.errors import PipelineError


class FakeWork:
    """Completes ``after`` seconds from creation (never if None); ``wait`` may raise ``error``."""

    def __init__(self, after: float | None, error: str | None = None) -> None:
        self.done_at = None if after is None else time.monotonic() + after
        self.error = error

    def is_completed(self) -> bool:
        return self.done_at is not None and time.monotonic() >= self.done_at

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while not self.is_completed():
            if limit is not None and time.monotonic() > limit:
                raise RuntimeError("Timed out waiting for the operation")
            if self.error is not None:
                raise RuntimeError(self.error)
            time.sleep(1e-3)
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


def test_poll_notices_completion_within_its_pause_bound() -> None:
    dog = Watchdog(None, "k", timeout=5.0, rank=0)
    work = FakeWork(after=0.03)
    start = time.monotonic()
    dog.poll(work, "the activation", "rank 1", max_pause=5e-5)
    late = time.monotonic() - work.done_at  # type: ignore[operator]
    assert time.monotonic() - start >= 0.03
    assert late < 0.02  # noticed promptly (a loaded CI machine may delay the wake-up itself)


def test_poll_gives_up_after_the_timeout_naming_the_peer() -> None:
    dog = Watchdog(None, "k", timeout=0.2, rank=3)
    start = time.monotonic()
    with pytest.raises(PipelineError, match=r"rank 1 \(stage 1\) did not deliver the gradient within 0.2 s"):
        dog.poll(FakeWork(after=None), "the gradient", "rank 1 (stage 1)")
    assert 0.2 <= time.monotonic() - start < 1.0
    with pytest.raises(PipelineError):  # the watchdog stays failed
        dog.poll(FakeWork(after=0.0), "anything", "rank 1")


def test_poll_stops_when_another_rank_publishes_its_failure() -> None:
    store = dist.HashStore()
    dog = Watchdog(store, "fastpipe/abort/test", timeout=5.0, rank=0)
    threading.Timer(0.1, lambda: store.set("fastpipe/abort/test", "rank 2 (stage 2) raised ValueError")).start()
    start = time.monotonic()
    with pytest.raises(PipelineError, match="rank 2 .stage 2. raised ValueError"):
        dog.poll(FakeWork(after=None), "the activation", "rank 1")
    assert time.monotonic() - start < 1.0  # the store, not the 5 s bound


def test_first_failure_wins_and_peers_are_told_once() -> None:
    store = dist.HashStore()
    told: list[str] = []
    dog = Watchdog(store, "fastpipe/abort/first", timeout=1.0, rank=0)
    dog.on_fail = told.append
    first = dog.fail("rank 0 broke first")
    second = dog.fail("a later symptom")
    assert first is second and "rank 0 broke first" in str(first)
    assert told == ["rank 0 broke first"]
    other = Watchdog(store, "fastpipe/abort/first", timeout=1.0, rank=1)
    assert "rank 0 broke first" in str(other.fail("rank 1's own view"))


def test_a_broken_connection_names_the_peer() -> None:
    dog = Watchdog(None, "k", timeout=1.0, rank=0)
    with pytest.raises(PipelineError, match="rank 1 failed while rank 0 waited for the header.*Connection closed"):
        dog.wait(FakeWork(after=None, error="Connection closed by peer"), "the header", "rank 1")


@pytest.mark.parametrize("poll", [False, True])
def test_send_reaper_drains_and_reports_a_failed_send(poll: bool) -> None:
    dog = Watchdog(None, "k", timeout=1.0, rank=0)
    reaper = SendReaper(timeout=1.0, poll=poll)
    reaper.add(FakeWork(after=0.02), object())
    reaper.add(FakeWork(after=0.04), object())
    reaper.drain(dog)  # returns once both left
    reaper.add(FakeWork(after=None), object())  # never completes: bounded by the reaper's timeout
    with pytest.raises(PipelineError, match="a send from rank 0 did not complete"):
        reaper.drain(dog)
    reaper.close()


def test_a_failure_runs_the_aborts_once_after_telling_the_peers() -> None:
    calls: list[str] = []
    dog = Watchdog(None, "k", timeout=1.0, rank=0)
    dog.on_fail = lambda cause: calls.append("poison")
    dog.aborts += [lambda: calls.append("abort nccl"), lambda: 1 / 0, lambda: calls.append("abort dp")]
    first = dog.fail("rank 1 died")
    assert dog.fail("another cause") is first
    assert calls == ["poison", "abort nccl", "abort dp"]  # a raising abort does not stop the others


def _fails_in_its_loss(rank: int, world: int) -> dict:
    import fastpipe.distributed.runtime as distributed
    from fastpipe.distributed_pipe import DistributedPipe

    aborted: list[object] = []
    distributed.abort_nccl = lambda group: aborted.append(group) or False  # type: ignore[assignment]
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=2, timeout=10)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.train_step(x, y, nn.MSELoss())
    after_good_step = len(aborted)

    def bad_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad loss")

    try:
        pipe.train_step(x, y, bad_loss)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        error = type(exc).__name__
    else:
        error = None
    pipe.close()
    return {"after_good_step": after_good_step, "aborted": [g is dist.group.WORLD for g in aborted], "error": error}


def test_a_failed_step_aborts_the_pipeline_group_on_every_rank() -> None:
    # On gloo the real abort_nccl leaves the group alone (test_backend.py); here it records.
    for rank, got in enumerate(check_ok(run_ranks(_fails_in_its_loss, 2, timeout=60))):
        assert got == {"after_good_step": 0, "aborted": [True], "error": got["error"]}, f"rank {rank}: {got}"
        assert got["error"] in ("ValueError", "PipelineError"), f"rank {rank}: {got}"
