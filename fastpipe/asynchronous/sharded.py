"""``fit`` on stages sharded over their data-parallel replicas (``DistributedPipe(dp_shard="fsdp")``).

Between updates each rank holds its shards of a stage's parameters and optimizer state, and
the forwards and backwards of a window run on whole weights, gathered from the shards::

    live weights     whole-size buffers, all-gathered from the shards when a forward first reads
                     them after an update (under ``stale`` at the update itself: a backward reads
                     the live weights of its own time); an update no forward follows gathers nothing
    predict          Ŵ = W - Σ lr · Δ computed on this rank's shards (the optimizer state is
                     sharded as W is: no state moves), then Ŵ all-gathered into a pooled buffer
    stash            the live buffers of a version still in use are kept; new ones are gathered
    update (U)       the whole-size gradient sum reduce-scattered into the shards' .grad
                     (averaged over the replicas), the optimizer stepped on the shards

Gathering the prediction, not the optimizer state, moves one tensor of the weights' size where
the state would be two (Adam's moments). Each collective is one per stage and dtype, waited
through the runtime's watchdog (:class:`~fastpipe.distributed.fsdp_step.StageShards`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from fastpipe.asynchronous.weights import Predictor, StageWeights
from fastpipe.distributed.fsdp_step import StageShards

__all__ = ["clip_shards", "sharded_weights"]


def sharded_weights(
    shards: StageShards,
    stage: int,
    policy: str,
    lags: Mapping[int, int],
    minibatch_size: int,
    predict_shard: Predictor,
    pool: list[list[Tensor]],
) -> StageWeights:
    """The :class:`StageWeights` of one sharded stage for one window.

    Args:
        shards: this rank's sharded stages and their collectives.
        stage: the stage.
        policy, lags, minibatch_size, pool: as for :class:`StageWeights` (the pool holds whole-size buffers).
        predict_shard: the prediction of this rank's shards (``FitRun``'s predictor over the shards).
    """
    params = shards.stages[stage].params
    live = [torch.empty(p.shape, dtype=p.dtype, device=p.device) for p in params]
    scratch: list[Sequence[Tensor] | None] = [None]  # this rank's rows of the last prediction, reused

    def refresh() -> None:
        shards.gather(stage, [_local(p) for p in params], live)

    def predict(version: int, lag: int, out: Sequence[Tensor] | None) -> Sequence[Tensor]:
        mine = scratch[0] = predict_shard(version, lag, scratch[0])
        return shards.gather(stage, list(mine), None if out is None else list(out))

    return StageWeights(live, policy, lags, minibatch_size, predict, pool, refresh)


def clip_shards(params: Sequence[Tensor], max_norm: float, dp_mean: Callable[[Tensor, str], Tensor], d: int) -> None:
    """Scale a sharded stage's gradients (DTensor shards) to a whole norm of at most ``max_norm``.

    The norm's square is this rank's sum of squares summed over the ``d`` replicas, through
    ``dp_mean`` (the runtime's bounded mean over the replicas); the scale is
    ``torch.nn.utils.clip_grad_norm_``'s.
    """
    grads = [_local(p.grad) for p in params if p.grad is not None]
    squares = [g.detach().double().square().sum() for g in grads]
    mine = (torch.stack(squares).sum() if squares else torch.zeros(())).double().cpu().reshape(1)  # one device sync
    total = float((dp_mean(mine, "the sharded gradient norm all-reduce") * d).sqrt())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(scale)


def _local(t: Any) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
