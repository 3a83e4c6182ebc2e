"""The caller's autocast, grad mode and default dtype reach every stage worker."""

import pytest
import torch
from torch import nn

from fastpipe import Pipe


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_default_dtype()))
        return x


def test_autocast_reaches_workers():
    probe = Probe()
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), probe, nn.Linear(8, 8)), balance=[1, 2], chunks=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(torch.randn(4, 8))
    assert out.dtype == torch.bfloat16
    assert all(autocast for _, autocast, _ in probe.seen)
    probe.seen.clear()
    assert pipe(torch.randn(4, 8)).dtype == torch.float32
    assert not any(autocast for _, autocast, _ in probe.seen)


def test_no_grad_reaches_workers():
    probe = Probe()
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), probe), balance=[1, 1], chunks=2, checkpoint="never")
    with torch.no_grad():
        pipe(torch.randn(4, 8))
    assert not any(grad for grad, _, _ in probe.seen)


def test_default_dtype_reaches_workers():
    probe = Probe()
    pipe = Pipe(nn.Sequential(nn.Identity(), probe), balance=[1, 1], chunks=2)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        pipe(torch.randn(4, 8))
    finally:
        torch.set_default_dtype(before)
    assert all(dtype == torch.float64 for _, _, dtype in probe.seen)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_autocast_grads_match_plain(checkpoint):
    import copy

    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 2], chunks=2, checkpoint=checkpoint)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, out_ref = pipe(x), ref(x)
    torch.testing.assert_close(out, out_ref)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-2)
