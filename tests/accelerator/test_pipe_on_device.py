"""Pipe trains on an accelerator as on the CPU: every entry point, on the emulated device.

train_step, fit, DeferredBatchNorm and a torch.utils.checkpoint inside a stage, with stages
on the emulated device (tests/emulated_device.py) and on the CPU, compared with the plain
model on the CPU. The emulated device runs autograd's device-thread routing for real, and
refuses a mix of devices in one op as a GPU does, so a tensor left on the wrong device fails
here. (``Pipe.forward`` + backward in every placement and checkpoint mode is in
tests/runtime/test_device_thread.py.)
"""

import copy

import emulated_device
import pytest
import torch
import torch.utils.checkpoint
from _seeded_reference import seeded_forward, step_seed_after
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe

CPU = torch.device("cpu")
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]
# Reductions from input to loss (widths, the loss's mean) plus the rows a weight gradient sums.
K = 8 + 16 + 16 + 16 + 8 + 8 * 16 + 16


def model(seed=3, p=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(),
        nn.LayerNorm(16),
        nn.Linear(16, 16),
        nn.Dropout(p),
        nn.Tanh(),
        nn.Linear(16, 8),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
    )


def placed(placement, emu):
    return [emu if p == "emu" else CPU for p in placement.split(",")]


def assert_grads_close(pipe, ref, k=K):
    for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert p.grad.device == p.device, n
        assert_close_reordered(p.grad.cpu(), q.grad, k=k, msg=n)


@pytest.mark.parametrize("placement", ["emu,emu,emu,emu", "cpu,emu,emu,cpu", "emu,cpu,cpu,emu"])
@pytest.mark.parametrize("name, virtual", SCHEDULES)
def test_train_step_matches_plain(name, virtual, placement, emu):
    x, y = torch.randn(13, 8), torch.randn(13, 8)  # 13 in 4 chunks: 4, 4, 4, 1
    ref = model()
    loss_ref = nn.MSELoss()(ref(x), y)
    loss_ref.backward()
    devices = placed(placement, emu)
    balance = [2, 2, 2, 2]
    if virtual > 1:  # 8 stages on 2 workers: stage s on worker s % 2, each worker on one device
        devices, balance = [devices[s % 2] for s in range(8)], [1] * 8
    pipe = Pipe(model(), balance=balance, devices=devices, chunks=4, checkpoint="except_last")
    # A CPU batch: train_step moves the input to the first stage and the targets to the last.
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=name, virtual_stages=virtual)
    assert_close_reordered(loss.cpu(), loss_ref.detach(), k=K)
    assert_grads_close(pipe, ref)


def test_fit_sync_matches_plain_training(emu):
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)) for _ in range(3)]
    ref = model()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in batches:
        opt_ref.zero_grad(set_to_none=True)
        loss = nn.MSELoss()(ref(x), y)
        loss.backward()
        opt_ref.step()
        expected.append(loss.detach())
    devices = [emu, CPU, emu]
    pipe = Pipe(model(), balance=[3, 3, 2], devices=devices, chunks=3)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    # CPU batches, as a DataLoader gives them: fit moves the inputs to the first stage and the
    # targets to the last.
    losses = list(pipe.fit(batches, nn.MSELoss(), opt, consistency="sync", window=2))
    for got, want in zip(losses, expected):
        assert_close_reordered(got.cpu(), want, k=K)
    for (n, p), q in zip(pipe.named_parameters(), ref.parameters()):
        # Three steps of SGD with momentum: the rounding of each step's gradient carries on.
        assert_close_reordered(p.detach().cpu(), q.detach(), k=3 * K, msg=n)


def bn_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.BatchNorm2d(4, momentum=0.3),
        nn.Flatten(),
        nn.Linear(100, 6),
        nn.Tanh(),
    )


@pytest.mark.parametrize("placement", ["emu,emu", "cpu,emu", "emu,cpu"])
def test_deferred_batch_norm_gives_the_full_batch_statistics(placement, emu):
    ref = bn_model()
    pipe = Pipe(bn_model(), balance=[3, 3], devices=placed(placement, emu), chunks=4, deferred_batch_norm=True)
    for step in range(2):
        x = torch.randn(16, 3, 5, 5) * (step + 1) + step
        emulated_device.backward(pipe(x).sum())
        ref(x)
    state = pipe.state_dict()
    for key, value in ref.state_dict().items():
        if "running" in key or "num_batches" in key:
            # Per-channel sums over 16 x 5 x 5 values, per micro-batch then added, against one pass.
            assert_close_reordered(state[key].cpu(), value, k=16 * 25 + 27, msg=key)


class Checkpointed(nn.Module):
    """``inner`` under the model's own torch.utils.checkpoint: recomputed inside the backward."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def checkpointed_model():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(8, 16),
        Checkpointed(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.GELU())),
        nn.Linear(16, 16),
        Checkpointed(nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.3), nn.Tanh())),
        nn.Linear(16, 4),
    )


@pytest.mark.parametrize("checkpoint", ["always", "never"])
@pytest.mark.parametrize("placement", ["emu,emu", "cpu,emu", "emu,cpu"])
def test_torch_checkpoint_inside_a_stage_replays_its_dropout(placement, checkpoint, emu):
    # The inner recompute runs in the stage's backward, on the device thread for the stages
    # on the node's device: it must draw the forward's dropout masks again.
    x = torch.randn(12, 8)
    pipe = Pipe(checkpointed_model(), balance=[2, 3], devices=placed(placement, emu), chunks=3, checkpoint=checkpoint)
    torch.manual_seed(11)
    xp = x.clone().requires_grad_()
    out = pipe(xp)
    emulated_device.backward(out.sum())
    # The plain model, run micro-batch by micro-batch with each task's seeds.
    ref = checkpointed_model()
    xr = x.clone().requires_grad_()
    outs = seeded_forward(ref, [2, 3], xr, 3, step_seed_after(11))
    torch.cat(outs).sum().backward()
    assert_close_reordered(out.detach().cpu(), torch.cat(outs).detach(), k=64)
    assert_close_reordered(xp.grad, xr.grad, k=64)
    assert_grads_close(pipe, ref, k=64)


def test_a_batch_from_the_cpu_feeds_a_device_pipe_and_gets_its_gradient_there(emu):
    ref = model()
    net = copy.deepcopy(ref)
    x = torch.randn(8, 8, requires_grad=True)
    pipe = Pipe(net, balance=[4, 4], devices=[emu, emu], chunks=2)
    out = pipe(x)
    assert out.device == emu
    emulated_device.backward(out.sum())
    xr = x.detach().clone().requires_grad_()
    ref(xr).sum().backward()
    assert x.grad.device == CPU
    assert_close_reordered(x.grad, xr.grad, k=K)
    assert_grads_close(pipe, ref)
