"""What ``fastpipe train`` measures after its last step, for the report.

:func:`profile` runs one more step (``--schedule async``: window) traced and metered, whose
updates are thrown away; under torchrun every rank traces its own stages and rank 0 merges
the pipeline's rows. :func:`evaluate_and_sample` computes the validation loss and a text
sample; under torchrun rank 0 gathers the trained weights into a one-stage ``Pipe`` of the
whole model first (the ranks' clocks are one host's, or each host's, in the merged trace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from fastpipe.asynchronous import FitRun
from fastpipe.pipe import Pipe
from fastpipe.schedule import Schedule
from fastpipe.schedule.multistep import build_multistep
from fastpipe.step.auto_schedule import AUTO
from fastpipe.trace.timeline import Timeline
from fastpipe.train.evaluate import evaluate, sample_text
from fastpipe.train.job import Job, stage_workers
from fastpipe.train.loop import traced_window
from fastpipe.train.meter import ActivationMeter
from fastpipe.train.models import build_model
from fastpipe.train.options import ASYNC

__all__ = ["Profile", "evaluate_and_sample", "profile"]


class Profile(NamedTuple):
    """The traced extra step of the report (rank 0's under torchrun; None on the other ranks)."""

    timeline: Timeline
    traced: str  # what it ran, in words
    schedule: str | Schedule  # what the simulator prices with the measured costs
    memory: dict[str, Any]


def _stages(job: Job) -> dict[int, torch.nn.Module]:
    """The pipeline stages this process runs, by index."""
    if job.ranks is None:
        return dict(enumerate(job.pipe.partitions))
    return dict(job.pipe.stages)


def profile(job: Job, fit_run: FitRun | None) -> Profile | None:
    """One more step (ASYNC: window), traced and metered, whose updates are thrown away.

    The timeline and the activation peaks then come from a step like the others without
    changing the run. Call it on every rank under torchrun; rank 0 gets the pipeline's.
    """
    args = job.args
    stages = _stages(job)
    meter = ActivationMeter(list(stages.values()))
    copies: dict[int, int] = {}
    bound: dict[int, int] = {}
    if job.runner is None:
        traced = f"one window of {args.window} mini-batches, {ASYNC}/{args.consistency} (1F1B stream)"
        simulated: str | Schedule = build_multistep(
            args.stages, args.chunks, args.window, flush=args.consistency == "sync"
        )
        timeline, held = traced_window(
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
        copies = {s: max(fit_run.weight_copy_bytes[s], held[s]) for s in held}
        bound = {s: fit_run.weight_copy_bound[s] for s in held}
    else:
        traced, simulated = f"one step of {args.schedule}", args.schedule
        x, y = next(job.batches(args.steps, args.steps + 1))
        job.opt.zero_grad(set_to_none=True)
        with meter, job.autocast():
            job.runner(job.pipe, x, y, job.loss_fn, True)
        job.opt.zero_grad(set_to_none=True)
        if args.schedule == AUTO:  # one process (refused under torchrun): the simulator prices the choice
            choice = job.pipe.auto_schedule.choice
            traced, simulated = f"one step of {AUTO} (chosen: {choice.chosen.label})", choice.schedule
        timeline = job.pipe.last_timeline
    assert timeline is not None
    share: dict[str, Any] = {
        "peaks": dict(zip(stages, meter.peaks)),
        "copies": copies,
        "bound": bound,
        "events": timeline.events,
        "device": str(job.first),
        "allocated": torch.cuda.max_memory_allocated(job.first) if job.first.type == "cuda" else None,
    }
    shares = [share] if job.ranks is None else _pipeline_shares(job, share)
    if shares is None:
        return None
    merged = Timeline(timeline.num_workers, [e for s in shares for e in s["events"]])
    peaks = {k: v for s in shares for k, v in s["peaks"].items()}
    memory: dict[str, Any] = {"activation_bytes_per_stage": [peaks[s] for s in sorted(peaks)]}
    if job.runner is None:
        every_copy = {k: v for s in shares for k, v in s["copies"].items()}
        every_bound = {k: v for s in shares for k, v in s["bound"].items()}
        memory["weight_copy_bytes_per_stage"] = [every_copy[s] for s in sorted(every_copy)]
        memory["weight_copy_bound_per_stage"] = [every_bound[s] for s in sorted(every_bound)]
    if job.first.type == "cuda":
        memory["max_memory_allocated_per_device"] = _allocated(job, shares)
    return Profile(merged, traced, simulated, memory)


def _pipeline_shares(job: Job, share: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The first replica's shares on rank 0, in pipeline order (None on the other ranks)."""
    assert job.ranks is not None
    everyone = job.ranks.gather(share if job.ranks.replica == 0 else None)
    return None if everyone is None else everyone[: job.ranks.stages]


def _allocated(job: Job, shares: list[dict[str, Any]]) -> dict[str, int]:
    if job.ranks is None:
        return {str(d): torch.cuda.max_memory_allocated(d) for d in dict.fromkeys(job.devices)}
    return {f"rank {r} {s['device']}": int(s["allocated"]) for r, s in enumerate(shares)}


@contextlib.contextmanager
def _both(first: Any, second: Any) -> Iterator[None]:
    with first, second:
        yield


def _whole(value: Any) -> Any:
    """A DTensor's whole tensor (a collective over its mesh), else ``value``."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def evaluate_and_sample(job: Job) -> tuple[float, str, list[str], int] | None:
    """The validation loss, a text sample, each pipeline stage's device and the parameter count.

    Under torchrun call it on every rank: the first replica's weights are gathered to rank 0,
    which evaluates the whole model on its device; the other ranks get None.
    """
    args = job.args
    pipe: Pipe
    if job.ranks is None:
        pipe, loss_fn, logits, devices = job.pipe, job.loss_fn, job.logits, [str(d) for d in job.devices]
        first, last = job.first, job.last
    else:
        ranks = job.ranks
        # A stage sharded over its replicas (--dp-shard fsdp) is whole only after its replicas gather it.
        sharded = ranks.mesh is not None
        mine = None
        if ranks.replica == 0 or sharded:
            mine = {k: _whole(v).detach().cpu() for k, v in job.pipe.state_dict().items()}
        everyone = ranks.gather((mine if ranks.replica == 0 else None, str(ranks.device)))
        if everyone is None:
            return None
        layers = build_model(args).layers
        layers.load_state_dict({k: v for share, _ in everyone[: ranks.stages] for k, v in share.items()})
        pipe = Pipe(layers, balance=[len(layers)], devices=[ranks.device], chunks=args.chunks)
        loss_fn, logits = job.model.make_loss(pipe), job.model.make_logits(pipe)
        # The schedule places each stage on a pipeline rank: round robin, or in a V.
        placed = stage_workers("1f1b" if job.runner is None else args.schedule, ranks.stages, job.virtual)
        devices = [everyone[r][1] for r in placed]
        first = last = ranks.device
    val_loss = evaluate(pipe, loss_fn, job.corpus, args, job.autocast, first, last, job.model.targets)
    sample = sample_text(pipe, logits, "def ", args.sample_chars, args.seq_len, args.seed)
    return val_loss, sample, devices, sum(p.numel() for p in pipe.parameters())
