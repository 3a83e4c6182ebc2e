"""What a ``fastpipe train`` run builds before its first step: corpus, model, pipeline, AdamW.

One process builds a :class:`~fastpipe.Pipe` over its GPUs (or 2 CPU stages); a process that
``torchrun`` started builds its own stage of a :class:`~fastpipe.DistributedPipe` (see
:mod:`.ranks`). Both build the whole model from ``--seed`` first, so every run of the same
settings starts from the same weights, and both feed the same loop (:mod:`.run`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastpipe.distributed_pipe import DistributedPipe
from fastpipe.pipe import Pipe
from fastpipe.schedule.builders import placement_for
from fastpipe.step.auto_schedule import AUTO
from fastpipe.train.models import TrainModel, build_model
from fastpipe.train.options import ASYNC, StepRunner, TrainError, check_arguments, step_runner, virtual_stages
from fastpipe.train.ranks import Ranks
from fastpipe.train.textdata import Corpus, load_corpus

__all__ = ["Job", "build_job", "lr_at", "stage_workers"]


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then ``1/sqrt`` decay: a function of the step alone, so runs extend and resume."""
    n = step + 1
    return peak * min(n / max(warmup, 1), math.sqrt(max(warmup, 1) / n))


@dataclass
class Job:
    """What a run builds before its first step (see :func:`build_job`)."""

    args: argparse.Namespace
    runner: StepRunner | None  # None: --schedule async, through fit
    virtual: int  # pipeline stages per worker
    devices: list[torch.device]  # one per pipeline stage (torchrun: this rank's, once)
    autocast: Callable[[], Any]
    corpus: Corpus
    pipe: Any  # Pipe, or DistributedPipe under torchrun
    model: TrainModel
    loss_fn: Any  # loss_fn(output, target) of train_step
    logits: Callable[[Tensor], Tensor]  # the logits of an output position (sampling)
    opt: torch.optim.Optimizer
    settings: dict[str, Any]  # saved with a checkpoint and written to the report
    ranks: Ranks | None = None  # None: one process

    @property
    def first(self) -> torch.device:
        """Where the inputs go: the first stage's device."""
        return self.devices[0]

    @property
    def last(self) -> torch.device:
        """Where the targets go: the last stage's device (worker 0's in a V)."""
        return self.devices[-1]

    @property
    def tokens(self) -> int:
        """Characters per step (over every replica)."""
        return self.args.batch * self.args.seq_len

    @property
    def is_main(self) -> bool:
        """The process that prints and writes files: the only one, or torchrun's rank 0."""
        return self.ranks is None or self.ranks.is_main

    def batches(self, start: int, stop: int) -> Iterator[tuple[Tensor | None, Tensor | None]]:
        """The training batches of steps ``start`` to ``stop``, on the first and the last stage's device.

        Under torchrun each replica takes its rows of the step's batch; only the first stage's
        rank gets the inputs and only the last stage's the targets (None elsewhere).
        """
        args, ranks = self.args, self.ranks
        for step in range(start, stop):  # the data of step n is a function of n: resumes need no data state
            x, y = self.corpus.batch("train", args.batch, args.seq_len, args.seed, step)
            if ranks is None:
                yield x.to(self.first), self.model.targets(x, y).to(self.last)
                continue
            rows = slice(
                ranks.replica * args.batch // ranks.replicas, (ranks.replica + 1) * args.batch // ranks.replicas
            )
            x, y = x[rows], y[rows]
            yield (
                x.to(self.first) if self.pipe.is_first else None,
                self.model.targets(x, y).to(self.last) if self.pipe.is_last else None,
            )

    def lr(self, step: int) -> float:
        """The learning rate of ``step``."""
        return lr_at(step, self.args.lr, self.args.warmup)


def _balance(layers: int, stages: int, tail: int = 1) -> list[int]:
    """Blocks spread evenly (extra ones to the later stages); the embedding joins the first
    stage and the ``tail`` layers after the blocks (norm, head) the last, all much cheaper
    than a block."""
    base, extra = divmod(layers, stages)
    counts = [base + (1 if i >= stages - extra else 0) for i in range(stages)]
    counts[0] += 1
    counts[-1] += tail
    return counts


def _placement(gpus: int, schedule: str, stages: int, virtual: int) -> tuple[list[torch.device], Callable[[], Any]]:
    """Each pipeline stage's device, and the autocast the steps run under (bf16 on GPUs).

    ``stages`` workers, one device each; the schedule places ``virtual`` stages on each: round
    robin (stage s on worker s % stages), or in a V for zb-v and dualpipev (stages w and
    2K-1-w on worker w).
    """
    if gpus:
        workers = [torch.device("cuda", i % gpus) for i in range(stages)]
    else:
        workers = [torch.device("cpu")] * stages
        torch.set_num_threads(1)  # one core per stage worker
    return [workers[w] for w in stage_workers(schedule, stages, virtual)], _autocast(workers[0])


