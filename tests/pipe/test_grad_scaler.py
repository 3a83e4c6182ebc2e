"""Mixed precision as users run it: ``torch.amp.GradScaler`` around a Pipe.

Two ways in: ``scaler.scale(loss_fn(pipe(x), y)).backward()`` through ``Pipe.forward``, and
``pipe.train_step(x, y, loss_fn, scaler=scaler)``. Either way the scaler must see what it sees
for the plain model: the same scale updates, a step skipped (parameters untouched) when the
gradients are not finite, and the same updated parameters when they are.
"""

import copy

import pytest
import torch
from _dist_utils import check_ok, run_ranks
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


# -- DistributedPipe: ranks skip together ------------------------------------------------


class _Overflow(torch.autograd.Function):
    """x * w whose weight gradient is inf when ``flag[0]`` is set (the input gradient stays finite)."""

    @staticmethod
    def forward(ctx, x, w, flag):
        ctx.save_for_backward(x, w)
        ctx.flag = flag
        return x * w

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        gw = (grad * x).sum(0)
        return grad * w, gw + float("inf") if ctx.flag[0] else gw, None


class Overflowing(nn.Module):
    def __init__(self, flag):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.flag = flag

    def forward(self, x):
        return _Overflow.apply(x, self.weight, self.flag)


def _steps():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 4, generator=g), torch.randn(9, 2, generator=g)
    x_inf = x.clone()
    x_inf[4, 1] = float("inf")
    y_nan = y.clone()
    y_nan[7, 0] = float("nan")
    return [(x, y), (x_inf, y), (x, y), (x, y_nan), (x, y)]


def _scaled_ranks(rank, world, sharded):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fastpipe import DistributedPipe

    torch.manual_seed(0)
    flag = [False]
    pipe = DistributedPipe(nn.Sequential(Overflowing(flag), *make_model()), [3, 3], chunks=3)
    kind = ShardedGradScaler if sharded else torch.amp.GradScaler
    scaler = kind("cpu", init_scale=2.0**12, growth_interval=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    out = {"losses": [], "scales": [], "states": []}
    for step, (x, y) in enumerate(_steps() + _steps()[:1]):
        flag[0] = step == 5  # only stage 0's (rank 0's) gradient overflows, in the last step
        opt.zero_grad()
        try:
            loss = pipe.train_step(
                x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss(), scaler=scaler
            )
        except TypeError as exc:
            return {"refused": str(exc)}
        scaler.step(opt)
        scaler.update()
        out["losses"].append(loss.item())
        out["scales"].append(scaler.get_scale())
        out["states"].append({k: v.clone() for k, v in pipe.state_dict().items()})
    pipe.close()
    return out


def test_distributed_scaler_steps_and_skips_like_one_process():
    outcomes = check_ok(run_ranks(_scaled_ranks, 2, True, timeout=90))
    torch.manual_seed(0)
    flag = [False]
    pipe = Pipe(nn.Sequential(Overflowing(flag), *make_model()), balance=[3, 3], chunks=3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step, (x, y) in enumerate(_steps() + _steps()[:1]):
        flag[0] = step == 5
        opt.zero_grad()
        loss = pipe.train_step(x, y, nn.MSELoss(), scaler=scaler)
        scaler.step(opt)
        scaler.update()
        state = pipe.state_dict()
        # The ranks run one thread each, this process as many as the user's: other GEMM kernels, so
        # equal up to rounding (three Linears of 4 and 8 inputs, the loss's mean over 9 x 2, 9 rows).
        k = 4 + 8 + 8 + 9 * 2 + 9
        for rank, outcome in enumerate(outcomes):
            assert outcome["scales"][step] == scaler.get_scale(), (rank, step)
            got = torch.tensor(outcome["losses"][step])
            if loss.isnan():
                assert got.isnan(), (rank, step)
            else:
                assert_close_reordered(got, loss.detach(), k=k, msg=f"rank {rank}, step {step}: loss")
            for name, v in outcome["states"][step].items():
                assert_close_reordered(v, state[name], k=k, msg=f"rank {rank}, step {step}: {name}")
    # Step 5 overflowed on rank 0 only; rank 1's stage was not stepped either.
    assert all(torch.equal(outcomes[1]["states"][5][k], v) for k, v in outcomes[1]["states"][4].items())
    assert outcomes[1]["scales"][5] == outcomes[1]["scales"][4] / 2


def test_distributed_pipe_refuses_a_scaler_per_rank():
    outcomes = check_ok(run_ranks(_scaled_ranks, 2, False, timeout=90))
    for outcome in outcomes:
        assert "ShardedGradScaler" in outcome["refused"], outcome


def _scale_one(rank, world):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fastpipe import DistributedPipe

    torch.manual_seed(0)
    pipe = DistributedPipe(make_model(), [2, 3], chunks=3)  # on_nan="raise" by default
    scaler = ShardedGradScaler("cpu", init_scale=1.0)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    x, y = _steps()[1]  # an inf input: a non-finite loss
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss(), scaler=scaler)
    scaler.step(opt)
    scaler.update()
    pipe.close()
    return {"finite": bool(torch.isfinite(loss)), "scale": scaler.get_scale()}


def test_a_scale_of_one_is_still_the_scalers_to_skip():
    # A scaler whose scale backed off to 1.0 is still in charge of non-finite steps (not on_nan).
    for outcome in check_ok(run_ranks(_scale_one, 2, timeout=60)):
        assert outcome == {"finite": False, "scale": 0.5}
