"""The flags of ``fastpipe train`` and the checks that refuse a combination that cannot run.

:func:`add_arguments` defines the flags (``fastpipe train`` and ``python -m
fastpipe.train.run`` share them); :func:`check_arguments` rejects bad values with a
:class:`TrainError` that says what to change, and fills in the defaults of
``--consistency`` and ``--window`` for ``--schedule async``. :data:`STEP_RUNNERS` maps each
synchronous schedule to how it runs one step.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torch import Tensor

from fastpipe.asynchronous import POLICIES
from fastpipe.pipe import CHECKPOINT_MODES, Pipe
from fastpipe.train.models import HF_MODELS, MODELS, check_model

__all__ = [
    "ASYNC",
    "CURVE_KEYS",
    "DEFAULT_CONSISTENCY",
    "DEFAULT_WINDOW",
    "RESUME_AUTO",
    "STEP_RUNNERS",
    "StepRunner",
    "TrainError",
    "add_arguments",
    "check_arguments",
]

# (pipe, x, y, loss_fn, trace) -> loss; pipe: a Pipe, or a DistributedPipe whose x or y may be None
StepRunner = Callable[..., Tensor]


def _train_step(name: str, virtual_stages: int = 1) -> StepRunner:
    def step(pipe: Pipe, x: Tensor, y: Tensor, loss_fn: Any, trace: bool) -> Tensor:
        return pipe.train_step(x, y, loss_fn, schedule=name, virtual_stages=virtual_stages, trace=trace)

    return step


# How each synchronous --schedule runs one step, and its stages per worker. The
# asynchronous schedule (ASYNC) is not a step: fastpipe.asynchronous.fit owns the optimizer
# step and yields one loss per mini-batch (see fastpipe.train.loop).
STEP_RUNNERS: dict[str, tuple[StepRunner, int]] = {
    "gpipe": (_train_step("gpipe"), 1),
    "1f1b": (_train_step("1f1b"), 1),
    "interleaved": (_train_step("interleaved", 2), 2),
    "zb-h1": (_train_step("zb-h1"), 1),
}
ASYNC = "async"  # XPipe-style streams of mini-batches without a flush, in windows
DEFAULT_CONSISTENCY = "predict"
DEFAULT_WINDOW = 10
RESUME_AUTO = "auto"

# Settings that change the loss curve: a resumed run must keep them.
CURVE_KEYS = (
    "model",
    "batch",
    "chunks",
    "stages",
    "schedule",
    "checkpoint",
    "seed",
    "lr",
    "warmup",
    "consistency",
    "window",
    "data_parallel",
)


class TrainError(ValueError):
    """A flag combination that cannot run; the message says what to change."""


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
        choices=[*STEP_RUNNERS, ASYNC],
        help=f"pipeline schedule; {ASYNC}: mini-batches stream without a flush and each stage updates "
        "its weights as soon as it has its gradient (XPipe), through fastpipe.asynchronous.fit",
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
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step (per replica)")
    p.add_argument(
        "--checkpoint",
        default="never",
        choices=CHECKPOINT_MODES,
        help="recompute activations in backward instead of keeping them",
    )
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
            f"--stages {args.stages} with schedule {args.schedule!r} needs {args.stages * virtual} "
            f"pipeline stages but the model has {layers} transformer blocks; raise --layers to at least "
            f"{args.stages * virtual} or lower --stages"
        )
    if args.schedule == "interleaved" and args.chunks % args.stages:
        raise TrainError(
            f"--schedule interleaved needs --chunks to be a multiple of --stages ({args.stages}); got {args.chunks}"
        )
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
            "--schedule (1f1b, gpipe, interleaved, zb-h1)"
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
