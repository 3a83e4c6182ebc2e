"""``DistributedPipe.fit``: the same stream, one process per stage (``torchrun``).

Every rank iterates its own ``batches`` in step (e.g. the same DataLoader with the same
seed): stage 0's rank reads the inputs, the last stage's rank the targets, other ranks only
count. Stage 0's rank decides each window (how many mini-batches, their micro-batch sizes
and the dropout seed) and broadcasts it; the last stage's rank broadcasts the window's
losses, so every rank yields the same losses. Every wait is bounded by the pipe's
``timeout`` and a failing or dead rank makes the others raise
:class:`~fastpipe.PipelineError`, as in ``train_step`` (the runtime's watchdog).

With data parallelism (``dp_group`` or a 2-D ``mesh``) each update first averages its
stage's mini-batch gradient over the replicas (a bucketed all-reduce, bounded like every
other wait), and the yielded losses are the replicas' mean; every replica must iterate as
many mini-batches. With virtual stages (``len(balance)`` a multiple of the ranks, stage s on
rank s % K) the stream is ordered by Megatron's interleaved 1F1B
(:func:`~fastpipe.schedule.multistep.build_multistep` with ``workers``), each stage updating on
its own ``U``; ``chunks`` must then be a multiple of the ranks, as for ``train_step``.

With ``dp_shard="fsdp"`` the replicas shard each stage (:mod:`fastpipe.asynchronous.sharded`): an
update reduce-scatters the stage's mini-batch gradient and steps the optimizer on the shards;
the forwards run on whole weights gathered from the shards, one all-gather per stage and dtype
for the live weights after an update (when a forward reads them) and one per prediction, which
is made on the shards from the sharded optimizer state.

With ``deferred_batch_norm=True`` each rank commits its stage's running statistics per
mini-batch at its update, as :class:`FitRun` does (the runner is the same); under data
parallelism each replica's come from its own share of the batch, as in ``train_step``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import Tensor

from fastpipe.asynchronous.fit_run import FitRun, RunnerFactory
from fastpipe.asynchronous.sharded import clip_shards, sharded_weights
from fastpipe.asynchronous.weights import StageWeights
from fastpipe.asynchronous.window import Window
from fastpipe.distributed.fsdp_step import StageShards
from fastpipe.memory.host_optimizer import HostOptimizer
from fastpipe.runtime.step import LossSpec, StepRunner
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Schedule
from fastpipe.step.microbatch import to_device
from fastpipe.step.rules import microbatch_loss

__all__ = ["DistributedFitRun"]


class DistributedFitRun(FitRun):
    """:class:`FitRun` over a :class:`~fastpipe.DistributedPipe`'s runtime; call ``fit`` on every rank."""

    def __init__(self, pipe: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(pipe, *args, **kwargs)
        self.runtime: Any = pipe.runtime
        replicas = self.runtime.replicas
        self.shards: StageShards | None = replicas if isinstance(replicas, StageShards) else None
        if self.shards is not None and isinstance(self.optimizer, HostOptimizer):
            raise ValueError(
                "fastpipe: fit over stages sharded with dp_shard='fsdp' steps each rank's shards, and HostOptimizer "
                "keeps host copies of whole parameters; give fit the plain optimizer, or use dp_shard='replicate'"
            )

    def _fail(self, exc: BaseException) -> None:
        runtime = self.runtime
        stages = ",".join(str(s) for s in self.stages)
        runtime.watchdog.fail(f"rank {runtime.global_rank} (stage {stages}) raised {type(exc).__name__}: {exc}")

    def _gather(self) -> Window | None:
        runtime = self.runtime
        first, last = runtime.rank == runtime.first_rank, runtime.rank == runtime.last_rank
        runtime.watchdog.check()
        head = torch.zeros(3, dtype=torch.int64)
        window: Window | None = None
        if first:
            try:
                window = super()._gather()
            except BaseException as exc:
                self._fail(exc)
                raise
            if window is not None:
                head = torch.tensor([window.minibatches, window.microbatches, window.seed], dtype=torch.int64)
        n, m, seed = (int(v) for v in self.runtime.broadcast(head, runtime.first_rank, "the window's shape"))
        if n == 0:
            return None
        sizes = torch.tensor(window.sizes if window is not None else [0] * (n * m), dtype=torch.int64)
        sizes_list = [int(v) for v in self.runtime.broadcast(sizes, runtime.first_rank, "the micro-batch sizes")]
        if first:
            assert window is not None
            if last:
                return window
            return Window(n, m, seed, window.inputs, [None] * (n * m), sizes_list, window.factors, window.side)
        targets: list[Any] = []
        side: list[dict[str, Any]] = []
        try:
            for j in range(n):
                item = next(self._it, None)
                if item is None:
                    raise ValueError(
                        f"fastpipe: rank {runtime.global_rank}'s batches ran out before stage 0's; "
                        "every rank must iterate as many mini-batches (e.g. the same DataLoader)"
                    )
                mine = sizes_list[j * m : (j + 1) * m]
                if last:
                    _, ts, got, sd = self._split(item, need_input=False)
                    if got != mine:
                        raise ValueError(f"fastpipe: target micro-batch sizes {got} differ from the input's {mine}")
                    targets += ts
                    side += sd
                else:
                    side += self._split_side(self._unpack(item)[2], mine)
            if not last:
                targets = [None] * (n * m)
            factors = [
                f
                for j in range(n)
                for f in self._factors(targets[j * m : (j + 1) * m], sizes_list[j * m : (j + 1) * m])
            ]
        except BaseException as exc:
            self._fail(exc)
            raise
        return Window(n, m, seed, [], targets, sizes_list, factors, side if any(side) else [])

    def _execute(self, schedule: Schedule, window: Window, make_runner: RunnerFactory) -> list[Tensor]:
        runtime, pipe = self.runtime, cast(Any, self.pipe)
        made: list[StepRunner] = []

        def factory(*args: Any) -> StepRunner:
            made.append(make_runner(*args))
            return made[-1]

        pipe.last_timeline = runtime.start_timeline(bool(self.trace))
        first, last = runtime.rank == runtime.first_rank, runtime.rank == runtime.last_rank
        # The transport hands stage 0's input on as it comes: put it on this rank's device first.
        inputs = [to_device(v, self.stages[0].device) for v in window.inputs] if first else None
        if self.shards is not None:
            self.shards.begin_fit()
        try:
            runtime.train(
                schedule,
                inputs,
                LossSpec(microbatch_loss(self.loss_fn, window.targets), window.targets, window.factors),
                checkpoint=lambda i: False,
                caller=CallerState.capture(),
                step_seed=window.seed,
                runner_factory=factory,
                side=window.side,
            )
        finally:
            if self.shards is not None:
                self.shards.end()
        buf = torch.zeros(window.minibatches, dtype=torch.float64)
        dtype = torch.get_default_dtype()
        if last:
            losses = window.losses(made[0].results)
            buf = torch.stack(losses).double()
            dtype = losses[0].dtype
        buf = runtime.broadcast(buf, runtime.last_rank, "the window's losses")
        if runtime.dp_group is not None:
            buf = runtime.dp_mean(buf, "the data-parallel loss all-reduce")
        return [v.to(dtype) for v in buf]

    def _stage_weights(self, stage: int, lags: dict[int, int], m: int, lrs: list[list[float]]) -> StageWeights:
        if self.shards is None:
            return super()._stage_weights(stage, lags, m, lrs)
        params = self.stages[stage].params
        predict = self._predictor(params, lrs)
        return sharded_weights(self.shards, stage, self.consistency, lags, m, predict, self._pools[stage])

    def _clip(self, params: list[Any], max_norm: float) -> None:
        if self.shards is None:
            super()._clip(params, max_norm)
        else:
            clip_shards(params, max_norm, self.runtime.dp_mean, self.shards.size)

    def _apply(self, stage: int, grads: Sequence[Tensor | None], lrs: list[float]) -> None:
        """Average the stage's mini-batch gradient over the data-parallel replicas (sharded: into this
        rank's shard of it), then step."""
        runtime = self.runtime
        if self.shards is not None:
            grads = self.shards.reduce_scatter(stage, list(grads))
        elif runtime.dp_group is not None:
            grads = list(grads)  # unused parameters get zeros: the replicas must agree on the layout
            runtime.reduce_stage_grads(stage, grads)
        super()._apply(stage, grads, lrs)
