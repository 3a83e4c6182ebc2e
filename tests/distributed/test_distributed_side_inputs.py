"""Side inputs on DistributedPipe: every rank passes them and splits its own copy, as one process would.

The property is the plain model's result: ``train_step(x, y, loss_fn, mask=m)`` on 2 gloo
ranks equals ``loss_fn(fastpipe.Sequential(...)(x, mask=m), y)``; a mistake in a call gets a
clear error on every rank instead of a hang.
"""

from __future__ import annotations

import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe

K = 32  # reductions on the path to a gradient: 6 layers of width 5, 8 rows


class Masked(nn.Module):
    """Takes a per-sample mask."""

    fastpipe_side_inputs = ("mask",)

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x, mask=None):
        out = torch.tanh(self.linear(x))
        return out if mask is None else out * mask


class Rotated(nn.Module):
    """Takes a (cos, sin) pair and a table shared by every sample."""

    fastpipe_side_inputs = ("rope", "table")

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)

    def forward(self, x, rope=None, table=None):
        cos, sin = rope
        return self.linear(x) * cos + sin + table


def model() -> fastpipe.Sequential:
    """With balance [4, 2], rank 0's layers take only ``mask`` and rank 1's only ``rope`` and ``table``."""
    torch.manual_seed(0)
    return fastpipe.Sequential(Masked(), nn.Linear(5, 5), Masked(), nn.Tanh(), Rotated(), nn.Linear(5, 5))


def side() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "mask": (torch.rand(8, 5, generator=g) > 0.3).float(),  # split with the batch
        "table": torch.randn(1, 5, generator=g),  # dim 0 of 1: whole to every micro-batch
        "rope": (torch.randn(8, 5, generator=g), fastpipe.broadcast(torch.randn(5, generator=g))),
    }


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 5, generator=g), torch.randn(8, 5, generator=g)


def _run(rank: int, world: int) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    x, y = data()
    out: dict = {}
    for name, balance in [("1f1b", [4, 2]), ("zb-h1", [4, 2]), ("interleaved", [2, 2, 1, 1])]:
        pipe = DistributedPipe(model(), balance, chunks=4, schedule=name, timeout=20)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss(), **side())
        out[name] = {"loss": loss, "grads": {n: p.grad for n, p in pipe.named_parameters()}}
        pipe.close()
    for case, kw in {
        "name": {**side(), "masks": torch.ones(8, 5)},
        "shape": {**side(), "mask": torch.ones(3, 5)},
    }.items():
        pipe = DistributedPipe(model(), [4, 2], chunks=4, timeout=20)
        try:
            pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss(), **kw)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[case] = (type(exc).__name__, str(exc))
        pipe.close()
    return out


def test_side_inputs_on_two_ranks_equal_the_plain_model_and_mistakes_fail_every_rank() -> None:
    first, last = check_ok(run_ranks(_run, 2, timeout=90))
    ref = model()
    x, y = data()
    loss_ref = nn.MSELoss()(ref(x, **side()), y)
    loss_ref.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for name in ("1f1b", "zb-h1", "interleaved"):
        assert first[name]["grads"].keys() | last[name]["grads"].keys() == grads.keys()
        for rank in (first, last):
            assert_close_reordered(rank[name]["loss"], loss_ref.detach(), k=K, msg=name)
            for n, g in rank[name]["grads"].items():
                assert_close_reordered(g, grads[n], k=K, msg=f"{name}: {n}")
    # Rank 0's layers take only "mask", yet it knows the names of the whole model's.
    for rank in (first, last):
        kind, message = rank["name"]
        assert kind == "TypeError" and "side input(s) 'masks'" in message
        assert "(the layers take: 'mask', 'rope', 'table')" in message
    kind, message = first["shape"]
    assert kind == "ValueError" and "'mask' has shape (3, 5)" in message and "batch size (8" in message
    kind, message = last["shape"]  # the rank that split its copy first failed the step for all
    assert kind == "PipelineError" and "rank 0 (stage 0) raised ValueError" in message and "'mask'" in message
