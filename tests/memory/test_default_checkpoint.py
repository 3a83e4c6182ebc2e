"""``checkpoint="auto"``, the default: the least recompute that fits the devices when no limit is given.

On host memory there is no capacity to fit, so nothing is recomputed. The CUDA capacity
(:func:`fastpipe.memory.capacity.device_capacity`) is stood in for here by patching the
capacity the pipe reads, so the choice, the forward path and the refusal run on a CPU.
"""

from __future__ import annotations

import pytest
import torch
from _memory_utils import ProductLoss
from torch import nn

from fastpipe import Pipe
from fastpipe.distributed.memory_limit import capacity_guard
from fastpipe.memory import recompute as recompute_module
from fastpipe.memory.capacity import capacity_limit, device_capacity
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.stage_bytes import measure_stages

D, ROWS, M = 64, 8, 4


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D)) for _ in range(4)])


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS * M, D, generator=g), torch.randn(ROWS * M, D, generator=g)


def need(checkpoint: str) -> int:
    """The largest device's predicted peak under ``checkpoint``, from a pipe with a limit nothing reaches."""
    pipe = Pipe(mlp(), [2, 2], chunks=M, checkpoint=checkpoint, schedule="gpipe", memory_limit="1TiB")
    try:
        pipe.train_step(*batch(), ProductLoss())
        return max(d.total for d in pipe.memory_guard.last)  # type: ignore[union-attr]
    finally:
        pipe.close()


def grads(pipe: Pipe, forward: bool) -> list[torch.Tensor]:
    x, y = batch()
    if forward:
        ProductLoss()(pipe(x), y).backward()
    else:
        pipe.train_step(x, y, ProductLoss())
    return [p.grad.clone() for p in pipe.parameters()]  # type: ignore[union-attr]


@pytest.fixture
def capacity(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The capacity the next pipe's devices report (set ``capacity[0]``); None: host memory, as on a CPU."""
    told: list[int | None] = [None]
    monkeypatch.setattr(recompute_module, "capacity_limit", lambda devices: told[0])
    return told


def test_the_default_is_auto_and_recomputes_nothing_on_host_memory() -> None:
    pipe = Pipe(mlp(), [2, 2], chunks=M)
    try:
        assert pipe.checkpoint == "auto" and pipe.memory_guard is None
        pipe.train_step(*batch(), ProductLoss())
        assert pipe.checkpoint_chosen == "never"
    finally:
        pipe.close()
    assert device_capacity("cpu") is None and capacity_limit(["cpu", torch.device("cpu")]) is None


@pytest.mark.parametrize("forward", [False, True], ids=["train_step", "forward"])
def test_a_capacity_that_only_recompute_meets_is_met_with_the_gradients_unchanged(
    capacity: list[int | None], forward: bool
) -> None:
    never, always = need("never"), need("always")
    assert always < never
    capacity[0] = int(always * (1 + MARGIN) * 1.01)  # always fits, never does not
    pipe = Pipe(mlp(), [2, 2], chunks=M, schedule="gpipe")
    reference = Pipe(mlp(), [2, 2], chunks=M, schedule="gpipe", checkpoint="never")
    try:
        assert pipe.memory_guard is not None and pipe.memory_guard.limit == capacity[0]
        got, expected = grads(pipe, forward), grads(reference, forward)
        assert pipe.checkpoint_chosen not in (None, "never")
        assert max(d.total for d in pipe.memory_guard.last) * (1 + MARGIN) <= capacity[0]
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # recompute replays the forward exactly
    finally:
        pipe.close()
        reference.close()


def test_a_capacity_that_everything_fits_recomputes_nothing(capacity: list[int | None]) -> None:
    capacity[0] = 1 << 40
    pipe = Pipe(mlp(), [2, 2], chunks=M)
    try:
        pipe.train_step(*batch(), ProductLoss())
        assert pipe.checkpoint_chosen == "never"
    finally:
        pipe.close()


def test_a_capacity_nothing_fits_is_refused_before_the_step_naming_the_capacity(capacity: list[int | None]) -> None:
    capacity[0] = 4096
    pipe = Pipe(mlp(), [2, 2], chunks=M)
    try:
        before = [p.detach().clone() for p in pipe.parameters()]
        with pytest.raises(ValueError, match="capacity of cpu.*no memory_limit was given.*checkpoint='auto' tried"):
            pipe.train_step(*batch(), ProductLoss())
        assert all(p.grad is None for p in pipe.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, pipe.parameters()))
        run = pipe.fit([batch()], ProductLoss(), torch.optim.SGD(pipe.parameters(), lr=0.1), consistency="sync")
        assert run.memory_guard.limit == 4096 and "capacity of cpu" in run.memory_guard.source
    finally:
        pipe.close()


def test_a_recompute_given_is_kept_whatever_the_capacity(capacity: list[int | None]) -> None:
    capacity[0] = 4096
    pipe = Pipe(mlp(), [2, 2], chunks=M, checkpoint="except_last")
    try:
        assert pipe.memory_guard is None
        pipe.train_step(*batch(), ProductLoss())
        assert pipe.checkpoint_chosen == "except_last"
    finally:
        pipe.close()


def test_the_ranks_guard_takes_the_least_capacity_and_none_where_one_rank_has_none() -> None:
    assert capacity_guard([300 << 20, None], "adam", "replicate") is None
    assert capacity_guard([], "adam", "replicate") is None
    guard = capacity_guard([300 << 20, 200 << 20], "adam", "replicate")
    assert guard is not None and guard.limit == 200 << 20
    assert guard.source is not None and "no memory_limit was given" in guard.source


def test_measuring_a_stage_that_draws_leaves_the_generator_where_it_was() -> None:
    model = nn.Sequential(nn.Linear(D, D), nn.Dropout(0.5), nn.Linear(D, D))
    x = torch.randn(ROWS, D)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    measure_stages(model, [1, 2], x, transients=False)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device's capacity")
def test_a_cuda_device_reports_its_free_bytes_and_this_process_reserved() -> None:
    free, total = torch.cuda.mem_get_info(0)
    found = device_capacity("cuda:0")
    assert found is not None and free <= found <= total
