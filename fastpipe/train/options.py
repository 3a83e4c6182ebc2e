"""The flags of ``fastpipe train`` and the checks that refuse a combination that cannot run.

:func:`add_arguments` defines the flags (``fastpipe train`` and ``python -m
fastpipe.train.run`` share them); :func:`check_arguments` rejects bad values with a
:class:`TrainError` that says what to change, and fills in the defaults of
``--consistency`` and ``--window`` for ``--schedule async``. ``--schedule`` takes every
schedule :class:`~fastpipe.Pipe` takes (:data:`SYNC_SCHEDULES`, one ``train_step`` per
step, see :func:`step_runner`) and ``async``; :func:`virtual_stages` says how many stages
each worker holds under it.
"""

from __future__ import annotations

import argparse
from argparse import SUPPRESS
from collections.abc import Callable
from typing import Any

from torch import Tensor

from fastpipe.asynchronous import POLICIES
from fastpipe.distributed.fsdp import DP_SHARDS
from fastpipe.pipe import CHECKPOINT_MODES, Pipe
from fastpipe.schedule import SCHEDULES, ScheduleError, build
from fastpipe.schedule.builders import STAGES_PER_WORKER
from fastpipe.step.auto_schedule import AUTO
from fastpipe.train.models import HF_MODELS, MODELS, check_model

__all__ = [
    "ASYNC",
    "CURVE_KEYS",
    "DEFAULT_CONSISTENCY",
    "DEFAULT_VIRTUAL_STAGES",
    "DEFAULT_WINDOW",
    "RESUME_AUTO",
    "SYNC_SCHEDULES",
    "StepRunner",
    "TrainError",
    "add_arguments",
    "check_arguments",
    "saved_settings",
    "step_runner",
    "virtual_stages",
]

# (pipe, x, y, loss_fn, trace) -> loss; pipe: a Pipe, or a DistributedPipe whose x or y may be None
StepRunner = Callable[..., Tensor]


ASYNC = "async"  # XPipe-style streams of mini-batches without a flush, in windows
DEFAULT_CONSISTENCY = "predict"
DEFAULT_WINDOW = 10
RESUME_AUTO = "auto"

# Every schedule Pipe.train_step runs, one step at a time; "auto" measures the stages at the
# first step and runs the search's choice. The asynchronous schedule (ASYNC) is not a step:
# fastpipe.asynchronous.fit owns the optimizer step and yields one loss per mini-batch (see
# fastpipe.train.loop).
SYNC_SCHEDULES = (*SCHEDULES, AUTO)
#: Stages per worker of each --schedule without --virtual-stages (1 where not named).
DEFAULT_VIRTUAL_STAGES = {**STAGES_PER_WORKER, "interleaved": 2}


def step_runner(schedule: str, virtual: int) -> StepRunner:
    """How one step of the synchronous ``schedule`` runs, ``virtual`` stages to a worker."""

    def step(pipe: Pipe, x: Tensor, y: Tensor, loss_fn: Any, trace: bool) -> Tensor:
        return pipe.train_step(x, y, loss_fn, schedule=schedule, virtual_stages=virtual, trace=trace)

    return step


def virtual_stages(schedule: str, asked: int | None) -> int:
    """Pipeline stages per worker under ``--schedule``: ``--virtual-stages``, else the schedule's own.

    ``fastpipe train`` and ``fastpipe plan`` both take these two flags.

    Raises:
        TrainError: ``--virtual-stages`` that the schedule cannot take.
    """
    own = DEFAULT_VIRTUAL_STAGES.get(schedule, 1)
    if asked is None:
        return own
    if asked < 1:
        raise TrainError(f"--virtual-stages must be >= 1 (stages per worker), got {asked}")
    if asked == own or schedule == "interleaved":
        return int(asked)
    if schedule in STAGES_PER_WORKER:
        raise TrainError(
            f"--schedule {schedule} places {own} stages on each worker in a V (stages w and 2K-1-w on "
            f"worker w); drop --virtual-stages {asked} or pass {own}"
        )
    if schedule == AUTO:
        raise TrainError(f"--schedule {AUTO} picks the stages per worker itself; drop --virtual-stages {asked}")
    holds = "streams a 1F1B order with one stage per worker" if schedule == ASYNC else "runs one stage per worker"
    raise TrainError(
        f"--schedule {schedule} {holds}; --virtual-stages {asked} needs --schedule interleaved "
        f"(any number), zb-v or dualpipev (2)"
    )


