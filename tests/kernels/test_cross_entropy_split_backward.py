"""linear_cross_entropy under a split backward: dW only in the weight pass, no host sync between passes.

A zero-bubble schedule runs the loss node twice per micro-batch: B asks autograd for the
input gradient only, W for the weight's. The weight GEMMs belong to W (B is the last stage's
critical path), and the node must not sync the host to compare the upstream gradients of
the two runs.
"""

from __future__ import annotations

import pytest
import torch
from fp_tolerance import assert_close_reordered

import fastpipe.kernels.cross_entropy as ce
from fastpipe.kernels import linear_cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "nobias"])
def test_input_pass_computes_no_weight_gradient(reduction, with_bias, monkeypatch):
    """``autograd.grad`` towards x alone runs no dW GEMM; towards the weight it runs once."""
    dw_runs: list[str] = []
    phase = ["B"]
    if reduction == "none":  # dW comes from the passes rerun in backward
        real_run = ce._run
        # Its arguments: x2, w, b, target, ignore_index, scale (None: no gradients), needs, chunk.
        monkeypatch.setattr(
            ce, "_run", lambda *a: (dw_runs.append(phase[0]) if a[5] is not None and a[6][1] else None) or real_run(*a)
        )
    else:  # "recompute": dW from pass 2 in backward
        real_dw = ce._weight_grad
        monkeypatch.setattr(ce, "_weight_grad", lambda *a: dw_runs.append(phase[0]) or real_dw(*a))
    x = torch.randn(7, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True) if with_bias else None
    t = torch.randint(0, 50, (7,))
    t[2] = -100
    loss = linear_cross_entropy(x, w, t, b, reduction=reduction).sum()
    g = torch.ones_like(loss)
    (gx,) = torch.autograd.grad(loss, [x], g, retain_graph=True)
    phase[0] = "W"
    params = [w] if b is None else [w, b]
    got = torch.autograd.grad(loss, params, g)
    assert dw_runs == ["W"]
    # The reference is one plain backward of the same op (its accuracy is tested elsewhere).
    want = torch.autograd.grad(linear_cross_entropy(x, w, t, b, reduction=reduction).sum(), [x, *params])
    for a, b_ in zip([gx, *got], want):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)


def test_zero_bubble_pipeline_computes_weight_gradient_only_in_w(monkeypatch):
    """In a Pipe's zb-h1 step every micro-batch's dW runs in its W action, and the gradients
    equal one plain backward."""
    import fastpipe.runtime.step as step
    from fastpipe import Pipe

    phase = ["F/B"]
    real_w = step.backward_weights

    def in_w(*args, **kwargs):
        phase[0] = "W"
        try:
            return real_w(*args, **kwargs)
        finally:
            phase[0] = "F/B"

    monkeypatch.setattr(step, "backward_weights", in_w)
    dw_runs: list[str] = []
    real_dw = ce._weight_grad
    monkeypatch.setattr(ce, "_weight_grad", lambda *a: dw_runs.append(phase[0]) or real_dw(*a))

    class Head(torch.nn.Module):  # holds the LM head's weight, applied by the loss
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(40, 16) * 0.1)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h

    def build() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), Head())

    x, y = torch.randn(8, 16), torch.randint(0, 40, (8,))
    plain = build()
    linear_cross_entropy(plain(x), plain[-1].weight, y).backward()
    dw_runs.clear()
    model = build()
    loss_fn = lambda h, t: linear_cross_entropy(h, model[-1].weight, t)  # noqa: E731
    loss_fn.reduction = "mean"
    Pipe(model, [2, 2], chunks=4).train_step(x, y, loss_fn, schedule="zb-h1")
    assert dw_runs == ["W"] * 4
    for (name, got), want in zip(model.named_parameters(), plain.parameters()):
        assert_close_reordered(got.grad, want.grad, k=64), name


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_split_backward_does_not_compare_upstream_gradients_on_the_host(reduction, monkeypatch):
    """B then W with the same bf16 upstream gradient: no ``torch.equal`` (a device sync)."""
    from fastpipe.runtime.split_backward import backward_inputs, backward_weights

    x = torch.randn(6, 16, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(40, 16) * 0.1).bfloat16().requires_grad_()
    t = torch.randint(0, 40, (6,))
    loss = linear_cross_entropy(x, w, t, reduction=reduction)
    compared: list[int] = []
    real_equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda *a: compared.append(1) or real_equal(*a))
    (gx,), work = backward_inputs([loss], [torch.ones_like(loss)], [x], [w])
    sums: list[torch.Tensor | None] = [None]
    backward_weights(work, sums)
    assert compared == []
    xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
    linear_cross_entropy(xr, wr, t, reduction=reduction).backward()
    assert torch.equal(gx, xr.grad)
    assert sums[0] is not None and torch.equal(sums[0], wr.grad)
