"""``fit`` with side inputs: batches of ``(input, target, side_inputs)`` train as ``train_step(..., **side)`` does.

The property is the plain model's: ``fit(consistency="sync")`` over mini-batches that carry a
mask and a shared table equals SGD on ``loss_fn(fastpipe.Sequential(...)(x, **side), y)``, and a
DistributedPipe on 2 gloo ranks yields the local pipe's losses and weights bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe

K = 48  # reductions on the path to a weight: 4 layers of width 5, 8 rows, 3 SGD steps


class Masked(nn.Module):
    fastpipe_side_inputs = ("mask", "table")

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x, mask=None, table=None):
        out = torch.tanh(self.linear(x))
        out = out if mask is None else out * mask
        return out if table is None else out + table


def model() -> fastpipe.Sequential:
    torch.manual_seed(0)
    return fastpipe.Sequential(Masked(), nn.Linear(5, 5), Masked(), nn.Linear(5, 5))


def batches(n: int = 3) -> list[tuple]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)
        side = {"mask": (torch.rand(8, 5, generator=g) > 0.3).float(), "table": torch.randn(1, 5, generator=g)}
        out.append((x, y, side))
    return out


def test_sync_fit_with_side_inputs_equals_the_plain_model() -> None:
    pipe = fastpipe.Pipe(model(), [2, 2], chunks=4)
    plain = model()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    losses = list(pipe.fit(batches(), nn.MSELoss(), opt, consistency="sync", window=2))
    for (x, y, side), loss in zip(batches(), losses):
        ref_opt.zero_grad()
        ref = nn.MSELoss()(plain(x, **side), y)
        ref.backward()
        ref_opt.step()
        assert_close_reordered(loss, ref.detach(), k=K)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert_close_reordered(p.detach(), q.detach(), k=K, msg=name)


def _fit(data: list) -> list[torch.Tensor]:
    pipe = fastpipe.Pipe(model(), [2, 2], chunks=2)
    return list(pipe.fit(data, nn.MSELoss(), torch.optim.Adam(pipe.parameters(), lr=1e-2), window=3))


def test_the_side_inputs_reach_the_layers_under_prediction() -> None:
    with_side = _fit(batches())
    plain = _fit([(x, y) for x, y, _ in batches()])
    x, y, side = batches()[0]  # the first mini-batch runs on the initial weights
    assert_close_reordered(with_side[0], nn.MSELoss()(model()(x, **side), y).detach(), k=K)
    assert not torch.allclose(with_side[0], plain[0])


def test_bad_side_inputs_in_a_batch_are_refused() -> None:
    pipe = fastpipe.Pipe(model(), [2, 2], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y, side = batches()[0]
    with pytest.raises(TypeError, match="side inputs by name"):
        next(iter(pipe.fit([(x, y, [side["mask"]])], nn.MSELoss(), opt, consistency="stale")))
    with pytest.raises(
        TypeError, match="the side input\\(s\\) 'attention_mask' \\(the layers take: 'mask', 'table'\\)"
    ):
        next(iter(pipe.fit([(x, y, {"attention_mask": side["mask"]})], nn.MSELoss(), opt, consistency="stale")))
    with pytest.raises(TypeError, match="of 4 items"):
        next(iter(pipe.fit([(x, y, side, 1)], nn.MSELoss(), opt, consistency="stale")))


def _distributed(rank: int, world: int) -> list[str]:
    from fastpipe.distributed_pipe import DistributedPipe

    problems = []
    for consistency in ("sync", "predict"):
        pipe = DistributedPipe(model(), [2, 2], chunks=2, timeout=20)
        local = fastpipe.Pipe(model(), [2, 2], chunks=2)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        local_opt = torch.optim.Adam(local.parameters(), lr=1e-2)
        got = list(pipe.fit(batches(4), nn.MSELoss(), opt, consistency=consistency, window=2))
        want = list(local.fit(batches(4), nn.MSELoss(), local_opt, consistency=consistency, window=2))
        if not all(torch.equal(a, b) for a, b in zip(got, want)) or len(got) != 4:
            problems.append(f"{consistency}: losses {got} != local {want}")
        ref = dict(local.named_parameters())
        problems += [f"{consistency}: {n}" for n, p in pipe.named_parameters() if not torch.equal(p, ref[n])]
        pipe.close()
    return problems


def test_distributed_fit_with_side_inputs_equals_the_local_pipe() -> None:
    for rank, problems in enumerate(check_ok(run_ranks(_distributed, 2, timeout=120))):
        assert problems == [], f"rank {rank}: {problems}"