# Settings that change the loss curve: a resumed run must keep them.
CURVE_KEYS = (
    "model",
    "batch",
    "chunks",
    "stages",
    "schedule",
    "virtual_stages",
    "recompute",
    "seed",
    "lr",
    "warmup",
    "consistency",
    "window",
    "data_parallel",
)


class TrainError(ValueError):
    """A flag combination that cannot run; the message says what to change."""


def saved_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """A save's settings under this module's keys, to compare with a resumed run's.

    A record may name the recomputation mode ``checkpoint``, as ``Pipe`` does, for ``recompute``.
    """
    if "recompute" not in settings and "checkpoint" in settings:
        return {**settings, "recompute": settings["checkpoint"]}
    return settings


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``fastpipe train`` flags."""
    p.add_argument(
        "--model",
        default=MODELS[0],
        choices=MODELS,
        help="gpt: fastpipe's character GPT; hf-gpt2, hf-llama: a HuggingFace GPT-2 or Llama of the same size, "
        "built from scratch and pipelined through fastpipe.hf with tied embeddings (needs transformers)",
    )
    p.add_argument(
        "--schedule",
        default="1f1b",
        choices=[*SYNC_SCHEDULES, ASYNC],
        help=f"pipeline schedule, as Pipe takes it; zb-v and dualpipev hold 2 stages per worker in a V, "
        f"interleaved 2 (or --virtual-stages); {AUTO}: the fastest schedule simulated on the stages' costs, "
        f"measured at the first step; {ASYNC}: mini-batches stream without a flush and each stage updates "
        "its weights as soon as it has its gradient (XPipe), through fastpipe.asynchronous.fit",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=None,
        metavar="V",
        help="pipeline stages per worker (the model is cut into --stages x V stages): any V >= 1 with "
        "--schedule interleaved (default 2); zb-v and dualpipev take 2; the others 1",
    )
    p.add_argument(
        "--consistency",
        default=None,
        choices=POLICIES,
        help=f"with --schedule {ASYNC}: which weights a micro-batch runs on (default "
        f"{DEFAULT_CONSISTENCY}: XPipe weight prediction; sync flushes every mini-batch)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help=f"with --schedule {ASYNC}: mini-batches between pipeline drains, the only exact save "
        f"points (default {DEFAULT_WINDOW})",
    )
    p.add_argument(
        "--stages", type=int, default=None, help="pipeline workers (default: one per visible GPU, else 2 CPU stages)"
    )
    p.add_argument(
        "--data-parallel",
        type=int,
        default=1,
        metavar="D",
        help="under torchrun: D replicas of the pipeline, each training on 1/D of every --batch "
        "(world = stages x D ranks)",
    )
    p.add_argument(
        "--dp-shard",
        default=DP_SHARDS[0],
        choices=DP_SHARDS,
        help="with --data-parallel D > 1: replicate: every replica holds its whole stage; fsdp: the D "
        "replicas of a stage shard its parameters, gradients and AdamW state with FSDP2, 1/D each "
        "(one all-gather and one reduce-scatter per unit and step); with D = 1 both are the same",
    )
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step (per replica)")
    p.add_argument(
        "--recompute",
        default="never",
        choices=CHECKPOINT_MODES,
        help="recompute activations in backward instead of keeping them (Pipe's checkpoint=): for every "
        "micro-batch, all but the last, or none",
    )
    # Pipe calls recomputation checkpoint=, as torchgpipe does; --save/--resume are checkpoint files.
    p.add_argument("--checkpoint", dest="recompute", choices=CHECKPOINT_MODES, default=SUPPRESS, help=SUPPRESS)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps in all (a resumed run stops here too)")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: max(4, stages))")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability in the blocks")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=30, help="steps of linear warm-up, then 1/sqrt decay")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights, the batches and dropout")
    p.add_argument("--out", default="fastpipe-train", help="folder for the report, plots and trace")
    p.add_argument("--save", default=None, metavar="DIR", help="save a resumable checkpoint here")
    p.add_argument(
        "--save-every", type=int, default=0, metavar="N", help="also save every N steps (0: only at the end)"
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR|auto",
        help=f"continue the run saved in DIR; {RESUME_AUTO}: from --save DIR's newest complete save, "
        "or from scratch if it holds none (a restarted torchrun job continues)",
    )
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end")
    p.add_argument("--sample-chars", type=int, default=240, help="characters of sampled text")
    p.add_argument(
        "--data", default=None, metavar="DIR", help="read the .py files of DIR instead of the standard library"
    )
    p.add_argument("--max-chars", type=int, default=None, help="read at most this many training characters")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def check_arguments(args: argparse.Namespace, layers: int, virtual: int) -> None:
    """Raises :class:`TrainError` unless ``args`` can run; fills in the asynchronous defaults.

    Args:
        args: the parsed flags, ``--stages`` already resolved to a number.
        layers: the model's transformer blocks.
        virtual: pipeline stages per worker of ``--schedule``.
    """
    for name in ("stages", "chunks", "steps", "batch", "seq_len", "dim", "heads", "eval_batches"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.chunks > args.batch:
        raise TrainError(
            f"--chunks {args.chunks} is more than --batch {args.batch}: each micro-batch needs at "
            "least one sequence; lower --chunks or raise --batch"
        )
    if args.stages * virtual > layers:
        raise TrainError(
            f"--stages {args.stages} with --schedule {args.schedule} ({virtual} stages per worker) needs "
            f"{args.stages * virtual} pipeline stages but the model has {layers} transformer blocks; raise "
            f"--layers to at least {args.stages * virtual} or lower --stages"
        )
    if args.schedule == "interleaved" and args.chunks % args.stages:
        raise TrainError(
            f"--schedule interleaved needs --chunks to be a multiple of --stages ({args.stages}); got {args.chunks}"
        )
    if args.schedule in SCHEDULES:
        try:
            build(args.schedule, args.stages, args.chunks, virtual_stages=virtual)
        except ScheduleError as exc:
            raise TrainError(
                f"--schedule {args.schedule} cannot run --stages {args.stages} workers with --chunks "
                f"{args.chunks} micro-batches ({exc}); raise --chunks or lower --stages"
            ) from None
    if args.dim % args.heads:
        raise TrainError(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if not 0.0 <= args.dropout < 1.0:
        raise TrainError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.save_every < 0 or args.warmup < 0 or args.lr <= 0:
        raise TrainError("--save-every and --warmup must be >= 0 and --lr > 0")
    if args.save_every and not args.save:
        raise TrainError("--save-every needs --save DIR")
    if args.resume == RESUME_AUTO and not args.save:
        raise TrainError(f"--resume {RESUME_AUTO} resumes from --save DIR: pass --save DIR too")
    if args.data_parallel < 1:
        raise TrainError(f"--data-parallel must be >= 1, got {args.data_parallel}")
    missing = check_model(args.model)
    if missing:
        raise TrainError(missing)
    if args.model in HF_MODELS and args.schedule == ASYNC and args.stages * virtual > 1:
        raise TrainError(
            f"--model {args.model} ties its embedding across the first and the last stage, and --schedule "
            f"{ASYNC} steps each stage's optimizer on its own, so it cannot keep the tie; pick a synchronous "
            f"--schedule ({', '.join(SYNC_SCHEDULES)})"
        )
    _check_async(args)


def _check_async(args: argparse.Namespace) -> None:
    """Resolves --consistency and --window (only for the asynchronous schedule)."""
    if args.schedule != ASYNC:
        for flag, value in (("--consistency", args.consistency), ("--window", args.window)):
            if value is not None:
                raise TrainError(
                    f"{flag} applies to --schedule {ASYNC} only (the synchronous schedules flush "
                    f"every step); drop it or pass --schedule {ASYNC}"
                )
        return
    args.consistency = args.consistency or DEFAULT_CONSISTENCY
    args.window = DEFAULT_WINDOW if args.window is None else args.window
    if args.window < 1:
        raise TrainError(f"--window must be >= 1 (mini-batches between drains), got {args.window}")
    # Only a drained point is exact, and only the uninterrupted run's drains continue the same curve.
    if args.save_every % args.window:
        raise TrainError(
            f"--save-every {args.save_every} is not a multiple of --window {args.window}: "
            f"--schedule {ASYNC} can save only where the pipeline drains, every --window steps"
        )
    if args.save and args.steps % args.window:
        raise TrainError(
            f"--save with --schedule {ASYNC} needs --steps to be a multiple of --window "
            f"{args.window} (got {args.steps}): the final save must be a window boundary for a "
            "resumed run to continue exactly"
        )