def stage_workers(schedule: str, stages: int, virtual: int) -> tuple[int, ...]:
    """The worker (torchrun: pipeline rank) of each pipeline stage under ``schedule``."""
    return placement_for(schedule, stages * virtual, stages)


def _autocast(device: torch.device) -> Callable[[], Any]:
    if device.type == "cuda":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _settings(args: argparse.Namespace, model: dict[str, Any], streamed: bool) -> dict[str, Any]:
    """The run's configuration; a resumed run must keep its :data:`~.options.CURVE_KEYS`."""
    settings = {
        "model": model,
        "batch": args.batch,
        "chunks": args.chunks,
        "stages": args.stages,
        "schedule": args.schedule,
        "recompute": args.recompute,
        "seed": args.seed,
        "lr": args.lr,
        "warmup": args.warmup,
    }
    if args.virtual_stages is not None:  # else the schedule's own, which the schedule says
        settings["virtual_stages"] = args.virtual_stages
    if args.data_parallel > 1:  # the replicas' mean rounds otherwise than one batch's
        settings["data_parallel"] = args.data_parallel
    if streamed:
        settings.update(consistency=args.consistency, window=args.window)
    return settings


def _distributed_step(pipe: DistributedPipe, x: Tensor, y: Tensor, loss_fn: Any, trace: bool) -> Tensor:
    """One step of the schedule the DistributedPipe was built with."""
    return pipe.train_step(x, y, loss_fn, trace=trace)


def build_job(args: argparse.Namespace, ranks: Ranks | None = None) -> Job:
    """Fills in the default stages and layers, checks the flags, and builds the corpus, the pipeline and AdamW.

    Args:
        args: the parsed flags.
        ranks: this process's place under torchrun (then its stage of a DistributedPipe), or
            None for one process (a Pipe over the host's GPUs or 2 CPU stages).
    """
    gpus = torch.cuda.device_count()
    if ranks is not None:
        args.stages = ranks.stages
    elif args.data_parallel != 1:
        raise TrainError(
            f"--data-parallel {args.data_parallel} needs a process per replica: launch with torchrun "
            f"--nproc-per-node <stages x {args.data_parallel}> -m fastpipe train ..."
        )
    if ranks is not None and args.schedule == AUTO:
        raise TrainError(
            f"--schedule {AUTO} measures every stage in one process, and under torchrun each rank holds only its "
            "own; pick a named --schedule there (fastpipe plan --schedule auto shows which is fastest)"
        )
    args.stages = args.stages if args.stages is not None else (gpus or 2)
    virtual = virtual_stages(args.schedule, args.virtual_stages)
    runner = None if args.schedule == ASYNC else step_runner(args.schedule, virtual)
    args.layers = args.layers if args.layers is not None else max(4, args.stages * virtual)
    check_arguments(args, args.layers, virtual)
    if args.batch % args.data_parallel or args.chunks > args.batch // args.data_parallel:
        raise TrainError(
            f"--batch {args.batch} must split into --data-parallel {args.data_parallel} equal shares of at "
            f"least --chunks {args.chunks} sequences each"
        )
    model = build_model(args)
    balance = _balance(args.layers, args.stages * virtual, model.tail)
    # The asynchronous stream is 1F1B's order without the flush.
    schedule = "1f1b" if runner is None else args.schedule
    pipe: Pipe | DistributedPipe
    if ranks is None:
        devices, autocast = _placement(gpus, schedule, args.stages, virtual)
        pipe = Pipe(
            model.layers,
            balance=balance,
            devices=devices,
            chunks=args.chunks,
            checkpoint=args.recompute,
            virtual_stages=virtual,
            schedule=schedule,
        )
        loss_fn, logits = model.make_loss(pipe), model.make_logits(pipe)
    else:
        devices, autocast = [ranks.device], _autocast(ranks.device)
        groups: dict[str, Any] = (
            {"process_group": ranks.pipeline, "dp_group": ranks.replicas_group}
            if ranks.mesh is None
            else {"mesh": ranks.mesh, "dp_shard": "fsdp"}
        )
        pipe = DistributedPipe(
            model.layers,
            balance,
            chunks=args.chunks,
            schedule=schedule,
            checkpoint=args.recompute,
            device=ranks.device,
            **groups,
        )
        # The Sequential keeps the layer objects the DistributedPipe holds (others' on meta):
        # the loss reads the head's weight on the last rank, the only one that calls it.
        loss_fn, logits = model.make_loss(model.layers), model.make_logits(model.layers)
        if runner is not None:
            runner = _distributed_step
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    settings = _settings(args, model.settings, streamed=runner is None)
    if ranks is not None and ranks.mesh is not None:  # with one replica there is nothing to shard
        settings["dp_shard"] = "fsdp"
    # Read after the pipeline is built, so that a refused combination costs no corpus.
    corpus = load_corpus(args.data, max_chars=args.max_chars)
    return Job(args, runner, virtual, devices, autocast, corpus, pipe, model, loss_fn, logits, opt, settings, ranks)
