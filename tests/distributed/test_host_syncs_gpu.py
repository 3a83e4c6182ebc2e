"""On a GPU: a step's host values move without blocking, and its syncs do not grow with micro-batches.

``torch.cuda.set_sync_debug_mode`` flags every call that makes the host wait for the GPU (a
blocking copy, ``.item()``, ``.tolist()``, a stream synchronize): ``"error"`` where none may
happen, ``"warn"`` to count them. The CPU tests (test_host_syncs.py) count host reads; these
check the CUDA paths that only a GPU has: pinned staging, event-waited copies, device-side sums.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from torch import nn

from fastpipe.step.host_io import HostCopy, value_to
from fastpipe.step.rules import microbatch_weights, split_targets

pytestmark = pytest.mark.gpu


def _syncs(fn: Callable[..., Any], *args: Any) -> tuple[list[str], Any]:
    """The synchronizing calls of ``fn(*args)`` as ``file:line`` (sync debug mode "warn"), and its result."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)], result


def test_host_values_reach_the_gpu_without_a_sync() -> None:
    x, y = torch.randn(64, 32), torch.randint(0, 9, (64,))
    syncs, moved = _syncs(value_to, (x, 3, y), torch.device("cuda:0"))
    assert syncs == []
    assert moved[1] == 3 and torch.equal(moved[0].cpu(), x) and torch.equal(moved[2].cpu(), y)


def test_a_host_copy_waits_for_its_own_copy_only_when_read() -> None:
    values = torch.randn(3, device="cuda:0", dtype=torch.float64)
    syncs, copy = _syncs(HostCopy, values)
    assert syncs == []
    assert torch.equal(copy.read(), values.cpu())


@pytest.mark.parametrize("weighted", [False, True])
def test_gpu_targets_are_weighed_with_one_sync_for_any_number_of_micro_batches(weighted: bool) -> None:
    g = torch.Generator().manual_seed(0)
    target = torch.randint(-1, 50, (64,), generator=g)
    weight = torch.rand(50, generator=g) + 0.5 if weighted else None
    on_host = microbatch_weights(
        nn.CrossEntropyLoss(weight=weight, ignore_index=-1), split_targets(target, 8, None), [8] * 8, "t"
    )
    loss_fn = nn.CrossEntropyLoss(weight=None if weight is None else weight.cuda(), ignore_index=-1)
    for chunks in (2, 8):
        targets = split_targets(target.cuda(), chunks, None)
        syncs, got = _syncs(microbatch_weights, loss_fn, targets, [64 // chunks] * chunks, "t")
        assert len(syncs) == 1, syncs  # the micro-batches' shares, read together
        torch.testing.assert_close(got[0], on_host[0], rtol=1e-6, atol=0)


def _gpu_step_syncs(rank: int, world: int) -> dict[int, list[str]]:
    from fastpipe import DistributedPipe

    out = {}
    for chunks in (2, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(4)])
        pipe = DistributedPipe(model, [2, 2], chunks=chunks, schedule="interleaved", device="cuda:0", timeout=60)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(4 * chunks, 64, generator=g), torch.randint(-1, 64, (4 * chunks,), generator=g)
        loss_fn = nn.CrossEntropyLoss(ignore_index=-1)
        pipe.train_step(x, y, loss_fn)  # first-use syncs are not the step's
        out[chunks] = _syncs(pipe.train_step, x, y, loss_fn)[0]
        pipe.close()
    return out


def test_a_distributed_step_on_a_gpu_syncs_as_often_for_8_micro_batches_as_for_2() -> None:
    (syncs,) = check_ok(run_ranks(_gpu_step_syncs, 1, timeout=120))
    print("one DistributedPipe step on cuda:0, host syncs:", syncs)
    assert sorted(syncs[2]) == sorted(syncs[8])
