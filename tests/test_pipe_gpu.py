"""Pipe on CUDA: stages sharing one GPU, and stages split between CPU and GPU."""

import copy

import pytest
import torch
from torch import nn

from fastpipe import Pipe

pytestmark = pytest.mark.gpu


def model(p=0.1):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(p), nn.Linear(64, 64), nn.LayerNorm(64),
                         nn.Linear(64, 8))


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_transparency_on_gpu(devices, checkpoint):
    net = model(p=0.0)  # training mode, so checkpointed stages really recompute on the GPU
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(net, balance=[3, 3], devices=devices, chunks=4, checkpoint=checkpoint)
    x = torch.randn(16, 32)
    out = pipe(x.to(devices[0]))
    assert out.device == torch.device(devices[-1])
    out_ref = ref(x.cuda())
    torch.testing.assert_close(out.cuda(), out_ref, rtol=1e-4, atol=1e-5)
    out.float().square().sum().backward()
    out_ref.square().sum().backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cuda(), q.grad, rtol=1e-3, atol=1e-4)


def test_dropout_reproducible_on_gpu():
    def run(checkpoint):
        pipe = Pipe(model(), balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(5)
        out = pipe(torch.randn(16, 32, device="cuda"))
        out.sum().backward()
        return out.detach(), [p.grad.clone() for p in pipe.parameters()]

    a, b = run("never"), run("always")
    assert torch.equal(a[0], b[0])
    for x, y in zip(a[1], b[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_train_step_on_gpu(schedule):
    net = model(p=0.0)
    ref = copy.deepcopy(net).cuda()
    pipe = Pipe(net, balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=4)
    x, y = torch.randn(16, 32, device="cuda"), torch.randn(16, 8, device="cuda")
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)
    loss_ref = nn.functional.mse_loss(ref(x), y)
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-4, atol=1e-5)
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-4)


def test_autocast_on_gpu():
    pipe = Pipe(model(), balance=[3, 3], devices=["cuda:0", "cuda:0"], chunks=2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(torch.randn(8, 32, device="cuda"))
    assert out.dtype == torch.bfloat16
