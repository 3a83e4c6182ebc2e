"""``fastpipe train``: a character-level GPT on the standard library's sources, through ``Pipe``.

``--model`` picks fastpipe's own GPT (the default) or a HuggingFace GPT-2 or Llama of the
same size, cut by ``fastpipe.hf`` (see :mod:`.models`).

On a GPU host every visible GPU holds one stage (bf16 autocast); otherwise 2 CPU stages run
one thread each. Started by ``torchrun`` (``torchrun --nproc-per-node N -m fastpipe train``),
each process holds one stage of a ``DistributedPipe`` instead, ``--data-parallel D`` copies of
the pipeline each take ``1/D`` of every batch (``--dp-shard fsdp``: sharding each stage's
state over them with FSDP2), and rank 0 alone prints and writes files (see :mod:`.ranks`).
Per step it logs the loss; at the end it evaluates the validation loss against the unigram
baseline, profiles one more (untrained) step with a timeline and the activation meter,
samples some text, and writes the report (see :mod:`.report`) with each rank's model
state and collectives (:mod:`.state`).

``--schedule async`` trains through :func:`fastpipe.asynchronous.fit` instead of one
``train_step`` per step; both feed the same loop (:mod:`.loop`). ``--save DIR --resume
auto`` continues from DIR's newest complete save or starts afresh (see :mod:`.resume`), so
a job that ``torchrun --max-restarts`` restarts continues where it was.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from fastpipe.asynchronous import FitRun, fit
from fastpipe.train.job import Job, build_job, lr_at
from fastpipe.train.loop import fit_losses, step_scheduler, sync_losses
from fastpipe.train.measure import evaluate_and_sample, profile
from fastpipe.train.options import CURVE_KEYS, RESUME_AUTO, TrainError, add_arguments, saved_settings
from fastpipe.train.ranks import Ranks, join, launched_by_torchrun, leave
from fastpipe.train.report import write_report
from fastpipe.train.resume import check_compatible, has_run, load_run, save_run
from fastpipe.train.state import collectives_unit, measure_bytes, state_table
from fastpipe.train.textdata import unigram_entropy

__all__ = ["lr_at", "main", "run"]


def _start(job: Job) -> tuple[list[float], int]:
    """Seeds the run; returns the losses so far and the first step: none and 0, or those of ``--resume``."""
    args = job.args
    torch.manual_seed(args.seed)  # the Pipe draws each step's (fit: each window's) dropout seed from this generator
    folder = args.save if args.resume == RESUME_AUTO else args.resume
    if not folder or (args.resume == RESUME_AUTO and not has_run(folder)):
        return [], 0
    record = load_run(folder, job.pipe, job.opt)
    check_compatible(saved_settings(record["settings"]), job.settings, CURVE_KEYS)
    start_step = int(record["step"])
    if start_step > args.steps:
        raise TrainError(f"--resume {folder} is at step {start_step}, past --steps {args.steps}")
    return list(record["history"]), start_step


def _losses(job: Job, start: int) -> tuple[Iterator[Tensor], FitRun | None]:
    """One loss per step from ``start`` to ``--steps``, and fit's run under ``--schedule async``."""
    args = job.args
    batches = job.batches(start, args.steps)
    if job.runner is not None:
        losses = sync_losses(job.pipe, job.opt, job.runner, job.loss_fn, batches, start, job.lr, job.autocast)
        return _over_replicas(job, losses), None
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
    return _over_replicas(job, fit_losses(fit_run, job.autocast)), fit_run


def _over_replicas(job: Job, losses: Iterator[Tensor]) -> Iterator[Tensor]:
    """Each step's loss over the whole batch: the replicas' mean under ``--data-parallel``."""
    if job.ranks is None or job.ranks.replicas == 1:
        return losses
    ranks = job.ranks
    return (ranks.mean_over_replicas(loss) for loss in losses)


def _train(job: Job, history: list[float], start: int) -> tuple[float | None, FitRun | None]:
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
        disable=args.no_progress or not job.is_main,
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
            record = {"settings": job.settings, "history": history}
            save_run(args.save, job.pipe, job.opt, done, record, writer=job.is_main)
    bar.close()
    return (job.tokens * timed_steps / timed if timed else None), fit_run


def _run(job: Job) -> dict[str, Any]:
    history, start_step = _start(job)
    tokens_per_s, fit_run = _train(job, history, start_step)
    held = measure_bytes(job)  # before the traced step, which drops the gradients
    evaluated = evaluate_and_sample(job)
    measured = profile(job, fit_run)
    table = state_table(job, held)
    if evaluated is None or measured is None or table is None:  # a torchrun rank other than 0
        return {}
    val_loss, sample, devices, parameters = evaluated
    corpus = job.corpus
    return write_report(
        job.args.out,
        settings=job.settings,
        history=history,
        start_step=start_step,
        val_loss=val_loss,
        unigram=unigram_entropy(corpus.train, corpus.val),
        tokens_per_s=tokens_per_s,
        timeline=measured.timeline,
        traced=measured.traced,
        schedule=measured.schedule,
        workers=job.args.stages,
        microbatches=min(job.args.chunks, job.args.batch // job.args.data_parallel),
        virtual=job.virtual,
        memory=measured.memory,
        sample=sample,
        corpus={
            "root": corpus.root,
            "files": corpus.files,
            "train_chars": len(corpus.train),
            "val_chars": len(corpus.val),
        },
        devices=devices,
        parameters=parameters,
        torchrun=None if job.ranks is None else _launch(job.ranks),
        state={
            "dp_shard": job.settings.get("dp_shard", "replicate"),
            "collectives_per": collectives_unit(job),
            "ranks": table,
        },
    )


def _launch(ranks: Ranks) -> dict[str, int]:
    """Where a torchrun job ran; ``restart`` counts the group's restarts before this attempt."""
    return {
        "world": ranks.world,
        "data_parallel": ranks.replicas,
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Trains as ``args`` say; returns the report (also written to ``args.out``).

    Under torchrun (its ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set) every rank calls it:
    rank 0 returns the report, the others an empty dict.
    """
    if not launched_by_torchrun():
        return _run(build_job(args))
    ranks = join(args.data_parallel, args.stages, sharded=args.dp_shard == "fsdp")
    try:
        job = build_job(args, ranks)
        report = _run(job)
        job.pipe.close()
        return report
    finally:
        leave()


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
