"""Loss scaling (``torch.amp.GradScaler``) inside ``train_step``.

``Pipe.train_step(..., scaler=)`` and ``DistributedPipe.train_step(..., scaler=)`` run the
backward on the scaled loss, as ``scaler.scale(loss).backward()`` would, and return the
unscaled loss; the caller then runs ``scaler.step(opt); scaler.update()`` as usual.

Across processes one more thing matters. A GradScaler skips the optimizer step when *its*
gradients hold an inf or NaN, and then lowers the scale. Each rank of a pipeline holds only
its stages' gradients, so with a plain GradScaler per rank an overflow in stage 0 would skip
the step on rank 0 alone: the other stages step, and the ranks' scales drift apart from then
on (a one-process model skips the whole step). The scaler must agree across ranks on
skipped steps, which is what ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
does: its ``unscale_`` all-reduces the inf flag over its ``process_group``.
:func:`distributed_loss_scale` therefore asks for one whose group holds every rank of the
pipeline (and of its data-parallel replicas), and checks each step that all ranks scale by
the same factor.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["distributed_loss_scale", "loss_scale"]


def _scale_on(scaler: Any, device: torch.device) -> Tensor | None:
    """``scaler``'s scale as a tensor on ``device`` (None without a scaler, or disabled); no host read.

    Raises:
        TypeError: ``scaler`` is not a ``torch.amp.GradScaler``.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"fastpipe: scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if not scaler.is_enabled():
        return None
    # scaler.scale() also creates the scale on first use, which scaler.step() relies on.
    return scaler.scale(torch.ones((), device=device))


def loss_scale(scaler: Any, device: torch.device) -> float:
    """The factor by which ``scaler`` scales the loss this step (1.0 without one, or disabled).

    The loss weights are host numbers, so the scale is read once a step; on a GPU that read
    waits for the work queued before it (the previous step's ``scaler.update()``).

    Raises:
        TypeError: ``scaler`` is not a ``torch.amp.GradScaler``.
    """
    scale = _scale_on(scaler, device)
    return 1.0 if scale is None else scale.item()


def _ranks(group: Any) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def distributed_loss_scale(scaler: Any, device: torch.device, runtime: Any) -> float:
    """:func:`loss_scale` for one rank of a ``DistributedPipe``; call it on every rank.

    Raises:
        TypeError: the pipeline (with its replicas) spans several processes and ``scaler`` does
            not skip steps on all of them together (see the module docstring).
        ValueError: the ranks' scalers scale by different factors (the same on every rank).
    """
    scale = _scale_on(scaler, device)
    if scale is None:
        return 1.0  # the common case: no lookups, no collective
    groups = [g for g in (runtime.group, runtime.dp_group) if g is not None]
    needed = set().union(*(_ranks(g) for g in groups))
    if len(needed) == 1:
        return scale.item()
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if not isinstance(scaler, ShardedGradScaler):
        raise TypeError(
            f"fastpipe: a DistributedPipe over ranks {sorted(needed)} needs a scaler that skips a step on every "
            "rank when any rank's gradients overflow; a GradScaler per rank would step the other stages alone. "
            "Use torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(device, ..., process_group=...) "
            "with a group that holds all of them (None: the default group)"
        )
    missing = needed - _ranks(scaler.process_group)
    if missing:
        raise ValueError(
            f"fastpipe: the scaler's process_group lacks ranks {sorted(missing)} of this pipeline "
            "(and its data-parallel replicas); skipped steps would not agree across them"
        )
    # Every rank must scale alike, or the losses of one step would mix scales; a check costs one
    # small all-reduce on the host per group, bounded like every other wait, and one read.
    high, low = runtime.agree_max(torch.stack([scale, -scale]).double(), "the loss scale check").tolist()
    low = -low
    if high != low:
        raise ValueError(
            f"fastpipe: the ranks' GradScalers scale the loss by different factors ({low:g} to "
            f"{high:g}); create them alike on every rank and step/update them on every rank"
        )
    return high
