"""``fastpipe train``: a character-level GPT on the standard library's sources, through ``Pipe``.

On a GPU host every visible GPU holds one stage (bf16 autocast); otherwise 2 CPU stages run
one thread each. Per step it logs the loss; at the end it evaluates the validation loss
against the unigram baseline, profiles one more (untrained) step with a timeline and the
activation meter, samples some text, and writes the report (see :mod:`.report`).

``--schedule async`` trains through :func:`fastpipe.asynchronous.fit` instead of one
``train_step`` per step; both feed the same loop (:mod:`.loop`).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fastpipe.asynchronous import POLICIES, fit
from fastpipe.pipe import CHECKPOINT_MODES, Pipe
from fastpipe.schedule.multistep import build_multistep
from fastpipe.trace import Timeline
from fastpipe.train.loop import fit_losses, step_scheduler, sync_losses, traced_window
from fastpipe.train.meter import ActivationMeter
from fastpipe.train.model import GPTConfig, LMHead, LMLoss, build_gpt
from fastpipe.train.report import write_report
from fastpipe.train.resume import check_compatible, load_run, save_run
from fastpipe.train.textdata import VOCAB, Corpus, decode, encode, load_corpus, unigram_entropy

__all__ = ["ASYNC", "add_arguments", "run", "STEP_RUNNERS", "TrainError"]

StepRunner = Callable[[Pipe, Tensor, Tensor, LMLoss, bool], Tensor]


def _train_step(name: str, virtual_stages: int = 1) -> StepRunner:
    def step(pipe: Pipe, x: Tensor, y: Tensor, loss_fn: LMLoss, trace: bool) -> Tensor:
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

# Settings that change the loss curve: a resumed run must keep them.
_CURVE_KEYS = (
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
)


class TrainError(ValueError):
    """A flag combination that cannot run; the message says what to change."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``fastpipe train`` flags."""
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
    p.add_argument("--chunks", type=int, default=4, help="micro-batches per step")
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
    p.add_argument("--resume", default=None, metavar="DIR", help="continue the run saved in DIR")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches at the end")
    p.add_argument("--sample-chars", type=int, default=240, help="characters of sampled text")
    p.add_argument(
        "--data", default=None, metavar="DIR", help="read the .py files of DIR instead of the standard library"
    )
    p.add_argument("--max-chars", type=int, default=None, help="read at most this many training characters")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then ``1/sqrt`` decay: a function of the step alone, so runs extend and resume."""
    n = step + 1
    return peak * min(n / max(warmup, 1), math.sqrt(max(warmup, 1) / n))


def _check(args: argparse.Namespace, layers: int, virtual: int) -> None:
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


def _balance(layers: int, stages: int) -> list[int]:
    """Blocks spread evenly (extra ones to the later stages); the embedding joins the first
    stage and the head the last, both much cheaper than a block."""
    base, extra = divmod(layers, stages)
    counts = [base + (1 if i >= stages - extra else 0) for i in range(stages)]
    counts[0] += 1
    counts[-1] += 1
    return counts


def _forward_layers(pipe: Pipe, x: Tensor) -> Tensor:
    """The model's output through each stage in turn, in this thread (sampling, one sequence)."""
    for stage, device in zip(pipe.partitions, pipe.devices):
        x = stage(x.to(device))
    return x


@torch.no_grad()
def sample_text(pipe: Pipe, head: LMHead, prompt: str, chars: int, seq_len: int, seed: int) -> str:
    """``chars`` characters after ``prompt``, drawn at temperature 0.8 from the model."""
    g = torch.Generator().manual_seed(seed)
    ids = encode(prompt)[None]
    was_training = pipe.training
    pipe.eval()  # no dropout while sampling
    try:
        for _ in range(chars):
            h = _forward_layers(pipe, ids[:, -seq_len:])
            logits = head.logits(h[:, -1].float()).float().cpu()
            nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g)
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        pipe.train(was_training)
    return prompt + decode(ids[0, len(prompt) :])


