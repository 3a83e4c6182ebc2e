"""Weight gradients of ``nn.Linear`` summed inside the GEMM, not after it.

Over a step's micro-batches autograd computes each Linear's weight gradient into a new
tensor, then ``AccumulateGrad`` adds it to ``.grad``: per micro-batch the GEMM writes the
full weight-sized result and the add reads two and writes one more. Accumulating in the
GEMM instead (``grad.addmm_(g.T, x)``, beta = 1) touches the sum once. Megatron-LM does the
same on GPUs (its "gradient accumulation fusion"). Measured on one 2048x512 weight, 32-row
micro-batches, 8 of them, one CPU thread: 6.6-7.0 ms with mm + add, 4.4-4.6 ms with addmm_.

Only the step runner's combined backward (``BW``) uses it: that backward swaps each
parameter's running sum into ``.grad`` for the duration of the call, so writing ``.grad``
here is exactly what ``AccumulateGrad`` would have done. During a forward whose backward
will be a ``BW``, :func:`accumulating_linears` routes plain ``nn.Linear`` modules through
:class:`AccumulatingLinear`::

    x ──▶ [AccumulatingLinear] ──▶ y          forward: F.linear, saves x
    dx ◀──      │   dy                        backward: dx = dy @ W, db = sum(dy)
                └── W.grad.addmm_(dyᵀ, x)     no gradient flows to W's AccumulateGrad

Whatever autograd would do differently falls back to ``F.linear``: autocast, mixed
dtypes, tensor subclasses, frozen weights. Parameter hooks are no reason to fall back: the
stage backwards run with them set aside, and they see the step's summed gradient (see
:mod:`fastpipe.runtime.param_hooks`). ``FASTPIPE_FUSED_WGRAD=0`` turns the fusion off for
new stages.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = ["AccumulatingLinear", "accumulating_linears", "fusable_linears", "fused_wgrad_enabled"]


def fused_wgrad_enabled() -> bool:
    """Whether new stages accumulate Linear weight gradients in the GEMM (``FASTPIPE_FUSED_WGRAD``)."""
    return os.environ.get("FASTPIPE_FUSED_WGRAD", "1") != "0"


class AccumulatingLinear(torch.autograd.Function):
    """``F.linear`` whose backward adds the weight gradient straight into ``weight.grad``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)  # weight too: in-place changes before backward still raise
        ctx.param = weight  # the leaf itself, whose .grad is the running sum
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        g2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            param = ctx.param
            x2 = x.reshape(-1, x.shape[-1])
            running = param.grad
            if running is None:
                param.grad = g2.t().mm(x2)
            elif running.dtype == weight.dtype and running.device == weight.device and running.layout == torch.strided:
                running.addmm_(g2.t(), x2)
            else:  # a sum autograd left in another form: add out of place, as AccumulateGrad would
                param.grad = running + g2.t().mm(x2)
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_b


def fusable_linears(module: nn.Module, params: Sequence[Tensor]) -> list[nn.Linear]:
    """The plain ``nn.Linear`` layers of ``module`` whose weight is one of ``params``.

    Subclasses may override ``forward`` and are left alone, as are modules that already
    carry an instance-level ``forward``.
    """
    ids = {id(p) for p in params}
    return [m for m in module.modules() if type(m) is nn.Linear and id(m.weight) in ids and "forward" not in m.__dict__]


def _fusable(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    if not (torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf):
        return False
    if type(x) is not Tensor or type(weight) not in (Tensor, nn.Parameter):
        return False
    if x.layout != torch.strided or x.dtype != weight.dtype or x.device != weight.device or x.dim() < 1:
        return False
    if not weight.is_floating_point() or torch.is_autocast_enabled(x.device.type):
        return False
    return bias is None or (type(bias) in (Tensor, nn.Parameter) and bias.dtype == weight.dtype)


def _forward(self: nn.Linear, x: Tensor) -> Tensor:
    if _fusable(x, self.weight, self.bias):
        return AccumulatingLinear.apply(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def accumulating_linears(linears: Sequence[nn.Linear]) -> Iterator[None]:
    """Within the block, ``linears`` accumulate their weight gradients in the GEMM.

    The block must be a forward whose backward runs with each weight's running sum in
    ``.grad`` (the step runner's ``BW``); other backwards would find the weight gradient
    already added, not returned.
    """
    patched = []
    try:
        for lin in linears:
            if "forward" not in lin.__dict__:
                lin.forward = _forward.__get__(lin)  # type: ignore[method-assign]
                patched.append(lin)
        yield
    finally:
        for lin in patched:
            del lin.__dict__["forward"]
