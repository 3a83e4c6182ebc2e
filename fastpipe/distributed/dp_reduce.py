"""Data parallelism for a pipeline stage: its gradients averaged over the replicas, in buckets.

Each stage's reduction starts as soon as its last backward of the step has run, so it
overlaps the backward of the stages still running on this rank; the step waits for them
all at its end. Gradients are flattened into buckets of at most ``bucket_bytes`` of one
dtype, which keeps the number of collectives small without holding a copy of every
gradient at once. The gradients of weights tied across ranks are summed the same way
(:mod:`fastpipe.distributed.tie_group`); a gradient that is a DTensor shard (``dp_shard="fsdp"``)
is reduced through its local part.

The runtime drives one :class:`ReplicaSync` per step: :class:`AllReduceSync` here for replicated
stages, :class:`~fastpipe.distributed.fsdp.StageShards` for stages sharded over their replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from fastpipe.runtime.stage import Stage

__all__ = ["AllReduceSync", "Bucket", "ReplicaSync", "connect_replicas", "finish_reduce", "local_part", "start_reduce"]


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
        g = local_part(grads[i])
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
    flat = torch.cat([local_part(grads[i]).reshape(-1) for i in index])
    return Bucket(stage, dist.all_reduce(flat, group=group, async_op=True), flat, index)


def finish_reduce(grads: list[Tensor | None], bucket: Bucket, group: Any, *, average: bool = True) -> None:
    """After ``bucket``'s all-reduce completed: its mean (or, with ``average=False``, its sum), viewed back
    into ``grads``."""
    if average:
        bucket.flat.div_(dist.get_world_size(group))
    offset = 0
    for i in bucket.index:
        g = grads[i]
        local = local_part(g)
        summed = bucket.flat[offset : offset + local.numel()].view_as(local)
        if isinstance(g, DTensor):  # a shard (dp_shard="fsdp"): the same rows on every rank of a tie group
            summed = DTensor.from_local(
                summed, g.device_mesh, g.placements, run_check=False, shape=g.shape, stride=g.stride()
            )
        grads[i] = summed
        offset += local.numel()


def local_part(g: Tensor | None) -> Tensor:
    """What this rank holds of ``g``: a DTensor's local shard, else ``g``."""
    assert g is not None
    return g.to_local() if isinstance(g, DTensor) else g


class ReplicaSync:
    """How a step's gradients meet the replicas'; this base class has no replicas and does nothing.

    The runtime calls :meth:`begin` before the step's first action, :meth:`stage_done` after a
    stage's last backward (BW or W), :meth:`finish` after the last action, and :meth:`end` always,
    after a failure too.
    """

    def begin(self) -> None:
        """Before the step's first action."""

    def stage_done(self, stage: int, grads: list[Tensor | None]) -> None:
        """``stage`` ran its last backward: start reducing its summed gradients ``grads``."""

    def finish(self, grads: Mapping[int, list[Tensor | None]]) -> None:
        """Wait for every reduction started; ``grads`` (per stage) then hold the results."""

    def end(self) -> None:
        """After the step, or its failure: drop what it left."""


class AllReduceSync(ReplicaSync):
    """Replicated stages: each stage's gradients averaged over ``group`` in buckets of ``bucket_bytes``.

    ``wait(work, what)`` waits for one collective (the runtime's, bounded by its timeout).

    Attributes:
        collectives: the all-reduces the last step launched (``{"all_reduce": buckets}``).
    """

    def __init__(
        self, stages: Mapping[int, Stage], group: Any, bucket_bytes: int, wait: Callable[[Any, str], None]
    ) -> None:
        self.stages, self.group, self.bucket_bytes, self.wait = stages, group, bucket_bytes, wait
        self._pending: list[Bucket] = []
        self.collectives = {"all_reduce": 0}

    def begin(self) -> None:
        self.collectives = {"all_reduce": 0}

    def stage_done(self, stage: int, grads: list[Tensor | None]) -> None:
        buckets = start_reduce(stage, self.stages[stage].params, grads, self.group, self.bucket_bytes)
        self.collectives["all_reduce"] += len(buckets)
        self._pending += buckets

    def finish(self, grads: Mapping[int, list[Tensor | None]]) -> None:
        for bucket in self._pending:
            self.wait(bucket.work, f"the data-parallel gradient all-reduce of stage {bucket.stage}")
            finish_reduce(grads[bucket.stage], bucket, self.group)
        self._pending = []

    def end(self) -> None:
        self._pending = []
