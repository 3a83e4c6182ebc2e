"""Stage hand-offs through the copy runtime (fastpipe._C) keep outputs and gradients exact.

Between different devices every hand-off goes through ``start_transfer``. On a CPU-only
host there is no second device, so these tests route same-device hand-offs through the
runtime's host backend too (``copy_same_device``).
"""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe


def copying_pipe(model, **kwargs):
    pipe = Pipe(model, **kwargs)
    pipe.runtime.copy_same_device = True
    return pipe


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_forward_backward_through_copies(checkpoint):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    ref = copy.deepcopy(model)
    pipe = copying_pipe(model, balance=[2, 2, 1], chunks=3, checkpoint=checkpoint)
    x = torch.randn(9, 6, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    # The plain model on the same 3-row micro-batches, each in a fresh buffer as the copy
    # hands it over, does the same arithmetic, bit for bit. The full 9-row batch would run
    # other GEMM shapes, and a view 3 rows into x another data alignment: either can pick
    # another BLAS kernel, on some CPUs, with other rounding.
    out, out_ref = pipe(x), torch.cat([ref(c.clone()) for c in xr.chunk(3)])
    assert torch.equal(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    assert torch.equal(x.grad, xr.grad)
    # Weight gradients add the micro-batches' shares in another order than autograd does.
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=9 + 6 + 16 + 16)


def test_integer_and_tuple_values_cross_through_copies():
    class Pair(nn.Module):
        def forward(self, ids):
            return ids, ids.float()

    class Use(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, pair):
            ids, f = pair
            return self.emb(ids).sum(1) + f.sum(1, keepdim=True)

    model = nn.Sequential(Pair(), Use())
    ref = copy.deepcopy(model)
    pipe = copying_pipe(model, balance=[1, 1], chunks=2)
    ids = torch.randint(0, 10, (6, 3))
    torch.testing.assert_close(pipe(ids), ref(ids))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_train_step_through_copies(schedule):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    nn.functional.mse_loss(ref(x), y).backward()
    pipe = copying_pipe(model, balance=[1, 1, 1, 1], chunks=4)
    pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
