"""Fused bias-add + GELU (exact or tanh). Saves only the inputs; backward recomputes the activation.

Saved for backward: ``x`` and ``bias`` (a parameter). The activation and its derivative are
recomputed from them in backward, so nothing of the output's size is kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._common import HAS_TRITON, interpreting, tl, triton, use_triton

__all__ = ["bias_gelu", "bias_gelu_forward", "bias_gelu_backward"]

_SQRT_HALF = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_K = math.sqrt(2.0 / math.pi)
_C = 0.044715

if HAS_TRITON:

    @triton.jit
    def _gelu_and_grad(z, TANH: tl.constexpr, WANT_GRAD: tl.constexpr):  # type: ignore[no-untyped-def]
        if TANH:
            u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
            u = tl.minimum(tl.maximum(u, -20.0), 20.0)  # tanh(20) == 1 in fp32; no exp overflow
            t = 2.0 * tl.sigmoid(2.0 * u) - 1.0
            g = 0.5 * z * (1.0 + t)
            if WANT_GRAD:
                dg = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
            else:
                dg = g
        else:
            cdf = 0.5 * (1.0 + tl.math.erf(z * 0.7071067811865476))
            g = z * cdf
            if WANT_GRAD:
                dg = cdf + z * tl.exp(-0.5 * z * z) * 0.3989422804014327
            else:
                dg = g
        return g, dg

    @triton.jit
    def _bias_gelu_fwd_kernel(  # type: ignore[no-untyped-def]
        X, B, Y, numel, N, HAS_B: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
        g, _ = _gelu_and_grad(z, TANH, False)
        tl.store(Y + offs, g.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd_kernel(  # type: ignore[no-untyped-def]
        DY, X, B, DX, numel, N, HAS_B: tl.constexpr, TANH: tl.constexpr, BLOCK: tl.constexpr
    ):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            z += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
        _, dg = _gelu_and_grad(z, TANH, True)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, (dy * dg).to(DX.dtype.element_ty), mask=mask)


def _block() -> int:
    return 1 << 17 if interpreting() else 2048


def _ref_gelu_and_grad(z: torch.Tensor, tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if tanh:
        t = torch.tanh(_K * (z + _C * z * z * z))
        return 0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _K * (1.0 + 3.0 * _C * z * z)
    cdf = 0.5 * (1.0 + torch.erf(z * _SQRT_HALF))
    return z * cdf, cdf + z * torch.exp(-0.5 * z * z) * _INV_SQRT_2PI


def _check_approx(approximate: str) -> bool:
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


def bias_gelu_forward(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)`` without autograd (``bias`` broadcasts over the last dim)."""
    tanh = _check_approx(approximate)
    x = x.contiguous()
    if use_triton(x):
        y = torch.empty_like(x)
        numel, n = x.numel(), x.shape[-1]
        _bias_gelu_fwd_kernel[(triton.cdiv(numel, _block()),)](
            x, bias, y, numel, n, HAS_B=bias is not None, TANH=tanh, BLOCK=_block()
        )
        return y
    z = x.float() + bias.float() if bias is not None else x.float()
    return _ref_gelu_and_grad(z, tanh)[0].to(x.dtype)


def bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none"
) -> torch.Tensor:
    """Gradient w.r.t. ``x + bias`` (hence w.r.t. ``x``), recomputing the activation."""
    tanh = _check_approx(approximate)
    x = x.contiguous()
    dy = dy.contiguous()
    if use_triton(x):
        dx = torch.empty_like(x)
        numel, n = x.numel(), x.shape[-1]
        _bias_gelu_bwd_kernel[(triton.cdiv(numel, _block()),)](
            dy, x, bias, dx, numel, n, HAS_B=bias is not None, TANH=tanh, BLOCK=_block()
        )
        return dx
    z = x.float() + bias.float() if bias is not None else x.float()
    return (dy.float() * _ref_gelu_and_grad(z, tanh)[1]).to(x.dtype)


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
        ctx.approximate = approximate
        ctx.save_for_backward(x, bias)
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, bias = ctx.saved_tensors
        dx = bias_gelu_backward(dy, x, bias, ctx.approximate)
        dbias = None
        if bias is not None and ctx.needs_input_grad[1]:
            dbias = dx.reshape(-1, x.shape[-1]).float().sum(0).to(bias.dtype)
        return dx, dbias, None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + bias)``; saves ``x`` and ``bias`` only and recomputes the activation in backward.

    Args:
        x: input ``[..., N]``.
        bias: ``[N]`` or None.
        approximate: ``"none"`` (erf) or ``"tanh"``, as in ``torch.nn.functional.gelu``.
    """
    _check_approx(approximate)
    return _BiasGeluFn.apply(x, bias, approximate)
