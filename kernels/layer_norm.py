"""Fused residual-add + dropout + LayerNorm / RMSNorm.

::

    x ──dropout(seed)──(+)── new_residual ──norm(w, b)── out
                        │
                   residual (optional)

Saved for backward: ``new_residual`` (or ``x`` itself when there is neither residual nor
dropout), fp32 ``mean`` (LayerNorm only) and ``rstd`` per row, the weight and the seed.
The dropout mask and the normalised activations are recomputed in backward.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import (
    HAS_TRITON,
    as_seed_tensor,
    device_guard,
    dropout_scale,
    next_pow2,
    reference_keep_mask,
    tl,
    triton,
    use_triton,
)
from .configs import launch_config, norm_launch

__all__ = ["add_dropout_layer_norm", "add_dropout_rms_norm", "norm_forward", "norm_backward"]

#: Widest row the Triton kernels take in one block; wider rows use the PyTorch path (on a GPU
#: the register budget sets a lower bound: :func:`~fastpipe.kernels.configs.norm_launch`).
MAX_TRITON_COLS = 1 << 16

if HAS_TRITON:

    @triton.jit
    def _norm_fwd_kernel(  # type: ignore[no-untyped-def]
        X, R, W, B, Y, RES, MEAN, RSTD, SEED, M, N, eps, p, scale,
        HAS_RES: tl.constexpr, HAS_DROP: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        IS_RMS: tl.constexpr, STORE_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_N)
        rmask = rows < M
        cmask = cols < N
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DROP:
            keep = tl.rand(tl.load(SEED), offs) >= p
            x = tl.where(keep, x * scale, 0.0)
        if HAS_RES:
            x += tl.load(R + offs, mask=mask, other=0.0).to(tl.float32)
        if STORE_RES:
            # Normalise the stored (rounded) value so that backward sees exactly what forward used.
            x = x.to(RES.dtype.element_ty)
            tl.store(RES + offs, x, mask=mask)
            x = x.to(tl.float32)
        if IS_RMS:
            xc = x
        else:
            mean = tl.sum(x, axis=1) / N
            xc = tl.where(mask, x - mean[:, None], 0.0)
            tl.store(MEAN + rows, mean, mask=rmask)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=rmask)
        y = xc * rstd[:, None]
        if HAS_W:
            y = y * tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _norm_bwd_kernel(  # type: ignore[no-untyped-def]
        DY, DRES, RES, W, MEAN, RSTD, SEED, DX, DR, DW, DB, M, N, p, scale, rows_per_prog,
        HAS_DRES: tl.constexpr, HAS_DROP: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
        IS_RMS: tl.constexpr, STORE_DR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            w = tl.where(cmask, 1.0, 0.0)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        first = pid * rows_per_prog
        for start in range(first, first + rows_per_prog, BLOCK_M):
            rows = start + tl.arange(0, BLOCK_M)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            offs = rows[:, None] * N + cols[None, :]
            x = tl.load(RES + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            if IS_RMS:
                xhat = x * rstd[:, None]
            else:
                mean = tl.load(MEAN + rows, mask=rmask, other=0.0)
                xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            wdy = w[None, :] * dy
            dw_acc += dy * xhat
            db_acc += dy
            c1 = tl.sum(xhat * wdy, axis=1) / N
            if IS_RMS:
                dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            else:
                c2 = tl.sum(wdy, axis=1) / N
                dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            if HAS_DRES:
                dx += tl.load(DRES + offs, mask=mask, other=0.0).to(tl.float32)
            if STORE_DR:
                tl.store(DR + offs, dx.to(DR.dtype.element_ty), mask=mask)
            if HAS_DROP:
                keep = tl.rand(tl.load(SEED), offs) >= p
                dx = tl.where(keep, dx * scale, 0.0)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_W:
            tl.store(DW + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)
        if HAS_B:
            tl.store(DB + pid * N + cols, tl.sum(db_acc, axis=0), mask=cmask)


def norm_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    p: float,
    eps: float,
    is_rms: bool,
    seed: torch.Tensor | None,
    store_res: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Forward on 2-D contiguous inputs; returns ``(out, new_residual | None, mean | None, rstd)``.

    ``out`` has x's dtype; ``new_residual`` the promoted dtype of x and the residual, so that an
    fp32 residual stream stays fp32 when x is bf16.
    """
    m, n = x.shape
    has_drop = p > 0.0
    res_dtype = torch.promote_types(x.dtype, residual.dtype) if residual is not None else x.dtype
    launch = norm_launch("norm_fwd", launch_config("norm_fwd", x.device, n), m, n) if n <= MAX_TRITON_COLS else None
    if launch is not None and use_triton(x):
        block_m, warps = launch
        y = torch.empty_like(x)
        res = torch.empty(x.shape, dtype=res_dtype, device=x.device) if store_res else None
        mean = None if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_n = next_pow2(n)
        with device_guard(x):
            _norm_fwd_kernel[(triton.cdiv(m, block_m),)](
                x, residual, weight, bias, y, res, mean, rstd, seed, m, n, float(eps), float(p),
                dropout_scale(p), HAS_RES=residual is not None, HAS_DROP=has_drop,
                HAS_W=weight is not None, HAS_B=bias is not None, IS_RMS=is_rms, STORE_RES=store_res,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
            )  # fmt: skip
        return y, res, mean, rstd
    xf = x.float()
    if has_drop:
        assert seed is not None
        keep = reference_keep_mask(seed, x.numel(), p, x.device).view(m, n)
        xf = torch.where(keep, xf * dropout_scale(p), 0.0)
    if residual is not None:
        xf = xf + residual.float()
    res = None
    if store_res:
        res = xf.to(res_dtype)
        xf = res.float()
    if is_rms:
        mean = None
        xc = xf
    else:
        mean = xf.mean(dim=1)
        xc = xf - mean[:, None]
    rstd = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * rstd[:, None]
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype), res, mean, rstd


