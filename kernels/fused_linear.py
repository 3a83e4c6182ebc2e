"""Norm + Linear and bias-GELU + Linear pairs that recompute the Linear's input in backward.

A ``torch.nn.Linear`` keeps its input alive for the weight gradient. After a norm or an
activation that input is a second copy of something already saved, so these pairs save only
what the pair itself needs and rebuild the Linear's input in backward (flash-attention's
``LayerNormLinearFn`` does the same)::

    layer_norm_linear:  saves x                  recomputes mean, rstd, layer_norm(x)
    bias_gelu_linear:   saves x (pre-activation) recomputes gelu(x + bias)

Recomputing mean/rstd costs one extra read of ``x`` that backward makes anyway; it keeps the
saved bytes of a pre-norm MLP block at ``hidden + ffn_hidden`` values per token, the least
possible without recomputing a matmul.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import autocast_like, autocast_state
from .bias_gelu import bias_gelu_backward, bias_gelu_forward
from .layer_norm import norm_backward, norm_forward

__all__ = ["layer_norm_linear", "rms_norm_linear", "bias_gelu_linear"]


def _linear_grads(
    dh2: torch.Tensor, inp2: torch.Tensor, weight: torch.Tensor, need_w: bool, need_b: bool, has_bias: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    dw = (dh2.t() @ inp2).to(weight.dtype) if need_w else None
    db = dh2.sum(0).to(weight.dtype) if (need_b and has_bias) else None
    return dw, db


class _NormLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None,
        norm_bias: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        eps: float,
        is_rms: bool,
    ) -> torch.Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        y, _, _, _ = norm_forward(x2, None, norm_weight, norm_bias, 0.0, eps, is_rms, None, False)
        h = torch.nn.functional.linear(y, weight, bias)
        ctx.save_for_backward(x2, norm_weight, norm_bias, weight)
        ctx.meta = (x.shape, eps, is_rms, bias is not None)
        ctx.autocast = autocast_state(x)
        return h.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with autocast_like(ctx.autocast):  # replay forward's autocast, whatever the device
            return _NormLinearFn._backward(ctx, dh)

    @staticmethod
    def _backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, norm_weight, norm_bias, weight = ctx.saved_tensors
        shape, eps, is_rms, has_bias = ctx.meta
        dh2 = dh.reshape(-1, weight.shape[0])
        y, _, mean, rstd = norm_forward(x2, None, norm_weight, norm_bias, 0.0, eps, is_rms, None, False)
        need = ctx.needs_input_grad
        dw, db = _linear_grads(dh2, y, weight, need[3], need[4], has_bias)
        del y
        dy = dh2 @ weight
        dx, _, dnw, dnb = norm_backward(dy, None, x2, norm_weight, norm_bias is not None, mean, rstd, 0.0,
                                        None, False)  # fmt: skip
        return (
            dx.view(shape),
            dnw if need[1] else None,
            dnb if need[2] else None,
            dw,
            db,
            None,
            None,
        )


def layer_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    norm_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``linear(layer_norm(x, norm_weight, norm_bias, eps), weight, bias)``; saves only ``x``."""
    return _NormLinearFn.apply(x, norm_weight, norm_bias, weight, bias, float(eps), False)


def rms_norm_linear(
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """``linear(rms_norm(x, norm_weight, eps), weight, bias)``; saves only ``x``."""
    return _NormLinearFn.apply(x, norm_weight, None, weight, bias, float(eps), True)


class _BiasGeluLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        act_bias: torch.Tensor | None,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        approximate: str,
    ) -> torch.Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        g = bias_gelu_forward(x2, act_bias, approximate)
        out = torch.nn.functional.linear(g, weight, bias)
        ctx.save_for_backward(x2, act_bias, weight)
        ctx.meta = (x.shape, approximate, bias is not None)
        ctx.autocast = autocast_state(x)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with autocast_like(ctx.autocast):  # replay forward's autocast, whatever the device
            return _BiasGeluLinearFn._backward(ctx, dout)

    @staticmethod
    def _backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, act_bias, weight = ctx.saved_tensors
        shape, approximate, has_bias = ctx.meta
        dout2 = dout.reshape(-1, weight.shape[0])
        need = ctx.needs_input_grad
        if need[2]:
            g = bias_gelu_forward(x2, act_bias, approximate)
            dw, db = _linear_grads(dout2, g, weight, True, need[3], has_bias)
            del g
        else:
            dw, db = _linear_grads(dout2, x2, weight, False, need[3], has_bias)
        dx, dab = bias_gelu_backward(dout2 @ weight, x2, act_bias, approximate, want_dbias=need[1])
        return dx.view(shape), dab, dw, db, None


def bias_gelu_linear(
    x: torch.Tensor,
    act_bias: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    approximate: str = "none",
) -> torch.Tensor:
    """``linear(gelu(x + act_bias), weight, bias)``; saves only ``x`` (and the parameters)."""
    return _BiasGeluLinearFn.apply(x, act_bias, weight, bias, approximate)
