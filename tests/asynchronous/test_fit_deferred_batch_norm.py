"""Pipe.fit with deferred_batch_norm=True: each stage commits a mini-batch's own running statistics at its
update of that mini-batch, even where the asynchronous stream already ran forwards of the next one."""

from __future__ import annotations

import os

import pytest
import torch
from _fit_resume import whole_and_resumed
from fp_tolerance import assert_close_reordered
from torch import Tensor, nn

from fastpipe import DeferredBatchNorm, Pipe
from fastpipe.runtime.worker import is_recomputing


def model(seed: int = 3) -> nn.Sequential:
    # A BatchNorm in every stage of [3, 3, 3] (and of [3, 6]); one with a cumulative average (momentum None).
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.BatchNorm1d(16),
        nn.Tanh(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, momentum=0.3),
        nn.GELU(),
        nn.Linear(16, 16),
        nn.BatchNorm1d(16, momentum=None),
        nn.Linear(16, 4),
    )


def data(n: int, batch: int = 14) -> list[tuple[Tensor, Tensor]]:
    # Each mini-batch with its own scale and shift: statistics mixed across mini-batches show.
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(batch, 8, generator=g) * (1 + j) + 2 * j, torch.randn(batch, 4, generator=g)) for j in range(n)
    ]


def norms(pipe: Pipe) -> dict[int, DeferredBatchNorm]:
    return {i: pipe[i] for i in range(len(pipe)) if isinstance(pipe[i], DeferredBatchNorm)}  # type: ignore[misc]


def assert_stats_equal(pipe: Pipe, ref: Pipe) -> None:
    got, want = pipe.state_dict(), ref.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("balance", [[3, 6], [3, 3, 3]])
