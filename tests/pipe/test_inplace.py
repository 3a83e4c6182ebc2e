"""Layers that write into their input work at stage boundaries, also under recompute."""

import copy

import pytest
import torch
from torch import nn

from fastpipe import Pipe


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_inplace_first_layer_of_a_stage(checkpoint):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Sequential(nn.ReLU(inplace=True)))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 2, 1], chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    out, out_ref = pipe(x), ref(x)
    torch.testing.assert_close(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[1, 2], [2, 1]])
def test_inplace_first_layer_of_the_model(checkpoint, balance):
    # Stage 0's micro-batches are views of the caller's batch and share its version counter:
    # an in-place first layer would corrupt what another micro-batch saved, or the caller's x.
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 4))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=balance, chunks=2, checkpoint=checkpoint)
    x = torch.randn(6, 4)
    before = x.clone()
    xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, out_ref = pipe(xp), ref(xr.clone())
    torch.testing.assert_close(out, out_ref)
    out.sum().backward()
    out_ref.sum().backward()
    torch.testing.assert_close(xp.grad, xr.grad)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    pipe(x)  # without grad on the input: the caller's tensor is left as it was
    assert torch.equal(x, before)
