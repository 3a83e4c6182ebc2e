"""Under autocast the fused and deferred Linear paths run, with autocast's own arithmetic."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.wgrad import AccumulatingLinear, DeferringLinear, accumulating_linears

BF16 = torch.bfloat16


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _autocast_steps(lin: nn.Linear, xs: list[torch.Tensor], fused: bool) -> list[torch.Tensor]:
    """Each micro-batch's backward in turn under bf16 autocast; the sums and input gradients."""
    lin.zero_grad(set_to_none=True)
    input_grads = []
    for x in xs:
        x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=BF16), accumulating_linears([lin] if fused else []):
            out = lin(x)
        assert (type(out.grad_fn).__name__ == "AccumulatingLinearBackward") == fused
        assert out.dtype == BF16
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=BF16).reshape(out.shape))
        assert x.grad is not None and x.grad.dtype == x.dtype  # dx comes back through autograd's cast
        input_grads.append(x.grad)
    assert lin.weight.grad is not None and lin.bias.grad is not None
    return [lin.weight.grad.clone(), lin.bias.grad.clone(), *input_grads]


@pytest.mark.parametrize("shape", [(5, 7), (2, 3, 7)])
@pytest.mark.parametrize("x_dtype", [torch.float32, BF16])
def test_accumulating_linear_under_autocast_is_bitwise_autograd(shape: tuple[int, ...], x_dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(7, 4)
    xs = [torch.randn(*shape).to(x_dtype) for _ in range(3)]
    for got, ref in zip(_autocast_steps(lin, xs, fused=True), _autocast_steps(lin, xs, fused=False)):
        assert got.dtype == ref.dtype and torch.equal(got, ref)


def test_float64_under_autocast_still_falls_back() -> None:
    """Autocast leaves float64 alone, so a float64 Linear keeps autograd's path."""
    lin = nn.Linear(4, 4).double()
    with torch.autocast("cpu", dtype=BF16), accumulating_linears([lin]):
        out = lin(torch.randn(3, 4, dtype=torch.float64))
    assert out.dtype == torch.float64 and type(out.grad_fn).__name__ != "AccumulatingLinearBackward"


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("wgrad_batch", [1, 2])
def test_a_train_step_under_autocast_runs_the_fused_linears_and_equals_autograd(
    monkeypatch: pytest.MonkeyPatch, schedule: str, wgrad_batch: int
) -> None:
    """Same stages, same schedule, with and without the fused path: the same bf16 GEMMs, bit for bit."""
    calls = {"AccumulatingLinear": 0, "DeferringLinear": 0}
    for fn in (AccumulatingLinear, DeferringLinear):
        plain = fn.backward

        def counting(ctx: Any, grad: torch.Tensor, _plain: Any = plain, _name: str = fn.__name__) -> Any:
            assert grad.dtype == BF16  # the GEMMs run in autocast's dtype
            calls[_name] += 1
            return _plain(ctx, grad)

        monkeypatch.setattr(fn, "backward", staticmethod(counting))
    torch.manual_seed(0)
    model = _mlp()
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    grads = []
    for fused in (True, False):
        pipe = Pipe(_mlp(), balance=[2, 3], chunks=4, checkpoint="never", fused_wgrad=fused, wgrad_batch=wgrad_batch)
        pipe.load_state_dict(model.state_dict())
        with torch.autocast("cpu", dtype=BF16):
            pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)
        grads.append([p.grad for p in pipe.parameters()])
        if fused:
            assert sum(calls.values()) == 4 * 3  # every Linear of every micro-batch took the fused path
            assert (calls["DeferringLinear"] > 0) == (schedule == "zb-h1")  # split B/W deferred theirs
    for (name, _), a, b in zip(model.named_parameters(), *grads):
        assert a is not None and b is not None and a.dtype == torch.float32, name
        assert torch.equal(a, b), name
