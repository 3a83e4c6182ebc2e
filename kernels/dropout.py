"""Seed-based dropout: the mask is never stored, backward regenerates it from the seed.

Saved for backward: one int64 seed (8 bytes), nothing per element.

Triton path: Philox (``tl.rand(seed, flat_index)``). PyTorch path: a ``torch.Generator`` seeded
with the same seed. Each path is reproducible on its own; the two masks are not equal.
"""

from __future__ import annotations

from typing import Any

import torch

from ._common import (
    HAS_TRITON,
    as_seed_tensor,
    device_guard,
    dropout_scale,
    reference_keep_mask,
    tl,
    triton,
    use_triton,
)
from .configs import launch_config

__all__ = ["dropout", "dropout_apply"]

if HAS_TRITON:

    @triton.jit
    def _dropout_kernel(X, Y, SEED, numel, p, scale, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        # int32 offsets cannot wrap: use_triton leaves 2**31 elements or more to PyTorch, and
        # BLOCK, a tl.arange length, is a power of two, so it divides 2**31 and the last
        # block ends at 2**31 - 1 at most.
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        keep = tl.rand(tl.load(SEED), offs) >= p
        y = tl.where(keep, x * scale, 0.0)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


def dropout_apply(x: torch.Tensor, seed: torch.Tensor, p: float) -> torch.Tensor:
    """``x * keep(seed) / (1 - p)`` without autograd; used by forward and backward alike."""
    x = x.contiguous()
    if use_triton(x):
        y = torch.empty_like(x)
        numel = x.numel()
        cfg = launch_config("elementwise", x.device)
        with device_guard(x):
            _dropout_kernel[(triton.cdiv(numel, cfg["block"]),)](
                x, y, seed, numel, float(p), dropout_scale(p), BLOCK=cfg["block"], num_warps=cfg["num_warps"]
            )
        return y
    keep = reference_keep_mask(seed, x.numel(), p, x.device).view(x.shape)
    return torch.where(keep, x * dropout_scale(p), torch.zeros((), dtype=x.dtype, device=x.device))


class _DropoutFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float, seed: torch.Tensor) -> torch.Tensor:
        ctx.p = p
        ctx.save_for_backward(seed)
        return dropout_apply(x, seed, p)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (seed,) = ctx.saved_tensors
        return dropout_apply(dy, seed, ctx.p), None, None


def dropout(
    x: torch.Tensor, p: float = 0.5, training: bool = True, seed: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Dropout whose mask is a function of a seed, so a recompute reproduces it.

    Args:
        x: input, any shape.
        p: drop probability in [0, 1].
        training: identity when False.
        seed: explicit seed; by default one is drawn from torch's default generator of ``x.device``.

    Returns:
        ``x`` with dropped elements zeroed and the rest scaled by ``1 / (1 - p)``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    return _DropoutFn.apply(x, float(p), as_seed_tensor(seed, x.device))
