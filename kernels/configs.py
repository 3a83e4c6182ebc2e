"""Launch configurations per GPU architecture: a checked-in table, a fallback, and the candidates.

Each op asks :func:`launch_config` for its settings (rows per program, warps, block sizes,
chunking). The answer comes from, in order:

1. an override installed by :func:`override` (the tuner, ``bench/kernel_tune.py``, uses it to try
   each entry of :data:`CANDIDATES` on a real GPU);
2. :data:`TUNED`, the table checked into the repo, keyed by architecture (``"sm90"``), op and
   width bucket (the next power of two of the row width, or ``"*"`` for any width);
3. :data:`FALLBACK`, a per-op rule for unknown GPUs and widths; under ``TRITON_INTERPRET=1`` the
   interpreter settings (few, large programs: its cost is per program) replace the GPU ones.

``TUNED`` starts empty: no setting here has been measured yet. The tuner prints the winning
entries as Python literals to paste into it, so users get them without re-tuning.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from ._common import interpreting, next_pow2

__all__ = [
    "TUNED",
    "FALLBACK",
    "CANDIDATES",
    "MAX_NORM_WARPS",
    "NORM_ELEMENTS_PER_THREAD",
    "launch_config",
    "norm_launch",
    "override",
    "arch_key",
]

Config = dict[str, Any]

#: Measured winners: ``TUNED[arch][op][bucket] = config``; bucket is ``next_pow2(width)`` or "*".
TUNED: dict[str, dict[str, dict[int | str, Config]]] = {}

#: Settings for unknown GPUs (reasoned, not measured). Registers per thread from ptxas 13.4 for
#: sm_90a at width 4096, bf16 (2026-11-30, no GPU; the host's ptxas may differ a little) set how
#: many programs fit on one SM (65,536 registers, 64 warps):
#:   norm fwd    1 row:  8 warps 80 regs (3/SM), 16 warps 48 regs (2/SM = 32 warps)
#:   norm bwd    1 row:  8 warps 172 regs (1/SM), 16 warps 92 (1/SM), 32 warps 56 (1/SM);
#:               4 warps 255 + spills, 2 rows x 8 warps 254: the dW/db accumulators live in registers
#:   bias_gelu   16 elements/thread ~144 regs (1/SM); 8 elements/thread ~63 (4/SM = 32 warps)
#:   elementwise swiglu bwd 2048 x 8 warps 40 regs; 4096 x 8 warps spills 8 bytes
#: Since only one norm-backward program fits per SM, more than one per SM only adds waves and
#: partial dW/db rows (programs x N x 8 bytes of peak memory), so the fallback runs one.
FALLBACK: dict[str, Config] = {
    # rows: rows per program (0: fill a 4096-element block); num_warps: warps per program.
    "norm_fwd": dict(rows=0, num_warps=16),
    # rows: rows per loop step; progs_per_sm: persistent programs per SM (each sums its own dW/db
    # rows, reduced once at the end: no atomics, no second pass over the activations).
    "norm_bwd": dict(rows=0, num_warps=16, progs_per_sm=1),
    # Flat elementwise kernels: elements per program and warps (8 per thread: one 16-byte bf16 vector).
    "elementwise": dict(block=2048, num_warps=8),
    # bias_gelu: a [rows x cols] tile per loop step, programs loop over row tiles summing dbias.
    "bias_gelu": dict(block_r=4, block_c=512, num_warps=8, progs_per_sm=4),
    # Cross-entropy row kernel: vocab elements per step, warps.
    "ce": dict(block_v=4096, num_warps=8),
    # linear_cross_entropy: "recompute" (exact, Liger-size memory, 4 GEMMs) or "accumulate" (fp32 dW
    # accumulator, 3 GEMMs, +2 x |W| bytes); chunk_ratio scales the default logits chunk
    # (1.0 = a chunk about as large as x, Liger-Kernel's rule).
    "lce": dict(strategy="recompute", chunk_ratio=1.0),
}

_INTERPRETER: dict[str, Config] = {
    "norm_fwd": dict(rows=0, num_warps=1),  # rows=0 here: as many rows as fit 2**16 elements
    "norm_bwd": dict(rows=0, num_warps=1, progs_per_sm=0),  # progs_per_sm=0: one program
    "elementwise": dict(block=1 << 17, num_warps=1),
    "bias_gelu": dict(block_r=0, block_c=0, num_warps=1, progs_per_sm=0),  # 0: one tile, one program
    "ce": dict(block_v=1 << 15, num_warps=1),
    "lce": dict(strategy="recompute", chunk_ratio=1.0),
}

#: What the tuner tries on a GPU, per op (each a partial config over FALLBACK).
CANDIDATES: dict[str, list[Config]] = {
    "norm_fwd": [dict(rows=r, num_warps=w) for r, w in [(1, 8), (1, 16), (1, 32), (2, 16), (4, 16)]],
    "norm_bwd": [
        dict(rows=r, num_warps=w, progs_per_sm=p)
        for r, w, p in [(1, 8, 1), (1, 16, 1), (1, 32, 1), (1, 16, 2), (1, 8, 4), (2, 16, 1)]
    ],
    "elementwise": [dict(block=b, num_warps=w) for b, w in [(1024, 4), (2048, 4), (2048, 8), (4096, 16), (8192, 16)]],
    "bias_gelu": [
        dict(block_r=r, block_c=c, num_warps=w, progs_per_sm=p)
        for r, c, w, p in [
            (4, 512, 8, 4),
            (8, 256, 8, 4),
            (2, 1024, 8, 4),
            (4, 1024, 16, 2),
            (4, 256, 4, 8),
            (8, 512, 8, 1),
        ]
    ],
    "ce": [dict(block_v=b, num_warps=w) for b, w in [(2048, 4), (4096, 8), (8192, 16), (16384, 16)]],
    "lce": [
        dict(strategy=s, chunk_ratio=c)
        for s, c in [
            ("recompute", 1.0),
            ("recompute", 2.0),
            ("accumulate", 1.0),
            ("accumulate", 4.0),
            ("accumulate", 8.0),
        ]
    ],
}

_OVERRIDES: dict[str, Config] = {}


@functools.cache
def _arch_of(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def arch_key(device: torch.device) -> str:
    """``"sm90"`` for a Hopper GPU, ``"interpreter"`` under TRITON_INTERPRET=1, else ``"cpu"``."""
    if interpreting():
        return "interpreter"
    if device.type != "cuda":
        return "cpu"
    return _arch_of(device.index if device.index is not None else torch.cuda.current_device())


def launch_config(op: str, device: torch.device, width: int = 0) -> Config:
    """The settings ``op`` should launch with on ``device`` for rows ``width`` wide (see module doc)."""
    if op in _OVERRIDES:
        return {**FALLBACK[op], **_OVERRIDES[op]}
    arch = arch_key(device)
    if arch == "interpreter":
        return dict(_INTERPRETER[op])
    table = TUNED.get(arch, {}).get(op, {})
    hit = table.get(next_pow2(width), table.get("*"))
    return {**FALLBACK[op], **hit} if hit is not None else dict(FALLBACK[op])


@contextlib.contextmanager
def override(op: str, config: Config) -> Iterator[None]:
    """Force ``config`` (merged over the fallback) for ``op`` inside the block; for the tuner."""
    if op not in FALLBACK:
        raise KeyError(f"unknown op {op!r}; known: {sorted(FALLBACK)}")
    previous = _OVERRIDES.get(op)
    _OVERRIDES[op] = dict(config)
    try:
        yield
    finally:
        if previous is None:
            _OVERRIDES.pop(op, None)
        else:
            _OVERRIDES[op] = previous


#: Row elements each thread of a norm program may hold. A program holds whole rows, and the
#: threads of one program share one SM's 65,536 registers (64 per thread at 32 warps), so more
#: warps stop helping once a row fills the register file. ptxas for sm_90 (triton 3.9's
#: bundle, bf16 with residual, one row per program; 2026-12-01, no GPU) spills, per thread:
#:   forward   8192: 0 B at 8, 16 or 32 warps;  16384: 48 B (16 warps), 44 B (32);
#:             32768: 6,192 B (16), 2,484 B (32);  65536: 18,728 B (16), 6,128 B (32)
#:   backward  4096: 0 B (8 or 32 warps);  8192: 464 B (8), 64 B (16), 68 B (32);
#:             16384: 1,780 B (16), 548 B (32);  32768: 1,896 B (32);  65536: 19,798 B (16)
#: 16 elements per thread keeps the spills at most tens of bytes up to 8192 columns and
#: 44 / 548 B at 16384 (32 warps); wider rows would move several times their own bytes in
#: spills, so they take the PyTorch path.
NORM_ELEMENTS_PER_THREAD = {"norm_fwd": 16, "norm_bwd": 16}
#: Warps of one norm program at most (1,024 threads).
MAX_NORM_WARPS = 32


def norm_launch(op: str, cfg: Config, m: int, n: int) -> tuple[int, int] | None:
    """``(rows per block, warps)`` for a norm kernel (``op``) on ``m`` rows ``n`` wide, or None.

    A block holds whole rows (``next_pow2(n)`` columns), so a wide row needs more warps to stay
    in registers: the warps rise above ``cfg``'s until each thread holds at most
    :data:`NORM_ELEMENTS_PER_THREAD` elements, and rows per block shrink to fit. A row too
    wide for that even at :data:`MAX_NORM_WARPS` (above 16,384 columns) gets None: the
    PyTorch path, rather than a kernel that spills to local
    memory (see the spill figures above). The interpreter has no registers and takes ``cfg``
    as it is.
    """
    block_n = next_pow2(n)
    rows = cfg["rows"]
    if rows <= 0:  # as many rows as fill a block of 4096 elements (2**16 in the interpreter, per program)
        rows = max(1, (1 << 16 if interpreting() else 4096) // block_n)
    block_m = max(1, min(next_pow2(m), next_pow2(rows)))
    if interpreting():
        return block_m, int(cfg["num_warps"])
    per_warp = 32 * NORM_ELEMENTS_PER_THREAD[op]
    widest = per_warp * MAX_NORM_WARPS
    if block_n > widest:
        return None
    block_m = min(block_m, widest // block_n)
    warps = max(int(cfg["num_warps"]), next_pow2(-(-block_m * block_n // per_warp)))
    return block_m, min(warps, MAX_NORM_WARPS)