def test_sync_equals_train_step_then_step(balance: list[int], checkpoint: str) -> None:
    batches = data(5)  # 14 rows in 4 chunks: uneven micro-batches (4, 4, 4, 2)
    ref = Pipe(model(), balance=balance, chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    expected = []
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        expected.append(ref.train_step(x, y, nn.MSELoss()))
        opt.step()
    pipe = Pipe(model(), balance=balance, chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    opt2 = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = list(pipe.fit(batches, nn.MSELoss(), opt2, consistency="sync", window=2))
    assert all(torch.equal(a, b) for a, b in zip(losses, expected))
    assert_stats_equal(pipe, ref)  # parameters and running statistics, bit for bit
    assert all(int(bn.num_batches_tracked) == len(batches) for bn in norms(pipe).values())  # type: ignore[arg-type]


def _fold(inputs: list[Tensor], momentum: float | None, minibatches: int, m: int) -> dict[str, Tensor]:
    """Running statistics from committing each mini-batch's ``m`` recorded inputs in order (fp64)."""
    assert len(inputs) == minibatches * m
    mean = torch.zeros(inputs[0].size(1), dtype=torch.float64)
    var = torch.ones_like(mean)
    for n in range(minibatches):
        x = torch.cat(inputs[n * m : (n + 1) * m]).double()
        f = momentum if momentum is not None else 1 / (n + 1)
        mean = (1 - f) * mean + f * x.mean(0)
        var = (1 - f) * var + f * x.var(0, correction=1)
    return {"running_mean": mean, "running_var": var}


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("consistency", ["stale", "predict"])
@pytest.mark.parametrize("balance", [[3, 6], [3, 3, 3]])
def test_async_commits_each_mini_batch_alone(balance: list[int], consistency: str, checkpoint: str) -> None:
    # K stages, M=2: stage s runs forwards of mini-batch n+1 before its update of n (e.g. K=2:
    # w0: F0 F1 BW0 F2 BW1 U0 ...). What each BatchNorm saw is recorded per forward (not per
    # recompute); a stage runs its forwards in micro-batch order, so the k-th is micro-batch k.
    m, minibatches = 2, 6
    batches = data(minibatches, batch=12)
    pipe = Pipe(model(), balance=balance, chunks=m, checkpoint=checkpoint, deferred_batch_norm=True)
    seen: dict[int, list[Tensor]] = {i: [] for i in norms(pipe)}
    for i, bn in norms(pipe).items():
        bn.register_forward_pre_hook(
            lambda mod, args, i=i: None if is_recomputing() else seen[i].append(args[0].detach().clone())
        )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    losses = list(pipe.fit(batches, nn.MSELoss(), opt, consistency=consistency, window=3))
    assert len(losses) == minibatches and all(torch.isfinite(v) for v in losses)
    for i, bn in norms(pipe).items():
        want = _fold(seen[i], bn.momentum, minibatches, m)
        for name in ("running_mean", "running_var"):
            # fp32 per micro-batch statistics (6 rows) and one fp32 update per mini-batch, against fp64.
            assert_close_reordered(
                getattr(bn, name),
                want[name].float(),
                k=6 + 2 * minibatches,
                dtype=torch.float32,
                msg=f"layer {i} {name}",
            )
        assert int(bn.num_batches_tracked) == minibatches  # type: ignore[arg-type]
        assert bn._pending == {}  # nothing left over for a later step to commit


def test_a_failed_window_leaves_no_statistics_behind() -> None:
    pipe = Pipe(model(), balance=[3, 6], chunks=2, deferred_batch_norm=True)
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05, momentum=0.9)
    calls = []

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        calls.append(1)
        if len(calls) == 2:  # mini-batch 0's second micro-batch: no update has run yet
            raise RuntimeError("bad loss")
        return nn.functional.mse_loss(out, y)

    with pytest.raises(RuntimeError, match="bad loss"):
        list(pipe.fit(data(3), loss_fn, opt, consistency="predict", window=3))
    assert all(bn._pending == {} for bn in norms(pipe).values())
    for k, v in pipe.state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("consistency", ["predict", "stash"])
def test_mid_stream_save_and_resume(consistency: str, tmp_path: os.PathLike) -> None:
    def fresh() -> tuple[Pipe, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
        pipe = Pipe(model(), balance=[3, 3, 3], chunks=2, deferred_batch_norm=True)
        opt = torch.optim.Adam(pipe.parameters(), lr=2e-2)
        return pipe, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)

    whole, whole_pipe, resumed, pipe = whole_and_resumed(fresh, data(8), consistency, tmp_path)
    assert resumed == whole
    assert_stats_equal(pipe, whole_pipe)  # running statistics included: every mini-batch's committed
    assert any(k.endswith("running_mean") for k in pipe.state_dict())


@pytest.mark.gpu
@pytest.mark.parametrize("consistency", ["sync", "predict"])
def test_fit_on_cuda_stages(consistency: str) -> None:
    # Two stages on one GPU, each in its own worker thread: statistics accumulate and commit on the device.
    batches = [(x.cuda(), y.cuda()) for x, y in data(4)]
    ref = Pipe(model(), balance=[3, 6], devices=["cuda:0", "cuda:0"], chunks=2, deferred_batch_norm=True)
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, y in batches:
        opt.zero_grad(set_to_none=True)
        ref.train_step(x, y, nn.MSELoss())
        opt.step()
    pipe = Pipe(model(), balance=[3, 6], devices=["cuda:0", "cuda:0"], chunks=2, deferred_batch_norm=True)
    opt2 = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    losses = [loss.item() for loss in pipe.fit(batches, nn.MSELoss(), opt2, consistency=consistency, window=2)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert all(int(bn.num_batches_tracked) == len(batches) for bn in norms(pipe).values())  # type: ignore[arg-type]
    assert all(bn._pending == {} for bn in norms(pipe).values())
    if consistency == "sync":
        # Same kernels, same order: equal up to the GEMM's possible run-to-run reordering on the device.
        want = ref.state_dict()
        for k, v in pipe.state_dict().items():
            torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)
