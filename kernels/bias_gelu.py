"""Fused bias-add + GELU (exact or tanh). Saves only the inputs; backward recomputes the activation.

Saved for backward: ``x`` and ``bias`` (a parameter). The activation and its derivative are
recomputed from them in backward, so nothing of the output's size is kept.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ._common import HAS_TRITON, cdiv, device_guard, next_pow2, tl, triton, use_triton
from .configs import launch_config

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
        X, B, Y, M, N, HAS_B: tl.constexpr, TANH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
    ):
        # 2-D tiles: the bias is loaded once per tile, no per-element modulo. Row blocks sit on grid
        # axis 0 (up to 2**31 - 1 programs): axes 1 and 2 stop at 65,535, which tall inputs pass.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < N
        mask = (rows < M)[:, None] & cmask[None, :]
        offs = rows[:, None] * N + cols[None, :]
        z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_B:
            z += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        g, _ = _gelu_and_grad(z, TANH, False)
        tl.store(Y + offs, g.to(Y.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd_kernel(  # type: ignore[no-untyped-def]
        DY, X, B, DX, DBP, M, N, rows_per_prog,
        HAS_B: tl.constexpr, WANT_DB: tl.constexpr, TANH: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # Program (c, g) owns columns block c of rows group g, and sums its dbias share in
        # registers: DBP[g, cols] holds one fp32 partial per group, so dbias needs neither atomics
        # nor a second pass over dx (eager reads dx again; a .float() copy would add 2x its bytes).
        cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < N
        if HAS_B:
            bias = tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        first = tl.program_id(1) * rows_per_prog
        for start in range(first, first + rows_per_prog, BLOCK_R):
            rows = start + tl.arange(0, BLOCK_R)
            mask = (rows < M)[:, None] & cmask[None, :]
            offs = rows[:, None] * N + cols[None, :]
            z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_B:
                z += bias[None, :]
            _, dg = _gelu_and_grad(z, TANH, True)
            dx = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32) * dg
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
            if WANT_DB:
                acc += tl.where(mask, dx, 0.0)
        if WANT_DB:
            tl.store(DBP + tl.program_id(1) * N + cols, tl.sum(acc, axis=0), mask=cmask)


def _tiles(x: torch.Tensor, n: int) -> tuple[int, int, int, int]:
    """``(block_r, block_c, num_warps, progs_per_sm)`` for rows ``n`` wide (0s: interpreter, one tile).

    A config's ``block_c`` is the widest tile; narrower rows get a tile as wide as they are and
    proportionally more rows, so a last dimension of 7 does not mask off 505 of 512 columns.
    """
    cfg = launch_config("bias_gelu", x.device, n)
    if not cfg["block_c"]:
        block_c = min(next_pow2(n), 1 << 14)
        return max(1, (1 << 16) // block_c), block_c, cfg["num_warps"], cfg["progs_per_sm"]
    block_c = min(cfg["block_c"], next_pow2(n))
    block_r = max(1, cfg["block_r"] * cfg["block_c"] // block_c)
    return block_r, block_c, cfg["num_warps"], cfg["progs_per_sm"]


def forward_grid(m: int, n: int, block_r: int, block_c: int) -> tuple[int, int]:
    """The forward kernel's launch grid for ``m`` rows ``n`` wide: (row blocks, column blocks)."""
    return cdiv(m, block_r), cdiv(n, block_c)


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
        n = x.shape[-1]
        m = x.numel() // max(n, 1)
        block_r, block_c, warps, _ = _tiles(x, n)
        with device_guard(x):
            _bias_gelu_fwd_kernel[forward_grid(m, n, block_r, block_c)](
                x, bias, y, m, n, HAS_B=bias is not None, TANH=tanh, BLOCK_R=block_r, BLOCK_C=block_c,
                num_warps=warps,
            )  # fmt: skip
        return y
    z = x.float() + bias.float() if bias is not None else x.float()
    return _ref_gelu_and_grad(z, tanh)[0].to(x.dtype)


def bias_gelu_backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none", want_dbias: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients w.r.t. ``x`` and (if ``want_dbias`` and there is a bias) ``bias``, recomputing
    the activation; dbias is summed in fp32 from the unrounded dx and returned in bias's dtype."""
    tanh = _check_approx(approximate)
    x = x.contiguous()
    dy = dy.contiguous()
    want_db = want_dbias and bias is not None
    if use_triton(x):
        dx = torch.empty_like(x)
        n = x.shape[-1]
        m = x.numel() // max(n, 1)
        block_r, block_c, warps, per_sm = _tiles(x, n)
        col_blocks = triton.cdiv(n, block_c)
        # Off CUDA (the interpreter) count one "SM", so a config's program count is testable there.
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        groups = max(1, min(triton.cdiv(m, block_r), triton.cdiv(per_sm * sms, col_blocks)))
        rows_per_prog = triton.cdiv(triton.cdiv(m, groups), block_r) * block_r
        groups = max(1, triton.cdiv(m, rows_per_prog))
        part = torch.empty(groups, n, dtype=torch.float32, device=x.device) if want_db else None
        with device_guard(x):
            _bias_gelu_bwd_kernel[(col_blocks, groups)](
                dy, x, bias, dx, part, m, n, rows_per_prog, HAS_B=bias is not None, WANT_DB=want_db,
                TANH=tanh, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
            )  # fmt: skip
        dbias = part.sum(0).to(bias.dtype) if part is not None and bias is not None else None
        return dx, dbias
    z = x.float() + bias.float() if bias is not None else x.float()
    dxf = dy.float() * _ref_gelu_and_grad(z, tanh)[1]
    dbias = dxf.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype) if want_db and bias is not None else None
    return dxf.to(x.dtype), dbias


class _BiasGeluFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, approximate: str) -> torch.Tensor:
        ctx.approximate = approximate
        ctx.save_for_backward(x, bias)
        return bias_gelu_forward(x, bias, approximate)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, None]:
        x, bias = ctx.saved_tensors
        dx, dbias = bias_gelu_backward(dy, x, bias, ctx.approximate, want_dbias=ctx.needs_input_grad[1])
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
