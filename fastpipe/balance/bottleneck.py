"""The least-bottleneck partition: the contiguous split whose largest stage cost is least.

:func:`min_bottleneck` is the classic exact DP, O(stages x layers^2). :func:`~fastpipe.balance.planner.plan`
starts its search from it, and :func:`~fastpipe.balance.torchgpipe.by_size` uses it on per-layer memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["min_bottleneck"]


def min_bottleneck(
    costs: Sequence[float],
    stages: int,
    memory: Sequence[float] | None = None,
    limit: float = math.inf,
    fits: Callable[[int, int, int], bool] | None = None,
) -> list[int] | None:
    """Exact DP for the partition minimising the largest stage cost.

    Args:
        costs: cost of each layer.
        stages: number of stages (each holds at least one layer).
        memory: bytes each layer needs; a stage needs the sum over its layers.
        limit: the most bytes one stage may need.
        fits: ``fits(a, b, s)``: whether layers ``a:b`` fit as stage ``s`` (a need that is not a
            sum over layers); with ``memory`` both must hold.

    Returns:
        Layers per stage, or None when no partition fits ``limit``.
    """
    n = len(costs)
    mem = list(memory) if memory is not None else [0.0] * n
    prefix, pmem = [0.0], [0.0]
    for c, x in zip(costs, mem):
        prefix.append(prefix[-1] + c)
        pmem.append(pmem[-1] + x)
    inf = math.inf
    # best[k][i]: least bottleneck for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] == inf or pmem[i] - pmem[j] > limit or (fits is not None and not fits(j, i, k - 1)):
                    continue
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    if best[stages][n] == inf:
        return None
    balance, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]
