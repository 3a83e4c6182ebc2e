"""Linear + cross-entropy without materialising the full ``[tokens, vocab]`` logits.

GEMMs run in the compute dtype (the input's, or autocast's), so bf16/fp16 inputs use the tensor
cores with fp32 accumulation; an fp32 GEMM on Hopper runs at a small fraction of that rate.
Two strategies (``configs.launch_config("lce")``; the GPU tuner measures both)::

    "recompute" (default)                         "accumulate"
    pass 1, token chunks of C rows:               token chunks of C rows:
      z   = x_c @ W^T + b      [C, V] buffer        z = x_c @ W^T + b
      loss, lse; z := dloss/dz in place             loss; z := dloss/dz in place
      dx_c = z @ W             (complete)           dx_c = z @ W
    pass 2, vocab blocks of Vb columns:             dW32 += z^T @ x_c   (fp32 accumulator)
      z   = x @ W_b^T + b_b    same buffer          db32 += sum(z)
      z := (exp(z - lse) - onehot) * s
      dW_b = z^T @ x           (complete)
      db_b = sum(z)

"recompute" spends a fourth GEMM (logits twice) to write every gradient once, with fp32
accumulation inside one GEMM: exact as eager, and no vocab-sized accumulator, so its peak memory
is the gradients plus one logits buffer (Liger-Kernel's, whose dW accumulates in the weight's
dtype chunk by chunk). "accumulate" runs three GEMMs but holds an fp32 ``[V, H]`` accumulator
(2x a bf16 weight). Cut Cross-Entropy (Wijmans et al., 2024) also recomputes logits blockwise.

For ``reduction="mean"|"sum"`` the gradients are computed in forward and saved; backward scales
them by the incoming scalar in place (so it runs once). For ``reduction="none"``, and for fp16
(whose gradients would underflow before a GradScaler's factor arrives), forward computes only
the losses; backward reruns the passes with the per-token scales.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import (
    HAS_TRITON,
    autocast_like,
    autocast_state,
    device_guard,
    interpreting,
    next_pow2,
    tl,
    triton,
    use_triton,
)
from ._gemm import OUT_DTYPE_MM as _OUT_DTYPE_MM  # noqa: F401 - bench/kernel_tune.py reports it
from ._gemm import addmm_fp32 as _addmm_fp32
from ._gemm import chunk_size as _chunk_size
from ._gemm import compute_dtype as _compute_dtype
from ._gemm import mm_into as _mm_into
from .configs import launch_config

__all__ = ["linear_cross_entropy"]

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


def _run(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tgt: torch.Tensor,
    ignore_index: int,
    scale: torch.Tensor | None,
    needs: tuple[bool, bool, bool],
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Per-token losses and, if ``scale`` (fp32 per token) is given, the gradients ``needs``
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
        dw, db32 = _vocab_pass(x2, weight, bias, tgt, ignore_index, scale, lse, buf, need_dw, db32)
    del buf
    return losses, dx, dw, db32


def _vocab_pass(
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


class _LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        bias: torch.Tensor | None,
        ignore_index: int,
        reduction: str,
        chunk_size: int | None,
    ) -> torch.Tensor:
        hidden = x.shape[-1]
        cdt = _compute_dtype(x)
        x2 = x.reshape(-1, hidden).to(cdt)
        tgt = target.reshape(-1).contiguous()
        n = x2.shape[0]
        need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
        # fp16 has 5 exponent bits: (softmax - onehot) / n_valid rounded into the fp16 chunk flushes
        # most off-target gradients to zero (60% at V=32k, 1,024 tokens) before a GradScaler's factor
        # could lift them. So for fp16 the gradients wait for backward, where the upstream gradient
        # (that factor) is folded into each row's scale before anything is rounded, as in eager.
        deferred = reduction != "none" and cdt == torch.float16
        grad_now = reduction != "none" and not deferred and (need_dx or need_dw or need_db)
        n_valid = (tgt != ignore_index).sum()
        scale = None
        if grad_now:
            s = 1.0 / n_valid.clamp(min=1).float() if reduction == "mean" else torch.ones((), device=x.device)
            scale = s.expand(n).contiguous()  # the kernels read one scale per row
        ctx.meta = (x.shape, x.dtype, reduction, ignore_index, chunk_size, deferred)
        ctx.autocast = autocast_state(x)
        ctx.scaled_by = None  # the upstream gradient the saved gradients were scaled by, once
        w, b = weight.to(cdt), bias.to(cdt) if bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            losses, dx, dw, db = _run(x2, w, b, tgt, ignore_index, scale, (need_dx, need_dw, need_db), chunk_size)
        if reduction == "none":
            ctx.save_for_backward(x, weight, tgt, bias)
            return losses.view(target.shape).to(x.dtype)
        if deferred:
            ctx.save_for_backward(x, weight, tgt, bias)
            ctx.n_valid = n_valid
            total = losses.sum()
            return (total / n_valid if reduction == "mean" else total).to(x.dtype)
        # Kept on ctx rather than saved for backward: backward scales them in place, which
        # the saved-tensor version check would refuse on a second backward (see _scaled_grads).
        ctx.grads = (
            dx.view(x.shape).to(x.dtype) if dx is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            db.to(bias.dtype) if db is not None and bias is not None else None,
        )
        total = losses.sum()
        return (total / n_valid if reduction == "mean" else total).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        with autocast_like(ctx.autocast):  # replay forward's autocast, whatever the device
            return _LinearCrossEntropyFn._backward(ctx, g)

    @staticmethod
    def _scaled_grads(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """The gradients forward computed, times the upstream gradient ``g``.

        The first call scales them in place: they are ours alone (saved by forward), and a copy
        would double the weight-sized memory at the peak. A later call (``retain_graph``, or a
        pipeline's split backward, whose weight pass runs this node again with the same ``g``)
        gets them again, rescaled out of place when ``g`` changed; if something wrote into the
        tensors handed out the first time, they are gone, and that is refused.
        """
        grads = ctx.grads
        if ctx.scaled_by is None:
            for t in grads:
                if t is not None:
                    t.mul_(g)
            ctx.scaled_by = (g, [t._version if t is not None else 0 for t in grads])
        else:
            first, versions = ctx.scaled_by
            if any(t is not None and t._version != v for t, v in zip(grads, versions)):
                raise RuntimeError(
                    "linear_cross_entropy hands out the gradients it computed in forward, and they were "
                    "modified after its first backward, so it cannot backpropagate again; use "
                    "reduction='none' (then .sum()/.mean()) to backpropagate through it more than once"
                )
            if first is not g and not torch.equal(first, g):  # `is`: no device sync when unchanged
                if not bool(first != 0):
                    raise RuntimeError(
                        "linear_cross_entropy's first backward had a zero upstream gradient, which erased "
                        "the gradients it computed in forward; use reduction='none' to backpropagate again"
                    )
                ratio = g / first
                grads = tuple(t * ratio.to(t.dtype) if t is not None else None for t in grads)
        dx, dw, db = grads
        return dx, dw, None, db, None, None, None

    @staticmethod
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, x_dtype, reduction, ignore_index, chunk_size, deferred = ctx.meta
        if reduction != "none" and not deferred:
            return _LinearCrossEntropyFn._scaled_grads(ctx, g.float())
        x, weight, tgt, bias = ctx.saved_tensors
        need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
        hidden = shape[-1]
        cdt = _compute_dtype(x)
        x2 = x.reshape(-1, hidden).to(cdt)
        w, b = weight.to(cdt), bias.to(cdt) if bias is not None else None
        if reduction == "none":
            scale = g.reshape(-1).float().contiguous()
        else:  # deferred: the upstream scalar (and 1 / n_valid for a mean) for every row, in fp32
            g32 = g.float() / ctx.n_valid.clamp(min=1).float() if reduction == "mean" else g.float()
            scale = g32.expand(tgt.numel()).contiguous()
        with torch.autocast(x.device.type, enabled=False):
            _, dx, dw, db = _run(x2, w, b, tgt, ignore_index, scale, (need_dx, need_dw, need_db), chunk_size)
        return (
            dx.view(shape).to(x_dtype) if dx is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            None,
            db.to(bias.dtype) if db is not None and bias is not None else None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(x @ weight.T + bias, target)`` without materialising the full logits.

    Args:
        x: hidden states ``[..., H]``.
        weight: ``[V, H]`` (the LM head / tied embedding).
        target: class indices, ``x.shape[:-1]``.
        bias: ``[V]`` or None.
        ignore_index: targets equal to this contribute no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored tokens), ``"sum"`` or ``"none"``.
        chunk_size: tokens per chunk; by default the logits chunk is about the size of ``x``
            (at least 256 tokens).

    Returns:
        The loss, as ``torch.nn.functional.cross_entropy`` would return it.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.shape != x.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} != x.shape[:-1] {tuple(x.shape[:-1])}")
    return _LinearCrossEntropyFn.apply(x, weight, target, bias, ignore_index, reduction, chunk_size)
