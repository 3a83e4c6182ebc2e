"""Data parallelism for a pipeline stage: its gradients averaged over the replicas, in buckets.

Each stage's reduction starts as soon as its last backward of the step has run, so it
overlaps the backward of the stages still running on this rank; the step waits for them
all at its end. Gradients are flattened into buckets of at most ``bucket_bytes`` of one
dtype, which keeps the number of collectives small without holding a copy of every
gradient at once. The gradients of weights tied across ranks are summed the same way
(:mod:`fastpipe.distributed.tie_group`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Bucket", "connect_replicas", "start_reduce", "finish_reduce"]


def connect_replicas(group: Any, device: torch.device, wait: Callable[[Any, str], None]) -> None:
    """All-reduce one element over the replicas' ``group`` (if any) on ``device``, waited with ``wait``.

    NCCL creates a group's communicator lazily, inside its first collective: without this,
    the first step's first gradient all-reduce would pay for it. Called while the pipeline
    is built, on every replica at once.
    """
    if group is None:
        return
    work = dist.all_reduce(torch.zeros(1, device=device), group=group, async_op=True)
    wait(work, "the data-parallel group's first all-reduce (connecting the replicas)")


@dataclass
class Bucket:
    """One in-flight all-reduce: ``flat`` holds the gradients at ``index`` of ``stage``."""

    stage: int
    work: Any
    flat: Tensor
    index: list[int]


def start_reduce(
    stage: int, params: Sequence[nn.Parameter], grads: list[Tensor | None], group: Any, bucket_bytes: int
) -> list[Bucket]:
    """Launch the async all-reduces of ``grads`` (a stage's, one per parameter) over ``group``.

    A parameter without a gradient gets zeros: the replicas must agree on the layout.
    """
    for i, p in enumerate(params):
        if grads[i] is None:
            grads[i] = torch.zeros_like(p)
    out: list[Bucket] = []
    bucket: list[int] = []
    size = 0
    for i in range(len(params)):
        g = grads[i]
        assert g is not None
        first = grads[bucket[0]] if bucket else None
        if first is not None and (size + g.numel() * g.element_size() > bucket_bytes or g.dtype != first.dtype):
            out.append(_launch(stage, grads, bucket, group))
            bucket, size = [], 0
        bucket.append(i)
        size += g.numel() * g.element_size()
    if bucket:
        out.append(_launch(stage, grads, bucket, group))
    return out


def _launch(stage: int, grads: list[Tensor | None], index: list[int], group: Any) -> Bucket:
    flat = torch.cat([g.reshape(-1) for i in index if (g := grads[i]) is not None])
    return Bucket(stage, dist.all_reduce(flat, group=group, async_op=True), flat, index)


def finish_reduce(grads: list[Tensor | None], bucket: Bucket, group: Any, *, average: bool = True) -> None:
    """After ``bucket``'s all-reduce completed: its mean (or, with ``average=False``, its sum), viewed back
    into ``grads``."""
    if average:
        bucket.flat.div_(dist.get_world_size(group))
    offset = 0
    for i in bucket.index:
        g = grads[i]
        assert g is not None
        grads[i] = bucket.flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
