"""Tolerances for two float computations of the same math that round differently.

Bitwise equality holds only when the arithmetic is the same: the same ops on the same shapes in
the same order (a pipe against the plain model run on the same micro-batches, a rerun against a
run). A GEMM on 3 rows against one on 9, a BLAS kernel chosen for another shape, CPU model or
thread count, or micro-batch gradients added in another order give the same math grouped
differently, and the results agree only up to rounding.

How big that rounding is: every add rounds with relative error at most ``eps / 2``. Summing
``k`` terms, the rounding errors of two different orders behave like a random walk, so the two
sums differ by about ``eps * sqrt(k)`` times the size of the partial sums, which is about the
size of the results (worst case ``eps * k``, never seen in practice for random data). For a chain
of reductions (LayerNorm, then two Linears) the errors of each add up, so ``k`` is the total
length of the reductions on the path from input to the compared value (for a weight gradient,
add the rows it sums over). The tolerance is then

    rtol = FACTOR * eps * sqrt(k),   atol = rtol * rms(expected)

``atol`` scales with the typical size of the result (its root mean square), not with each
element: an element that is small because its terms cancelled still carries the rounding of the
large partial sums it came from. ``FACTOR`` = 8 covers the tail over many elements (the largest
of 10^5 Gaussian errors is about 4.4 standard deviations) and the amplification of an early
error through later layers. A real bug (a dropped layer, a wrong micro-batch, a missing
gradient term) is off by about ``rms(expected)``, thousands of times more.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FACTOR", "reordering_tolerance", "assert_close_reordered", "close_reordered"]

FACTOR = 8.0


def reordering_tolerance(expected: torch.Tensor, k: int, *, dtype: torch.dtype | None = None) -> dict[str, float]:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` (see the module docstring for why).

    Args:
        expected: the reference result (its dtype and scale set the tolerance).
        k: total length of the reductions on the path to ``expected``.
        dtype: the dtype the arithmetic ran in, when not ``expected.dtype``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not (dtype or expected.dtype).is_floating_point:
        return {"rtol": 0.0, "atol": 0.0}  # integers (counters, indices) have no rounding
    eps = torch.finfo(dtype or expected.dtype).eps
    rtol = FACTOR * eps * math.sqrt(k)
    scale = expected.detach().double().square().mean().sqrt().item() if expected.numel() else 0.0
    return {"rtol": rtol, "atol": rtol * max(scale, torch.finfo(expected.dtype).tiny)}


def assert_close_reordered(
    actual: torch.Tensor, expected: torch.Tensor, *, k: int, msg: str | None = None, dtype: torch.dtype | None = None
) -> None:
    """``assert_close`` with :func:`reordering_tolerance` of ``expected`` for reductions of length ``k``.

    Against a float64 reference of an fp32 computation, pass ``dtype=torch.float32``: the
    reference is as good as exact, and the fp32 rounding is what the tolerance must cover.
    """
    torch.testing.assert_close(actual, expected, **reordering_tolerance(expected, k, dtype=dtype), msg=msg)


def close_reordered(actual: torch.Tensor, expected: torch.Tensor, *, k: int) -> bool:
    """:func:`assert_close_reordered` as a bool (for code that collects problems, e.g. on ranks)."""
    tol = reordering_tolerance(expected, k)
    return actual.shape == expected.shape and torch.allclose(actual, expected, rtol=tol["rtol"], atol=tol["atol"])
