"""Parameter hooks run once per step on the summed gradient, as under a plain ``loss.backward()``."""

from __future__ import annotations

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.param_hooks import accumulate_grad, hooks_set_aside


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))


def _hook(model: nn.Sequential, calls: list[str]) -> None:
    model[2].weight.register_hook(lambda g: calls.append("pre") or g * 2)  # replaces the gradient
    model[2].bias.register_hook(lambda g: calls.append("bias") or None)  # observes it
    model[4].weight.register_post_accumulate_grad_hook(lambda p: calls.append(f"post {p.grad.abs().sum():.6f}"))


@pytest.mark.parametrize("path", ["forward", "gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("fused", [False, True])
def test_hooks_see_the_step_gradient_once(path: str, fused: bool) -> None:
    x, y = torch.randn(12, 5), torch.randn(12, 2)
    ref, ref_calls = _model(), []
    _hook(ref, ref_calls)
    nn.functional.mse_loss(ref(x), y).backward()

    model, calls = _model(), []
    _hook(model, calls)
    pipe = Pipe(model, balance=[2, 2, 1], chunks=4, fused_wgrad=fused)
    if path == "forward":
        nn.functional.mse_loss(pipe(x), y).backward()
    else:
        pipe.train_step(x, y, nn.functional.mse_loss, schedule=path)
    assert sorted(c.split()[0] for c in calls) == sorted(c.split()[0] for c in ref_calls) == ["bias", "post", "pre"]
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=5 + 8 + 8 + 12)  # micro-batches vs the full batch


def test_hooks_set_aside_restores_them_even_on_error() -> None:
    p = nn.Parameter(torch.ones(3))
    calls: list[int] = []
    handle = p.register_hook(lambda g: calls.append(1))
    with pytest.raises(ValueError, match="boom"), hooks_set_aside([p]):
        p.sum().backward()
        assert calls == []
        raise ValueError("boom")
    p.sum().backward()
    assert calls == [1]
    handle.remove()  # the handle still finds its hook
    p.sum().backward()
    assert calls == [1]


def test_accumulate_grad_runs_hooks_like_autograd() -> None:
    p = nn.Parameter(torch.zeros(2))
    order: list[str] = []
    p.register_hook(lambda g: order.append("pre") or g + 1)
    p.register_post_accumulate_grad_hook(lambda t: order.append(f"post {t.grad.tolist()}"))
    accumulate_grad(p, torch.ones(2))
    accumulate_grad(p, torch.ones(2))
    assert order == ["pre", "post [2.0, 2.0]", "pre", "post [4.0, 4.0]"]
