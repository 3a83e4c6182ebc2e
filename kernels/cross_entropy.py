"""Linear + cross-entropy, chunked over tokens: the full ``[tokens, vocab]`` logits never exist.

For each chunk of ``C`` tokens::

    logits_c = x_c @ W^T + b                 # [C, V] fp32, the only vocab-sized buffer
    loss_c, lse_c  = CE(logits_c, target_c)  # one row-wise kernel, which also overwrites
    logits_c      := (softmax - onehot) * s  #   logits_c with d loss / d logits in place
    dx_c  = logits_c @ W;  dW += logits_c^T @ x_c;  db += sum(logits_c)

For ``reduction="mean"|"sum"`` the gradients are computed in forward, chunk by chunk, and saved;
backward only scales them by the incoming scalar. For ``reduction="none"`` backward recomputes
the chunks (saving ``x`` and ``target``), since per-token scales are known only then.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import HAS_TRITON, autocast_like, autocast_state, interpreting, next_pow2, tl, triton, use_triton

__all__ = ["linear_cross_entropy"]

if HAS_TRITON:

    @triton.jit
    def _ce_kernel(  # type: ignore[no-untyped-def]
        LOGITS, TARGET, SCALE, LOSS, M, V, ignore_index,
        COMPUTE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rmask = rows < M
        cols = tl.arange(0, BLOCK_V)
        base = LOGITS + rows[:, None].to(tl.int64) * V
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, V, BLOCK_V):
            mask = rmask[:, None] & ((start + cols) < V)[None, :]
            z = tl.load(base + start + cols[None, :], mask=mask, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(z - m_safe[:, None]), axis=1)
            m = m_new
        lse = tl.where(rmask, m + tl.log(tl.where(rmask, s, 1.0)), 0.0)
        tgt = tl.load(TARGET + rows, mask=rmask, other=ignore_index)
        valid = rmask & (tgt != ignore_index)
        safe_tgt = tl.where(valid, tgt, 0).to(tl.int64)
        z_tgt = tl.load(LOGITS + rows.to(tl.int64) * V + safe_tgt, mask=valid, other=0.0)
        tl.store(LOSS + rows, tl.where(valid, lse - z_tgt, 0.0), mask=rmask)
        if COMPUTE_GRAD:
            scale = tl.where(valid, tl.load(SCALE + rows, mask=rmask, other=0.0), 0.0)
            for start in range(0, V, BLOCK_V):
                c = start + cols
                mask = rmask[:, None] & (c < V)[None, :]
                z = tl.load(base + c[None, :], mask=mask, other=0.0)
                g = tl.exp(z - lse[:, None]) - tl.where(c[None, :] == safe_tgt[:, None], 1.0, 0.0)
                tl.store(base + c[None, :], g * scale[:, None], mask=mask)


def _ce_chunk(
    logits: torch.Tensor, target: torch.Tensor, scale: torch.Tensor | None, ignore_index: int
) -> torch.Tensor:
    """Per-token loss of an fp32 ``[C, V]`` chunk; if ``scale`` is given, overwrite the chunk with
    ``(softmax - onehot) * scale[:, None]`` (zero rows for ignored tokens)."""
    c, v = logits.shape
    if use_triton(logits):
        loss = torch.empty(c, dtype=torch.float32, device=logits.device)
        if interpreting():
            block_v = min(next_pow2(v), 1 << 15)
            block_m = max(1, min(next_pow2(c), (1 << 17) // block_v))
        else:
            block_v, block_m = min(next_pow2(v), 4096), 1
        _ce_kernel[(triton.cdiv(c, block_m),)](
            logits, target, scale if scale is not None else loss, loss, c, v, ignore_index,
            COMPUTE_GRAD=scale is not None, BLOCK_M=block_m, BLOCK_V=block_v,
            num_warps=8 if block_v >= 2048 else 4,
        )  # fmt: skip
        return loss
    valid = target != ignore_index
    safe_tgt = torch.where(valid, target, 0)
    lse = torch.logsumexp(logits, dim=1)
    loss = torch.where(valid, lse - logits.gather(1, safe_tgt[:, None])[:, 0], 0.0)
    if scale is not None:
        logits.sub_(lse[:, None]).exp_()
        logits.scatter_add_(1, safe_tgt[:, None], torch.full_like(lse[:, None], -1.0))
        logits.mul_(torch.where(valid, scale, 0.0)[:, None])
    return loss


def _chunk_size(tokens: int, vocab: int, hidden: int, chunk_size: int | None) -> int:
    """Tokens per chunk. Default: Liger-Kernel's rule (logits chunk about the size of ``x``), but
    at least 256 tokens, so that the per-chunk ``dW`` update (a full ``V x H`` read and write)
    does not dominate when ``V / H`` is large; never more than ``tokens``."""
    if chunk_size is not None:
        return max(1, int(chunk_size))
    return max(1, min(tokens, max(256, next_pow2(_cdiv(tokens, _cdiv(vocab, hidden))))))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _logits(x_c: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    z = x_c @ weight.t()
    if bias is not None:
        z = z + bias
    return z.float()


def _accumulate_grads(
    grad: torch.Tensor,
    x_c: torch.Tensor,
    weight: torch.Tensor,
    dx: torch.Tensor | None,
    dw: torch.Tensor | None,
    db: torch.Tensor | None,
    lo: int,
    hi: int,
) -> None:
    """Given d loss / d logits of a chunk, add its share to dx, dW, db."""
    if dx is not None:
        dx[lo:hi] = (grad.to(weight.dtype) @ weight).to(dx.dtype)
    if dw is not None:
        dw.addmm_(grad.t(), x_c.float())
    if db is not None:
        db.add_(grad.sum(0))


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
        x2 = x.reshape(-1, hidden)
        tgt = target.reshape(-1)
        n, v = x2.shape[0], weight.shape[0]
        step = _chunk_size(n, v, hidden, chunk_size)
        need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
        grad_now = reduction != "none" and (need_dx or need_dw or need_db)
        n_valid = (tgt != ignore_index).sum()
        dx = torch.empty_like(x2) if grad_now and need_dx else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if grad_now and need_dw else None
        db = torch.zeros(v, dtype=torch.float32, device=x.device) if grad_now and need_db else None
        losses = torch.empty(n, dtype=torch.float32, device=x.device)
        scale = None
        if grad_now:
            s = 1.0 / n_valid.clamp(min=1).float() if reduction == "mean" else torch.ones((), device=x.device)
            scale = s.expand(step).contiguous()
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            logits = _logits(x2[lo:hi], weight, bias)
            sc = scale[: hi - lo] if scale is not None else None
            losses[lo:hi] = _ce_chunk(logits, tgt[lo:hi].contiguous(), sc, ignore_index)
            if grad_now:
                _accumulate_grads(logits, x2[lo:hi], weight, dx, dw, db, lo, hi)
            del logits
        ctx.meta = (x.shape, reduction, ignore_index, step)
        ctx.autocast = autocast_state(x)
        if reduction == "none":
            ctx.save_for_backward(x2, weight, tgt, bias)
            return losses.view(target.shape).to(x.dtype)
        ctx.save_for_backward(
            dx.view(x.shape) if dx is not None else None,
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
    def _backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shape, reduction, ignore_index, step = ctx.meta
        if reduction != "none":
            dx, dw, db = ctx.saved_tensors
            g = g.float()
            dx = (dx * g).to(dx.dtype) if dx is not None else None
            dw = (dw * g).to(dw.dtype) if dw is not None else None
            db = (db * g).to(db.dtype) if db is not None else None
            return dx, dw, None, db, None, None, None
        x2, weight, tgt, bias = ctx.saved_tensors
        need_dx, need_dw, _, need_db = ctx.needs_input_grad[:4]
        g = g.reshape(-1).float().contiguous()
        n, v = x2.shape[0], weight.shape[0]
        dx = torch.empty_like(x2) if need_dx else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=x2.device) if need_dw else None
        db = torch.zeros(v, dtype=torch.float32, device=x2.device) if need_db and bias is not None else None
        for lo in range(0, n, step):
            hi = min(lo + step, n)
            logits = _logits(x2[lo:hi], weight, bias)
            _ce_chunk(logits, tgt[lo:hi].contiguous(), g[lo:hi], ignore_index)
            _accumulate_grads(logits, x2[lo:hi], weight, dx, dw, db, lo, hi)
            del logits
        return (
            dx.view(shape) if dx is not None else None,
            dw.to(weight.dtype) if dw is not None else None,
            None,
            db.to(bias.dtype) if db is not None else None,
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
