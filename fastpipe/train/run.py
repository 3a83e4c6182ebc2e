"""``fastpipe train``: a character-level GPT on the standard library's sources, through ``Pipe``.

``--model`` picks fastpipe's own GPT (the default) or a HuggingFace GPT-2 or Llama of the
same size, cut by ``fastpipe.hf`` (see :mod:`.models`).

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
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

from fastpipe.asynchronous import FitRun, fit
from fastpipe.pipe import Pipe
from fastpipe.schedule import Schedule
from fastpipe.schedule.multistep import build_multistep
from fastpipe.trace import Timeline
from fastpipe.train.evaluate import evaluate, sample_text
from fastpipe.train.loop import fit_losses, step_scheduler, sync_losses, traced_window
from fastpipe.train.meter import ActivationMeter
from fastpipe.train.models import TrainModel, build_model
from fastpipe.train.options import (
    ASYNC,
    CURVE_KEYS,
    STEP_RUNNERS,
    StepRunner,
    TrainError,
    add_arguments,
    check_arguments,
)
from fastpipe.train.report import write_report
from fastpipe.train.resume import check_compatible, load_run, save_run
from fastpipe.train.textdata import Corpus, load_corpus, unigram_entropy

__all__ = ["lr_at", "main", "run"]


def lr_at(step: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then ``1/sqrt`` decay: a function of the step alone, so runs extend and resume."""
    n = step + 1
    return peak * min(n / max(warmup, 1), math.sqrt(max(warmup, 1) / n))


@dataclass
class _Job:
    """What a run builds before its first step (see :func:`_build`)."""

    args: argparse.Namespace
    runner: StepRunner | None  # None: --schedule async, through fit
    virtual: int  # pipeline stages per worker
    devices: list[torch.device]  # one per pipeline stage
    autocast: Callable[[], Any]
    corpus: Corpus
    pipe: Pipe
    model: TrainModel
    loss_fn: Any  # loss_fn(output, target) of train_step
    logits: Callable[[Tensor], Tensor]  # the logits of an output position (sampling)
    opt: torch.optim.Optimizer
    settings: dict[str, Any]  # saved with a checkpoint and written to the report

    @property
    def first(self) -> torch.device:
        """Where the inputs go: the first stage's device."""
        return self.devices[0]

    @property
    def last(self) -> torch.device:
        """Where the targets go: the last stage's device."""
        return self.devices[(len(self.devices) - 1) % self.args.stages]

    @property
    def tokens(self) -> int:
        """Characters per step."""
        return self.args.batch * self.args.seq_len

    def batches(self, start: int, stop: int) -> Iterator[tuple[Tensor, Tensor]]:
        """The training batches of steps ``start`` to ``stop``, on the first and the last stage's device."""
        args = self.args
        for step in range(start, stop):  # the data of step n is a function of n: resumes need no data state
            x, y = self.corpus.batch("train", args.batch, args.seq_len, args.seed, step)
            yield x.to(self.first), self.model.targets(x, y).to(self.last)

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


def _placement(gpus: int, stages: int, virtual: int) -> tuple[list[torch.device], Callable[[], Any]]:
    """Each pipeline stage's device, and the autocast the steps run under (bf16 on GPUs)."""
    if gpus:
        devices = [torch.device("cuda", i % gpus) for i in range(stages * virtual)]
        autocast: Callable[[], Any] = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        devices = [torch.device("cpu")] * (stages * virtual)
        autocast = contextlib.nullcontext
        torch.set_num_threads(1)  # one core per stage worker
    # Interleaved: stage s runs on worker s % workers, so devices follow the workers.
    return [devices[s % stages] for s in range(stages * virtual)], autocast


def _settings(args: argparse.Namespace, model: dict[str, Any], streamed: bool) -> dict[str, Any]:
    """The run's configuration; a resumed run must keep its :data:`~.options.CURVE_KEYS`."""
    settings = {
        "model": model,
        "batch": args.batch,
        "chunks": args.chunks,
        "stages": args.stages,
        "schedule": args.schedule,
        "checkpoint": args.checkpoint,
        "seed": args.seed,
        "lr": args.lr,
        "warmup": args.warmup,
    }
    if streamed:
        settings.update(consistency=args.consistency, window=args.window)
    return settings


