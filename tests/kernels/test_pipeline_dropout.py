"""Fused dropout inside a Pipe: recomputation replays the mask (reference path and Triton)."""

import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.kernels import Dropout, MLPBlock


def test_fused_kernel_dropout_is_replayed_by_recompute():
    # fastpipe.kernels.dropout draws its seed with torch.randint, which the task RNG serves:
    # a recompute regenerates the same mask from the same seed.
    def run(checkpoint):
        torch.manual_seed(1)
        model = nn.Sequential(nn.Linear(16, 16), Dropout(0.5), nn.Linear(16, 16), Dropout(0.3))
        pipe = Pipe(model, balance=[2, 2], chunks=3, checkpoint=checkpoint)
        torch.manual_seed(2)
        out = pipe(torch.randn(9, 16))
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in pipe.parameters()]

    a, b = run("never"), run("always")
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


def test_two_stages_interpret_concurrently():
    # Two stage threads run kernels at once; under TRITON_INTERPRET=1 they must not break
    # each other (the interpreter patches triton.language globally while a kernel runs).
    model = nn.Sequential(MLPBlock(32, 64, dropout=0.1), MLPBlock(32, 64, dropout=0.1))
    pipe = Pipe(model, balance=[1, 1], chunks=4)
    pipe(torch.randn(8, 32)).sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())