def norm_backward(
    dy: torch.Tensor,
    dres: torch.Tensor | None,
    res: torch.Tensor,
    weight: torch.Tensor | None,
    has_bias: bool,
    mean: torch.Tensor | None,
    rstd: torch.Tensor,
    p: float,
    seed: torch.Tensor | None,
    store_dr: bool,
    dx_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Backward on 2-D inputs; returns ``(dx, d_residual | None, dweight | None, dbias | None)``.

    ``dx`` has ``dx_dtype`` (default: res's), ``d_residual`` res's dtype.
    """
    dx_dtype = dx_dtype or res.dtype
    m, n = res.shape
    is_rms = mean is None
    has_drop = p > 0.0
    cfg = launch_config("norm_bwd", res.device, n)
    launch = norm_launch("norm_bwd", cfg, m, n) if n <= MAX_TRITON_COLS else None
    if launch is not None and use_triton(res):
        block_m, warps = launch
        dy = dy.contiguous()
        dres = dres.contiguous() if dres is not None else None
        dx = torch.empty(res.shape, dtype=dx_dtype, device=res.device)
        dr = torch.empty_like(res) if store_dr else None
        block_n = next_pow2(n)
        # Off CUDA (the interpreter) count one "SM", so a config's program count is testable there.
        sms = torch.cuda.get_device_properties(res.device).multi_processor_count if res.is_cuda else 1
        progs = max(1, min(triton.cdiv(m, block_m), cfg["progs_per_sm"] * sms))
        rows_per_prog = triton.cdiv(triton.cdiv(m, progs), block_m) * block_m
        progs = triton.cdiv(m, rows_per_prog)
        dw = torch.empty(progs, n, dtype=torch.float32, device=res.device) if weight is not None else None
        db = torch.empty(progs, n, dtype=torch.float32, device=res.device) if has_bias else None
        with device_guard(res):
            _norm_bwd_kernel[(progs,)](
                dy, dres, res, weight, mean, rstd, seed, dx, dr, dw, db, m, n, float(p), dropout_scale(p),
                rows_per_prog, HAS_DRES=dres is not None, HAS_DROP=has_drop, HAS_W=weight is not None,
                HAS_B=has_bias, IS_RMS=is_rms, STORE_DR=store_dr, BLOCK_M=block_m, BLOCK_N=block_n,
                num_warps=warps,
            )  # fmt: skip
        dw_out = dw.sum(0).to(weight.dtype) if weight is not None and dw is not None else None
        db_out = db.sum(0).to(weight.dtype if weight is not None else res.dtype) if db is not None else None
        return dx, dr, dw_out, db_out
    xf = res.float()
    dyf = dy.float()
    xhat = xf * rstd[:, None] if mean is None else (xf - mean[:, None]) * rstd[:, None]
    wdy = dyf * weight.float() if weight is not None else dyf
    c1 = (xhat * wdy).mean(dim=1, keepdim=True)
    if is_rms:
        dxf = (wdy - xhat * c1) * rstd[:, None]
    else:
        dxf = (wdy - (xhat * c1 + wdy.mean(dim=1, keepdim=True))) * rstd[:, None]
    if dres is not None:
        dxf = dxf + dres.float()
    dr = dxf.to(res.dtype) if store_dr else None
    if has_drop:
        assert seed is not None
        keep = reference_keep_mask(seed, res.numel(), p, res.device).view(m, n)
        dxf = torch.where(keep, dxf * dropout_scale(p), 0.0)
    dw_out = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None else None
    db_out = dyf.sum(0).to(weight.dtype if weight is not None else res.dtype) if has_bias else None
    return dxf.to(dx_dtype), dr, dw_out, db_out


class _AddDropoutNormFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        p: float,
        eps: float,
        is_rms: bool,
        seed: torch.Tensor | None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        shape = x.shape
        n = shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        r2 = residual.reshape(-1, n).contiguous() if residual is not None else None
        store_res = residual is not None or p > 0.0
        y, res, mean, rstd = norm_forward(x2, r2, weight, bias, p, eps, is_rms, seed, store_res)
        ctx.save_for_backward(res if store_res else x2, weight, mean, rstd, seed)
        ctx.meta = (shape, p, residual is not None, bias is not None, store_res, x.dtype)
        ctx.set_materialize_grads(False)
        if res is not None:
            return y.view(shape), res.view(shape)
        return y.view(shape)

    @staticmethod
    def backward(
        ctx: Any, dy: torch.Tensor | None, dres: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, ...]:
        res, weight, mean, rstd, seed = ctx.saved_tensors
        shape, p, has_res, has_bias, _, x_dtype = ctx.meta
        n = shape[-1]
        dy = torch.zeros_like(res) if dy is None else dy.reshape(-1, n)
        dres = dres.reshape(-1, n) if dres is not None else None
        dx, dr, dw, db = norm_backward(dy, dres, res, weight, has_bias, mean, rstd, p, seed, has_res, x_dtype)
        dr = dr.view(shape) if dr is not None else None
        if weight is None or not ctx.needs_input_grad[2]:
            dw = None
        if not ctx.needs_input_grad[3]:
            db = None
        return dx.view(shape), dr, dw, db, None, None, None, None


def _add_dropout_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    p: float,
    eps: float,
    training: bool,
    seed: int | torch.Tensor | None,
    is_rms: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    p = float(p) if training else 0.0
    seed_t = as_seed_tensor(seed, x.device) if p > 0.0 else None
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    out = _AddDropoutNormFn.apply(x, residual, weight, bias, p, float(eps), is_rms, seed_t)
    if isinstance(out, tuple):
        return out
    return out, x


def add_dropout_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    p: float = 0.0,
    eps: float = 1e-5,
    training: bool = True,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``new_residual = residual + dropout(x)``; ``out = layer_norm(new_residual)`` over the last dim.

    Args:
        x: input ``[..., N]``.
        residual: same shape as ``x``, or None.
        weight, bias: ``[N]`` affine parameters, or None.
        p: dropout probability (ignored when ``training`` is False).
        eps: added to the variance.
        training: dropout is off when False.
        seed: explicit dropout seed; drawn from torch's default generator of ``x.device`` if None.

    Returns:
        ``(out, new_residual)``; ``new_residual`` is ``x`` itself when there is neither a residual
        nor dropout.
    """
    return _add_dropout_norm(x, residual, weight, bias, p, eps, training, seed, is_rms=False)


def add_dropout_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor | None,
    p: float = 0.0,
    eps: float = 1e-6,
    training: bool = True,
    seed: int | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm twin of :func:`add_dropout_layer_norm` (no bias, no mean subtraction)."""
    return _add_dropout_norm(x, residual, weight, None, p, eps, training, seed, is_rms=True)