def _build(args: argparse.Namespace) -> _Job:
    """Fills in the default stages and layers, checks the flags, and builds the corpus, the Pipe and AdamW."""
    gpus = torch.cuda.device_count()
    args.stages = args.stages if args.stages is not None else (gpus or 2)
    runner, virtual = STEP_RUNNERS.get(args.schedule, (None, 1))
    args.layers = args.layers if args.layers is not None else max(4, args.stages * virtual)
    check_arguments(args, args.layers, virtual)
    devices, autocast = _placement(gpus, args.stages, virtual)

    corpus = load_corpus(args.data, max_chars=args.max_chars)
    model = build_model(args)
    # The asynchronous stream is 1F1B's order without the flush.
    pipe = Pipe(
        model.layers,
        balance=_balance(args.layers, args.stages * virtual, model.tail),
        devices=devices,
        chunks=args.chunks,
        checkpoint=args.checkpoint,
        virtual_stages=virtual,
        schedule="1f1b" if runner is None else args.schedule,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    return _Job(
        args,
        runner,
        virtual,
        devices,
        autocast,
        corpus,
        pipe,
        model,
        model.make_loss(pipe),
        model.make_logits(pipe),
        opt,
        _settings(args, model.settings, streamed=runner is None),
    )


def _start(job: _Job) -> tuple[list[float], int]:
    """Seeds the run; returns the losses so far and the first step: none and 0, or those of ``--resume``."""
    args = job.args
    torch.manual_seed(args.seed)  # the Pipe draws each step's (fit: each window's) dropout seed from this generator
    if not args.resume:
        return [], 0
    record = load_run(args.resume, job.pipe, job.opt)
    check_compatible(record["settings"], job.settings, CURVE_KEYS)
    start_step = int(record["step"])
    if start_step > args.steps:
        raise TrainError(f"--resume {args.resume} is at step {start_step}, past --steps {args.steps}")
    return list(record["history"]), start_step


def _losses(job: _Job, start: int) -> tuple[Iterator[Tensor], FitRun | None]:
    """One loss per step from ``start`` to ``--steps``, and fit's run under ``--schedule async``."""
    args = job.args
    batches = job.batches(start, args.steps)
    if job.runner is not None:
        return sync_losses(job.pipe, job.opt, job.runner, job.loss_fn, batches, start, job.lr, job.autocast), None
    fit_run = fit(
        job.pipe,
        batches,
        job.loss_fn,
        job.opt,
        consistency=args.consistency,
        scheduler=step_scheduler(job.opt, start, job.lr),
        window=args.window,
        trace=False,
    )
    return fit_losses(fit_run, job.autocast), fit_run


def _train(job: _Job, history: list[float], start: int) -> tuple[float | None, FitRun | None]:
    """Trains from step ``start`` to ``--steps``, appending each loss to ``history`` and saving as asked.

    Returns:
        The tokens per second after the first step (``--schedule async``: window), None when no
        step came after it, and fit's run (``--schedule async``) or None.
    """
    args = job.args
    losses, fit_run = _losses(job, start)
    # fit yields a window's losses together: time from the end of the first window (a step for
    # the synchronous schedules), where the process has warmed up, so both count whole windows.
    warm = args.window if job.runner is None else 1
    from tqdm import tqdm

    bar = tqdm(
        range(start, args.steps),
        desc="fastpipe train",
        unit="step",
        initial=start,
        total=args.steps,
        disable=args.no_progress,
        file=sys.stderr,
    )
    timed, timed_steps = 0.0, 0
    for step in bar:
        t0 = time.perf_counter()
        value = float(next(losses))
        elapsed = time.perf_counter() - t0
        if step >= start + warm:
            timed += elapsed
            timed_steps += 1
        history.append(value)
        if not math.isfinite(value):
            raise FloatingPointError(f"the loss is {value} at step {step + 1}; lower --lr")
        bar.set_postfix(loss=f"{value:.3f}", tok_s=f"{job.tokens * timed_steps / timed:,.0f}" if timed else "-")
        done = step + 1
        # Under ASYNC, --save-every and --steps are multiples of --window (see .options): drained points.
        if args.save and (done == args.steps or (args.save_every and done % args.save_every == 0)):
            save_run(args.save, job.pipe, job.opt, done, {"settings": job.settings, "history": history})
    bar.close()
    return (job.tokens * timed_steps / timed if timed else None), fit_run


class _Profile(NamedTuple):
    """The traced extra step of the report."""

    timeline: Timeline
    traced: str  # what it ran, in words
    schedule: str | Schedule  # what the simulator prices with the measured costs
    memory: dict[str, Any]


def _profile(job: _Job, fit_run: FitRun | None) -> _Profile:
    """One more step (ASYNC: window), traced and metered, whose updates are thrown away.

    The timeline and the activation peaks then come from a step like the others without
    changing the run.
    """
    args = job.args
    meter = ActivationMeter(job.pipe.partitions)
    memory: dict[str, Any] = {}
    timeline: Timeline | None
    if job.runner is None:
        traced = f"one window of {args.window} mini-batches, {ASYNC}/{args.consistency} (1F1B stream)"
        simulated: str | Schedule = build_multistep(
            args.stages, args.chunks, args.window, flush=args.consistency == "sync"
        )
        timeline, copies = traced_window(
            job.pipe,
            job.opt,
            job.loss_fn,
            job.batches(args.steps, args.steps + args.window),
            consistency=args.consistency,
            window=args.window,
            start=args.steps,
            lr_at=job.lr,
            context=lambda: _both(meter, job.autocast()),
        )
        assert fit_run is not None
        # Kept at once, per stage: the predicted or stashed weight versions (also among the
        # activations above when a forward saved them for its backward).
        memory["weight_copy_bytes_per_stage"] = [max(fit_run.weight_copy_bytes[s], copies[s]) for s in sorted(copies)]
        memory["weight_copy_bound_per_stage"] = [fit_run.weight_copy_bound[s] for s in sorted(copies)]
    else:
        traced, simulated = f"one step of {args.schedule}", args.schedule
        x, y = next(job.batches(args.steps, args.steps + 1))
        job.opt.zero_grad(set_to_none=True)
        with meter, job.autocast():
            job.runner(job.pipe, x, y, job.loss_fn, True)
        job.opt.zero_grad(set_to_none=True)
        timeline = job.pipe.last_timeline
    assert timeline is not None
    return _Profile(timeline, traced, simulated, {"activation_bytes_per_stage": meter.peaks, **memory})


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains as ``args`` say; returns the report (also written to ``args.out``)."""
    job = _build(args)
    history, start_step = _start(job)
    tokens_per_s, fit_run = _train(job, history, start_step)
    val_loss = evaluate(job.pipe, job.loss_fn, job.corpus, args, job.autocast, job.first, job.last, job.model.targets)
    profile = _profile(job, fit_run)
    sample = sample_text(job.pipe, job.logits, "def ", args.sample_chars, args.seq_len, args.seed)
    memory = profile.memory
    if job.first.type == "cuda":
        memory["max_memory_allocated_per_device"] = {
            str(d): torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(job.devices)
        }
    corpus = job.corpus
    return write_report(
        args.out,
        settings=job.settings,
        history=history,
        start_step=start_step,
        val_loss=val_loss,
        unigram=unigram_entropy(corpus.train, corpus.val),
        tokens_per_s=tokens_per_s,
        timeline=profile.timeline,
        traced=profile.traced,
        schedule=profile.schedule,
        workers=args.stages,
        microbatches=min(args.chunks, args.batch),
        virtual=job.virtual,
        memory=memory,
        sample=sample,
        corpus={
            "root": corpus.root,
            "files": corpus.files,
            "train_chars": len(corpus.train),
            "val_chars": len(corpus.val),
        },
        devices=[str(d) for d in job.devices],
        parameters=sum(p.numel() for p in job.pipe.parameters()),
    )


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
