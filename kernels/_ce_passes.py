"""The passes of :func:`~fastpipe.kernels.cross_entropy.linear_cross_entropy`: token chunks, vocab blocks.

:func:`run` does pass 1 over token chunks (logits, per-token loss and log-sum-exp, and, when a
per-token scale is given, dx and, for the "accumulate" strategy, dW and db); :func:`vocab_pass`
does pass 2 of "recompute" over vocab blocks (logits again, their gradient from the saved
log-sum-exp, dW rows and db entries). Row kernels in Triton on GPUs (and under the
interpreter), PyTorch elsewhere. See the module docstring of ``cross_entropy`` for the
strategies.
"""

from __future__ import annotations

import torch

from ._common import (
    HAS_TRITON,
    device_guard,
    interpreting,
    next_pow2,
    tl,
    triton,
    use_triton,
)
from ._gemm import addmm_fp32 as _addmm_fp32
from ._gemm import chunk_size as _chunk_size
from ._gemm import mm_into as _mm_into
from .configs import launch_config

__all__ = ["run", "vocab_pass", "weight_grad"]

if HAS_TRITON:

    @triton.jit
    def _ce_kernel(  # type: ignore[no-untyped-def]
        LOGITS, TARGET, SCALE, LOSS, LSE, M, V, ignore_index,
        COMPUTE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        # Online max/sum over the row (one read), then, if asked, the gradient written in place
        # over the logits (second read, one write). Arithmetic in fp32 whatever the storage.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = tl.arange(0, BLOCK_V)
        base = LOGITS + rows[:, None].to(tl.int64) * V
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            mask = rmask[:, None] & ((start + cols) < V)[None, :]
            z = tl.load(base + start + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe[:, None]), axis=1)
            m = m_new
        lse = tl.where(rmask, m + tl.log(tl.where(rmask, s, 1.0)), 0.0)
        tl.store(LSE + rows, lse, mask=rmask)
        tgt = tl.load(TARGET + rows, mask=rmask, other=ignore_index)
        valid = rmask & (tgt != ignore_index)
        safe_tgt = tl.where(valid, tgt, 0).to(tl.int64)
        z_tgt = tl.load(LOGITS + rows.to(tl.int64) * V + safe_tgt, mask=valid, other=0.0).to(tl.float32)
        tl.store(LOSS + rows, tl.where(valid, lse - z_tgt, 0.0), mask=rmask)
        if COMPUTE_GRAD:
            scale = tl.where(valid, tl.load(SCALE + rows, mask=rmask, other=0.0), 0.0)
            for start in range(0, V, BLOCK_V):
                c = start + cols
                mask = rmask[:, None] & (c < V)[None, :]
                z = tl.load(base + c[None, :], mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(z - lse[:, None]) - tl.where(c[None, :] == safe_tgt[:, None], 1.0, 0.0)
                tl.store(base + c[None, :], (g * scale[:, None]).to(LOGITS.dtype.element_ty), mask=mask)

    @triton.jit
    def _softmax_grad_kernel(  # type: ignore[no-untyped-def]
        LOGITS, LSE, TARGET, SCALE, M, V, v0, ignore_index, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr
    ):
        # Pass 2: logits of vocab columns [v0, v0 + V) for all rows, lse known: one read, one write.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        rmask = rows < M
        mask = rmask[:, None] & (cols < V)[None, :]
        offs = rows[:, None].to(tl.int64) * V + cols[None, :]
        z = tl.load(LOGITS + offs, mask=mask, other=0.0).to(tl.float32)
        lse = tl.load(LSE + rows, mask=rmask, other=0.0)
        tgt = tl.load(TARGET + rows, mask=rmask, other=ignore_index)
        scale = tl.where(tgt != ignore_index, tl.load(SCALE + rows, mask=rmask, other=0.0), 0.0)
        g = tl.exp(z - lse[:, None]) - tl.where((cols + v0)[None, :] == tgt[:, None], 1.0, 0.0)
        tl.store(LOGITS + offs, (g * scale[:, None]).to(LOGITS.dtype.element_ty), mask=mask)


def _ce_rows(
    logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None, ignore_index: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, lse)`` per row of a ``[C, V]`` chunk (fp32); if ``scale`` is given, overwrite the
    chunk with ``(softmax - onehot) * scale[:, None]`` (zero rows for ignored tokens)."""
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty(c, dtype=torch.float32, device=logits.device)
    if use_triton(logits):
        cfg = launch_config("ce", logits.device, v)
        block_v = min(next_pow2(v), cfg["block_v"])
        block_m = max(1, min(next_pow2(c), (1 << 17) // block_v)) if interpreting() else 1
        with device_guard(logits):
            _ce_kernel[(triton.cdiv(c, block_m),)](
                logits, target, scale if scale is not None else loss, loss, lse, c, v, ignore_index,
                COMPUTE_GRAD=scale is not None, BLOCK_M=block_m, BLOCK_V=block_v, num_warps=cfg["num_warps"],
            )  # fmt: skip
        return loss, lse
    zf = logits.float()
    valid = target != ignore_index
    safe_tgt = torch.where(valid, target, 0)
    lse = torch.logsumexp(zf, dim=1)
    loss = torch.where(valid, lse - zf.gather(1, safe_tgt[:, None])[:, 0], 0.0)
    if scale is not None:
        zf.sub_(lse[:, None]).exp_()  # in place: fp32 logits are the chunk itself, and loss is done
        zf.scatter_add_(1, safe_tgt[:, None], torch.full_like(lse[:, None], -1.0))
        zf.mul_(torch.where(valid, scale, 0.0)[:, None])
        if zf is not logits:  # 16-bit chunk: round the fp32 gradient into it
            logits.copy_(zf)
    return loss, lse


def _softmax_grad(
    logits: torch.Tensor, lse: torch.Tensor, target: torch.Tensor, scale: torch.Tensor, v0: int, ignore_index: int
) -> None:
    """Overwrite logits of vocab columns ``[v0, v0 + Vb)`` with ``(softmax - onehot) * scale``."""
    m, vb = logits.shape
    if use_triton(logits):
        if interpreting():
            block_v = min(next_pow2(vb), 1 << 12)
            block_m = max(1, min(next_pow2(m), (1 << 16) // block_v))
        else:  # 8 elements (one 16-byte bf16 vector) per thread
            block_m, block_v = 2, 1024
        with device_guard(logits):
            _softmax_grad_kernel[(triton.cdiv(m, block_m), triton.cdiv(vb, block_v))](
                logits, lse, target, scale, m, vb, v0, ignore_index, BLOCK_M=block_m, BLOCK_V=block_v,
                num_warps=8,
            )  # fmt: skip
        return
    valid = target != ignore_index
    g = (logits.float() - lse[:, None]).exp_()
    local = target - v0
    hit = valid & (local >= 0) & (local < vb)
    rows = torch.nonzero(hit)[:, 0]
    g[rows, local[rows]] -= 1.0
    logits.copy_(g.mul_(torch.where(valid, scale, 0.0)[:, None]))


def run(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tgt: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-token losses and log-sum-exps (fp32) and, if ``scale`` (fp32 per token) is given, the gradients ``needs``
    asks for (dx, dW, db), in the dtypes of x, weight and bias. Runs with autocast off: the
    compute dtype was chosen by the caller (``x2`` and ``weight`` already cast to it)."""
    cfg = launch_config("lce", x2.device)
    n, hidden = x2.shape
    v = weight.shape[0]
    cdt = x2.dtype
    step = _chunk_size(n, v, hidden, chunk_size, cfg["chunk_ratio"])
    need_dx, need_dw, need_db = needs if scale is not None else (False, False, False)
    need_db = need_db and bias is not None
    accumulate = cfg["strategy"] == "accumulate"
    buf = torch.empty(step * v, dtype=cdt, device=x2.device)
    losses = torch.empty(n, dtype=torch.float32, device=x2.device)
    lse = torch.empty(n, dtype=torch.float32, device=x2.device)
    dx = torch.empty(n, hidden, dtype=cdt, device=x2.device) if need_dx else None
    dw32 = torch.zeros(v, hidden, dtype=torch.float32, device=x2.device) if need_dw and accumulate else None
    db32 = torch.zeros(v, dtype=torch.float32, device=x2.device) if need_db else None
    wt = weight.t()
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        z = buf[: (hi - lo) * v].view(hi - lo, v)
        _mm_into(z, x2[lo:hi], wt, bias)
        sc = scale[lo:hi] if scale is not None else None
        losses[lo:hi], lse[lo:hi] = _ce_rows(z, tgt[lo:hi], sc, ignore_index)
        if dx is not None:
            _mm_into(dx[lo:hi], z, weight)
        if dw32 is not None:
            _addmm_fp32(dw32, z.t(), x2[lo:hi])
        if db32 is not None and accumulate:
            db32 += z.sum(0, dtype=torch.float32)
    dw = dw32 if dw32 is not None else None
    if (need_dw and not accumulate) or (need_db and not accumulate):
        assert scale is not None
        dw, db32 = vocab_pass(x2, weight, bias, tgt, ignore_index, scale, lse, buf, need_dw, db32)
    del buf
    return losses, lse, dx, dw, db32


def vocab_pass(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tgt: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor,
    lse: torch.Tensor,
    buf: torch.Tensor,
    need_dw: bool,
    db32: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Pass 2 of "recompute": per vocab block, logits again, their gradient from the saved lse,
    then that block's dW rows (one GEMM over all tokens, so written once) and db entries."""
    n, hidden = x2.shape
    v = weight.shape[0]
    block = max(256, buf.numel() // max(n, 1))
    if block * n > buf.numel():  # very many tokens: the 256-column floor outgrows pass 1's buffer
        buf = torch.empty(block * n, dtype=buf.dtype, device=buf.device)
    dw = torch.empty(v, hidden, dtype=x2.dtype, device=x2.device) if need_dw else None
    for v0 in range(0, v, block):
        v1 = min(v0 + block, v)
        z = buf[: n * (v1 - v0)].view(n, v1 - v0)
        _mm_into(z, x2, weight[v0:v1].t(), bias[v0:v1] if bias is not None else None)
        _softmax_grad(z, lse, tgt, scale, v0, ignore_index)
        if dw is not None:
            _mm_into(dw[v0:v1], z.t(), x2)
        if db32 is not None:
            db32[v0:v1] = z.sum(0, dtype=torch.float32)
    return dw, db32


def weight_grad(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tgt: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor,
    lse: torch.Tensor,
    chunk_size: int | None,
) -> torch.Tensor:
    """dW alone, from the log-sum-exps pass 1 saved: "recompute"'s pass 2, with pass 1's buffer size.

    The same two GEMMs per vocab block as when pass 2 follows pass 1 at once, so running it
    later (in backward) costs nothing more; in the compute dtype, with autocast off.
    """
    n, hidden = x2.shape
    v = weight.shape[0]
    step = _chunk_size(n, v, hidden, chunk_size, launch_config("lce", x2.device)["chunk_ratio"])
    buf = torch.empty(step * v, dtype=x2.dtype, device=x2.device)
    dw, _ = vocab_pass(x2, weight, bias, tgt, ignore_index, scale, lse, buf, True, None)
    assert dw is not None
    return dw
