"""SwiGLU: ``silu(a) * b``. Saves only the inputs; backward recomputes the activation."""

from __future__ import annotations

from typing import Any

import torch

from ._common import HAS_TRITON, device_guard, tl, triton, use_triton
from .configs import launch_config

__all__ = ["swiglu"]

if HAS_TRITON:

    @triton.jit
    def _swiglu_fwd_kernel(A, B, Y, numel, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        y = a * tl.sigmoid(a) * b
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(DY, A, B, DA, DB, numel, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        a = tl.load(A + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(B + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(a)
        silu = a * s
        tl.store(DA + offs, (dy * b * s * (1.0 + a * (1.0 - s))).to(DA.dtype.element_ty), mask=mask)
        tl.store(DB + offs, (dy * silu).to(DB.dtype.element_ty), mask=mask)


def _launch(kernel: Any, t: torch.Tensor, *args: Any) -> None:
    """Launch a flat elementwise kernel over ``t.numel()`` elements with the tuned block/warps."""
    cfg = launch_config("elementwise", t.device)
    numel = t.numel()
    with device_guard(t):
        kernel[(triton.cdiv(numel, cfg["block"]),)](*args, numel, BLOCK=cfg["block"], num_warps=cfg["num_warps"])


class _SwigluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a2, b2 = torch.broadcast_tensors(a, b)
        a2, b2 = a2.contiguous(), b2.contiguous()
        ctx.save_for_backward(a, b)
        if use_triton(a2):
            y = torch.empty_like(a2)
            _launch(_swiglu_fwd_kernel, a2, a2, b2, y)
            return y
        af = a2.float()
        return (torch.nn.functional.silu(af) * b2.float()).to(a2.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = ctx.saved_tensors
        a2, b2 = torch.broadcast_tensors(a, b)
        a2, b2, dy = a2.contiguous(), b2.contiguous(), dy.contiguous()
        if use_triton(a2):
            da, db = torch.empty_like(a2), torch.empty_like(b2)
            _launch(_swiglu_bwd_kernel, a2, dy, a2, b2, da, db)
        else:
            af, bf, dyf = a2.float(), b2.float(), dy.float()
            s = torch.sigmoid(af)
            da = (dyf * bf * s * (1.0 + af * (1.0 - s))).to(a.dtype)
            db = (dyf * af * s).to(b.dtype)
        return _unbroadcast(da, a.shape), _unbroadcast(db, b.shape)


def _unbroadcast(g: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if g.shape == shape:
        return g
    return g.sum_to_size(shape)


def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` (the gated half of a SwiGLU MLP); saves ``a`` and ``b`` only."""
    if a.dtype != b.dtype:
        raise TypeError(f"swiglu needs equal dtypes, got {a.dtype} and {b.dtype}")
    return _SwigluFn.apply(a, b)
