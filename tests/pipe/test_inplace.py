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
