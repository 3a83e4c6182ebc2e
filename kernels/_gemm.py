"""GEMM helpers of the chunked linear + cross-entropy: fp32 accumulation at the 16-bit rate.

A chunk's logits are written straight into one reused buffer, and a weight gradient that
accumulates over chunks is summed in fp32 while its GEMMs run in bf16/fp16 (the tensor-core
rate), the way eager autograd's single GEMM would round once.
"""

from __future__ import annotations

import torch

from ._common import cdiv, next_pow2

__all__ = ["OUT_DTYPE_MM", "addmm_fp32", "chunk_size", "compute_dtype", "mm_into"]


def chunk_size(tokens: int, vocab: int, hidden: int, requested: int | None, ratio: float = 1.0) -> int:
    """Tokens per chunk: ``requested`` if given, else Liger-Kernel's rule (a logits chunk about
    the size of ``x``, times ``ratio``), at least 64 tokens so that the chunk GEMMs still fill the
    tensor cores; never more than ``tokens``."""
    if requested is not None:
        return max(1, int(requested))
    rule = next_pow2(cdiv(tokens, cdiv(vocab, hidden)))
    return max(1, min(tokens, max(64, int(rule * ratio))))


# Per device type: whether this torch build has addmm(out_dtype=fp32) there (learnt on first use).
OUT_DTYPE_MM: dict[str, bool] = {}


def addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 and ``a``, ``b`` in a 16-bit dtype, at the 16-bit rate.

    Uses ``addmm(out_dtype=fp32)`` (fp32 accumulation and epilogue in one GEMM) where the build
    has it for this device; else a 16-bit product (rounded once) added in fp32.
    """
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
        return
    key = acc.device.type
    if OUT_DTYPE_MM.get(key, True):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            OUT_DTYPE_MM[key] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            OUT_DTYPE_MM[key] = False
    acc.add_(a @ b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """``out = a @ b (+ bias)``, written straight into ``out`` when the dtypes agree."""
    if out.dtype == a.dtype:
        if bias is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(bias, a, b, out=out)
    else:
        out.copy_(a @ b if bias is None else torch.addmm(bias, a, b))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMMs run in: autocast's where it is on for ``x``'s device, else ``x``'s."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
