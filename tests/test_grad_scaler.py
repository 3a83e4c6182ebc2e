"""Mixed precision as users run it: ``torch.amp.GradScaler`` around a Pipe.

Two ways in: ``scaler.scale(loss_fn(pipe(x), y)).backward()`` through ``Pipe.forward``, and
``pipe.train_step(x, y, loss_fn, scaler=scaler)``. Either way the scaler must see what it sees
for the plain model: the same scale updates, a step skipped (parameters untouched) when the
gradients are not finite, and the same updated parameters when they are.
"""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe


def make_model():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def plain_backward(model, x, y, scaler):
    scaler.scale(nn.MSELoss()(model(x), y)).backward()


def pipe_forward_backward(pipe, x, y, scaler):
    scaler.scale(nn.MSELoss()(pipe(x), y)).backward()


def pipe_train_step(pipe, x, y, scaler):
    loss = pipe.train_step(x, y, nn.MSELoss(), scaler=scaler)
    # The returned loss is the unscaled one, finite exactly when the batch is.
    assert bool(loss.isfinite()) == bool(torch.isfinite(x).all() and torch.isfinite(y).all())


def scaled_step(model, run, x, y, scaler, opt):
    opt.zero_grad()
    run(model, x, y, scaler)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("run", [pipe_forward_backward, pipe_train_step], ids=["forward", "train_step"])
def test_grad_scaler_skips_and_steps_like_the_plain_model(run):
    model = make_model()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 3], chunks=3)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, pipe)]
    x, y = torch.randn(9, 4), torch.randn(9, 2)
    x_inf = x.clone()
    x_inf[4, 1] = float("inf")
    y_nan = y.clone()
    y_nan[7, 0] = float("nan")
    for step, (xs, ys) in enumerate([(x, y), (x_inf, y), (x, y), (x, y_nan), (x, y)]):
        finite = bool(torch.isfinite(xs).all() and torch.isfinite(ys).all())
        before = [p.detach().clone() for p in pipe.parameters()]
        scaled_step(ref, plain_backward, xs, ys, scalers[0], opts[0])
        scaled_step(pipe, run, xs, ys, scalers[1], opts[1])
        # Growth after a finite step, back-off after a skipped one: the same scale as the plain model.
        assert scalers[1].get_scale() == scalers[0].get_scale(), step
        if finite:
            for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
                assert_close_reordered(p, q, k=8 + 8 + 9, msg=f"step {step}")
        else:
            assert all(torch.equal(p, b) for p, b in zip(pipe.parameters(), before)), f"step {step} not skipped"


def test_train_step_scales_the_backward_not_the_returned_loss():
    pipe = Pipe(make_model(), balance=[2, 3], chunks=2)
    ref = copy.deepcopy(pipe)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    loss = pipe.train_step(x, y, nn.MSELoss(), scaler=scaler)
    loss_ref = ref.train_step(x, y, nn.MSELoss())
    assert torch.equal(loss, loss_ref)
    for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
        # A power-of-two scale multiplies every gradient exactly.
        assert torch.equal(p.grad, q.grad * 2.0**10)


def test_disabled_scaler_changes_nothing():
    pipe = Pipe(make_model(), balance=[2, 3], chunks=2)
    ref = copy.deepcopy(pipe)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    pipe.train_step(x, y, nn.MSELoss(), scaler=torch.amp.GradScaler("cpu", enabled=False))
    ref.train_step(x, y, nn.MSELoss())
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(pipe.parameters(), ref.parameters()))