@torch.no_grad()
def evaluate(
    pipe: Pipe,
    loss_fn: LMLoss,
    corpus: Corpus,
    args: argparse.Namespace,
    autocast: Any,
    first: torch.device,
    last: torch.device,
) -> float:
    """Mean validation loss over ``--eval-batches`` fixed batches (the same for every run)."""
    pipe.eval()
    total = 0.0
    for i in range(args.eval_batches):
        x, y = corpus.batch("val", args.batch, args.seq_len, args.seed, i)
        with autocast():
            h = pipe(x.to(first))
            total += float(loss_fn(h, y.to(last)))
    pipe.train()
    return total / args.eval_batches


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains as ``args`` say; returns the report (also written to ``args.out``)."""
    gpus = torch.cuda.device_count()
    args.stages = args.stages if args.stages is not None else (gpus or 2)
    runner, virtual = STEP_RUNNERS.get(args.schedule, (None, 1))
    layers = args.layers if args.layers is not None else max(4, args.stages * virtual)
    args.layers = layers
    _check(args, layers, virtual)
    if gpus:
        devices = [torch.device("cuda", i % gpus) for i in range(args.stages * virtual)]
        autocast: Callable[[], Any] = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        devices = [torch.device("cpu")] * (args.stages * virtual)
        autocast = contextlib.nullcontext
        torch.set_num_threads(1)  # one core per stage worker
    # Interleaved: stage s runs on worker s % workers, so devices follow the workers.
    devices = [devices[s % args.stages] for s in range(args.stages * virtual)]

    corpus = load_corpus(args.data, max_chars=args.max_chars)
    cfg = GPTConfig(VOCAB, args.seq_len, layers, args.dim, args.heads, args.dropout)
    # The asynchronous stream is 1F1B's order without the flush.
    pipe = Pipe(
        build_gpt(cfg, args.seed),
        balance=_balance(layers, args.stages * virtual),
        devices=devices,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
        virtual_stages=virtual,
        schedule="1f1b" if runner is None else args.schedule,
    )
    head = pipe[len(pipe) - 1]
    assert isinstance(head, LMHead)
    loss_fn = LMLoss(head)
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    settings = {
        "model": cfg.to_dict(),
        "batch": args.batch,
        "chunks": args.chunks,
        "stages": args.stages,
        "schedule": args.schedule,
        "checkpoint": args.checkpoint,
        "seed": args.seed,
        "lr": args.lr,
        "warmup": args.warmup,
    }
    if runner is None:
        settings.update(consistency=args.consistency, window=args.window)
    history: list[float] = []
    start_step = 0
    torch.manual_seed(args.seed)  # the Pipe draws each step's (fit: each window's) dropout seed from this generator
    if args.resume:
        record = load_run(args.resume, pipe, opt)
        check_compatible(record["settings"], settings, _CURVE_KEYS)
        history = list(record["history"])
        start_step = int(record["step"])
        if start_step > args.steps:
            raise TrainError(f"--resume {args.resume} is at step {start_step}, past --steps {args.steps}")

    first, last = devices[0], devices[(len(devices) - 1) % args.stages]
    tokens = args.batch * args.seq_len

    def batches(start: int, stop: int) -> Iterator[tuple[Tensor, Tensor]]:
        for step in range(start, stop):  # the data of step n is a function of n: resumes need no data state
            x, y = corpus.batch("train", args.batch, args.seq_len, args.seed, step)
            yield x.to(first), y.to(last)

    def lr(step: int) -> float:
        return lr_at(step, args.lr, args.warmup)

    fit_run = None
    if runner is None:
        fit_run = fit(
            pipe,
            batches(start_step, args.steps),
            loss_fn,
            opt,
            consistency=args.consistency,
            scheduler=step_scheduler(opt, start_step, lr),
            window=args.window,
            trace=False,
        )
        losses = fit_losses(fit_run, autocast)
    else:
        losses = sync_losses(pipe, opt, runner, loss_fn, batches(start_step, args.steps), start_step, lr, autocast)
    # fit yields a window's losses together: time from the end of the first window (a step for
    # the synchronous schedules), where the process has warmed up, so both count whole windows.
    warm = args.window if runner is None else 1
    from tqdm import tqdm

    bar = tqdm(
        range(start_step, args.steps),
        desc="fastpipe train",
        unit="step",
        initial=start_step,
        total=args.steps,
        disable=args.no_progress,
        file=sys.stderr,
    )
    timed, timed_steps = 0.0, 0
    for step in bar:
        t0 = time.perf_counter()
        value = float(next(losses))
        elapsed = time.perf_counter() - t0
        if step >= start_step + warm:
            timed += elapsed
            timed_steps += 1
        history.append(value)
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss is {value} at step {step + 1}; lower --lr")
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{tokens * timed_steps / timed:,.0f}" if timed else "-")
        done = step + 1
        # Under ASYNC, --save-every and --steps are multiples of --window (see _check_async): drained points.
        if args.save and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            save_run(args.save, pipe, opt, done, {"settings": settings, "history": history})
    bar.close()

    val_loss = evaluate(pipe, loss_fn, corpus, args, autocast, first, last)
    # One more step (ASYNC: window), traced and metered, whose updates are thrown away: the
    # timeline and the activation peaks come from a step like the others without changing the run.
    meter = ActivationMeter(pipe.partitions)
    memory: dict[str, Any] = {}
    timeline: Timeline | None
    if runner is None:
        traced = f"one window of {args.window} mini-batches, {ASYNC}/{args.consistency} (1F1B stream)"
        simulated: Any = build_multistep(args.stages, args.chunks, args.window, flush=args.consistency == "sync")
        timeline, copies = traced_window(
            pipe,
            opt,
            loss_fn,
            batches(args.steps, args.steps + args.window),
            consistency=args.consistency,
            window=args.window,
            start=args.steps,
            lr_at=lr,
            context=lambda: _both(meter, autocast()),
        )
        assert fit_run is not None
        # Kept at once, per stage: the predicted or stashed weight versions (also among the
        # activations above when a forward saved them for its backward).
        memory["weight_copy_bytes_per_stage"] = [max(fit_run.weight_copy_bytes[s], copies[s]) for s in sorted(copies)]
        memory["weight_copy_bound_per_stage"] = [fit_run.weight_copy_bound[s] for s in sorted(copies)]
    else:
        traced, simulated = f"one step of {args.schedule}", args.schedule
        x, y = next(batches(args.steps, args.steps + 1))
        opt.zero_grad(set_to_none=True)
        with meter, autocast():
            runner(pipe, x, y, loss_fn, True)
        opt.zero_grad(set_to_none=True)
        timeline = pipe.last_timeline
    assert timeline is not None
    memory = {"activation_bytes_per_stage": meter.peaks, **memory}
    sample = sample_text(pipe, head, "def ", args.sample_chars, args.seq_len, args.seed)
    if gpus:
        memory["max_memory_allocated_per_device"] = {
            str(d): torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(devices)
        }
    return write_report(
        args.out,
        settings=settings,
        history=history,
        start_step=start_step,
        val_loss=val_loss,
        unigram=unigram_entropy(corpus.train, corpus.val),
        tokens_per_s=tokens * timed_steps / timed if timed else None,
        timeline=timeline,
        traced=traced,
        schedule=simulated,
        workers=args.stages,
        microbatches=min(args.chunks, args.batch),
        virtual=virtual,
        memory=memory,
        sample=sample,
        corpus={
            "root": corpus.root,
            "files": corpus.files,
            "train_chars": len(corpus.train),
            "val_chars": len(corpus.val),
        },
        devices=[str(d) for d in devices],
        parameters=sum(p.numel() for p in pipe.parameters()),
    )


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fastpipe.train.run``: the same as ``fastpipe train``."""
    parser = argparse.ArgumentParser(prog="fastpipe train", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"fastpipe train: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
