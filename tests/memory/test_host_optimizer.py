"""HostOptimizer: the wrapped optimizer's update, with its state off the device.

On a CPU the update is the same arithmetic on the same values, so parameters are bitwise those of
the plain optimizer. The exact CPU counter books what the step allocates to the host
(``_cpu_counter.host_scope``), which is how a CPU rank stands for an accelerator: the device then
holds parameters and gradients, two times the parameters' bytes where Adam on the device holds four.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

from fastpipe import HostOptimizer, Pipe
from fastpipe.memory import _cpu_counter
from fastpipe.memory.accounting import PeakMeter
from fastpipe.memory.optimizer import optimizer_factor


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def _train(m: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    ProductLoss()(m(x), y).backward()
    opt.step()


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: (torch.optim.Adam, dict(lr=1e-2, foreach=False)),
        lambda ps: (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
        lambda ps: (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, dampening=0.1)),
    ],
    ids=["adam", "adamw-amsgrad", "sgd-momentum"],
)
def test_a_pipe_trained_with_it_equals_the_pipe_with_the_plain_optimizer_bitwise(make) -> None:
    x, y = _batch()
    loss_fn = ProductLoss()
    cls, kw = make(None)
    runs = []
    for wrapped in (False, True):
        pipe = Pipe(_model(), balance=[2, 2], chunks=4, checkpoint="never", schedule="1f1b")
        opt = HostOptimizer(cls, pipe.parameters(), **kw) if wrapped else cls(pipe.parameters(), **kw)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        for _ in range(3):
            opt.zero_grad()
            pipe.train_step(x, y, loss_fn)
            opt.step()
            sched.step()
        runs.append((_params(pipe), opt.param_groups[0]["lr"]))
    (plain, plain_lr), (host, host_lr) = runs
    assert all(torch.equal(a, b) for a, b in zip(plain, host))
    assert host_lr == plain_lr == kw["lr"] / 8
    assert not torch.equal(plain[0], _params(_model())[0])  # it trained


def test_its_state_dict_is_the_plain_optimizers_and_loads_either_way() -> None:
    x, y = _batch()
    a, b = _model(), _model()
    host = HostOptimizer(torch.optim.Adam, a.parameters(), lr=1e-2)
    plain = torch.optim.Adam(b.parameters(), lr=1e-2)
    for m, o in ((a, host), (b, plain)):
        _train(m, o, x, y)
    saved, saved_plain = host.state_dict(), plain.state_dict()
    assert saved["param_groups"] == saved_plain["param_groups"]
    assert all(
        torch.equal(saved["state"][i][k], saved_plain["state"][i][k])
        for i in saved["state"]
        for k in ("exp_avg", "exp_avg_sq")
    )
    # Swapped: each continues from the other's state, and the two stay bitwise equal.
    host.load_state_dict(saved_plain)
    plain.load_state_dict(saved)
    for m, o in ((a, host), (b, plain)):
        _train(m, o, x, y)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_parameter_changed_between_steps_is_what_the_update_starts_from() -> None:
    x, y = _batch()
    a, b = _model(), _model()
    host = HostOptimizer(torch.optim.Adam, a.parameters(), lr=1e-2)
    plain = torch.optim.Adam(b.parameters(), lr=1e-2)
    for m, o in ((a, host), (b, plain)):
        _train(m, o, x, y)
        with torch.no_grad():
            m[0].weight.mul_(0.5)  # a load or an edit between steps
        _train(m, o, x, y)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_a_parameter_without_a_gradient_is_left_as_it_is() -> None:
    x, y = _batch()
    m = _model()
    m[0].weight.requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    opt = HostOptimizer(torch.optim.Adam, [p for p in m.parameters()], lr=1e-2)
    ProductLoss()(m(x), y).backward()
    opt.step()
    assert torch.equal(m[0].weight, frozen)
    assert not torch.equal(m[3].weight, _model()[3].weight)


def test_the_device_holds_no_optimizer_state_by_the_exact_counter() -> None:
    install_counter_or_skip()
    x, y = _batch()
    params = sum(p.numel() * p.element_size() for p in _model().parameters())
    steps = 4 * len(list(_model().parameters()))  # Adam's step counter per parameter: a float32 scalar
    after: dict[str, int] = {}
    host_after: dict[str, int] = {}
    for name in ("plain", "host"):
        gc.collect()
        base, host_base = _cpu_counter.allocated(), _cpu_counter.host_allocated()
        m = _model()
        opt = (
            torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False)
            if name == "plain"
            else HostOptimizer(torch.optim.Adam, m.parameters(), lr=1e-2, foreach=False)
        )
        with PeakMeter("cpu"):
            ProductLoss()(m(x), y).backward()
            opt.step()
        after[name] = _cpu_counter.allocated() - base  # parameters, gradients, and the state if on the device
        host_after[name] = _cpu_counter.host_allocated() - host_base
        del m, opt
    assert after["plain"] == 4 * params + steps  # parameters, gradients, two moments
    assert after["host"] == 2 * params  # parameters and gradients
    assert host_after["plain"] == 0
    assert host_after["host"] == 4 * params + steps  # the copies, their gradients, two moments


def test_the_memory_model_counts_no_optimizer_state_for_it() -> None:
    m = _model()
    assert optimizer_factor(HostOptimizer(torch.optim.Adam, m.parameters())) == 0.0
    assert optimizer_factor(torch.optim.Adam(m.parameters())) == 2.0


def test_a_pipes_guard_given_it_predicts_the_counted_peak() -> None:
    install_counter_or_skip()
    x, y = torch.randn(64, 256), torch.randn(64, 8)  # the caller's: not the pipe's bytes
    gc.collect()
    base = _cpu_counter.allocated()  # whatever the process holds already (earlier tests') is not the pipe's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 8))
    pipe = Pipe(model, balance=[5], chunks=4, checkpoint="never", schedule="1f1b", memory_limit="1GiB",
                optimizer_state="host")  # fmt: skip
    opt = HostOptimizer(torch.optim.Adam, pipe.parameters(), lr=1e-3, foreach=False)
    assert pipe.memory_guard is not None
    loss_fn = ProductLoss()
    for _ in range(2):  # the first step measures the stages; the second is the one metered
        gc.collect()
        opt.zero_grad()
        with PeakMeter("cpu") as meter:
            pipe.train_step(x, y, loss_fn)
            opt.step()
    (device,) = pipe.memory_guard.last
    assert device.optimizer == 0
    counted = meter.result.peak_total - base
    assert abs(counted - device.total) <= 0.05 * device.total, (counted, device)


@pytest.mark.parametrize("consistency", ["sync", "stash", "stale", "predict"])
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_fit_with_it_equals_fit_with_the_plain_optimizer_bitwise(consistency: str, kind: str) -> None:
    """fit steps one stage at a time; the host copies of the others are neither read nor written then."""
    cls, kw = (torch.optim.Adam, dict(lr=1e-2)) if kind == "adam" else (torch.optim.SGD, dict(lr=1e-2, momentum=0.9))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(6)]
    runs = []
    for wrapped in (False, True):
        pipe = Pipe(_model(), balance=[2, 2], chunks=4, checkpoint="never")
        opt = HostOptimizer(cls, pipe.parameters(), **kw) if wrapped else cls(pipe.parameters(), **kw)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        losses = list(pipe.fit(batches, ProductLoss(), opt, consistency=consistency, scheduler=scheduler, window=3))
        runs.append(([float(v) for v in losses], _params(pipe), opt.state_dict()["state"]))
    (plain_losses, plain, plain_state), (host_losses, host, host_state) = runs
    assert plain_losses == host_losses
    assert all(torch.equal(p, q) for p, q in zip(plain, host))
    assert plain_state.keys() == host_state.keys()
    for i, s in plain_state.items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(host_state[i][k])) for k, v in s.items())


def test_fit_holds_no_optimizer_state_on_the_device() -> None:
    pipe = Pipe(_model(), balance=[2, 2], chunks=2, checkpoint="never")
    opt = HostOptimizer(torch.optim.Adam, pipe.parameters(), lr=1e-2)
    run = pipe.fit([_batch()] * 2, ProductLoss(), opt, window=1, memory_limit="1GiB")
    list(run)
    assert run.memory_guard is not None and all(d.optimizer == 0 for d in run.memory_guard.last)
    assert all(t.device.type == "cpu" and t.data_ptr() not in {p.data_ptr() for p in pipe.parameters()}
               for s in opt.state.values() for t in s.values() if t.dim())  # fmt: skip


def test_bad_input_is_refused_with_what_to_change() -> None:
    m = _model()
    with pytest.raises(ValueError, match="no parameters"):
        HostOptimizer(torch.optim.Adam, [])
    with pytest.raises(ValueError, match="twice"):
        HostOptimizer(torch.optim.Adam, [m[0].weight, m[0].weight])
    with pytest.raises(ValueError, match="leaf"):
        HostOptimizer(torch.optim.Adam, [m[0].weight * 2])
    with pytest.raises(TypeError, match="not a mix"):
        HostOptimizer(torch.optim.Adam, [m[0].weight, {"params": [m[0].bias]}])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        HostOptimizer(lambda groups, **kw: object(), m.parameters())
    opt = HostOptimizer(torch.optim.SGD, m.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: 0.0)


def test_a_group_added_later_is_stepped_with_its_own_settings() -> None:
    x, y = _batch()
    a, b = _model(), _model()
    host = HostOptimizer(torch.optim.SGD, a[0].parameters(), lr=0.1)
    host.add_param_group({"params": a[3].parameters(), "lr": 0.01})
    plain = torch.optim.SGD(b[0].parameters(), lr=0.1)
    plain.add_param_group({"params": b[3].parameters(), "lr": 0.01})
    for m, o in ((a, host), (b, plain)):
        ProductLoss()(m(x), y).backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def _fit_on_ranks(rank: int, world: int) -> dict[str, Any]:
    from fastpipe import DistributedPipe

    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)) for _ in range(4)]
    out: dict[str, Any] = {}
    for wrapped in (False, True):
        pipe = DistributedPipe(_model(), [2, 2], chunks=4, checkpoint="never")
        params = list(pipe.parameters())
        opt = HostOptimizer(torch.optim.Adam, params, lr=1e-2) if wrapped else torch.optim.Adam(params, lr=1e-2)
        mine = [(x if pipe.is_first else None, y if pipe.is_last else None) for x, y in batches]
        losses = [float(v) for v in pipe.fit(mine, ProductLoss(), opt, consistency="predict", window=2)]
        out[str(wrapped)] = (losses, _params(pipe))
        pipe.close()
    return out


def test_distributed_fit_with_it_equals_the_plain_optimizer_bitwise() -> None:
    for r in check_ok(run_ranks(_fit_on_ranks, 2, timeout=120)):
        (plain_losses, plain), (host_losses, host) = r["False"], r["True"]
        assert plain_losses == host_losses
        assert all(torch.equal(p, q) for p, q in zip(plain, host))
