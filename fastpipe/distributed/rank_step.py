"""What one :meth:`DistributedPipe.train_step` reads on each rank before its actions run.

Stage 0's rank splits the input into micro-batches and shares their sizes, the step's seed and
its schedule's digest with the pipeline (one broadcast); every rank then splits its own side
inputs, the last rank its targets, and every rank checks that it runs stage 0's schedule. An
error on one rank is reported to the others (``DistributedRuntime.reported``), so none hangs.
Inputs and targets in host memory reach a GPU stage without blocking the host
(:func:`fastpipe.step.host_io.value_to`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from fastpipe.model.side_inputs import check_side_inputs, split_side_inputs
from fastpipe.rng.streams import draw_step_seed
from fastpipe.schedule import Schedule
from fastpipe.schedule.builders import build_for
from fastpipe.schedule.digest import schedule_digest
from fastpipe.step.host_io import value_to
from fastpipe.step.microbatch import Value, batch_size, check_value, scatter
from fastpipe.step.rules import given_schedule, loss_weights, microbatch_weights, split_targets

if TYPE_CHECKING:
    from fastpipe.distributed_pipe import DistributedPipe

__all__ = ["RankStep", "rank_step"]


@dataclass
class RankStep:
    """One step's inputs on this rank."""

    microbatches: list[Value] | None  # on stage 0's rank only
    sizes: list[int]  # of every micro-batch, on every rank
    step_seed: int
    side: list[dict[str, Any]]  # each micro-batch's side inputs, or empty
    targets: list[Any]  # the last rank's, None elsewhere
    weights: list[float]  # each micro-batch's share of the loss
    schedule: Schedule


def rank_step(
    pipe: DistributedPipe,
    input: Value | None,
    target: Any,
    loss_fn: Callable[[Any, Any], Tensor],
    side: Mapping[str, Any],
    schedule: Schedule | None,
    here: str,
) -> RankStep:
    """Split and share this step's inputs (see the module doc); ``schedule`` overrides the pipe's."""
    runtime = pipe.runtime
    microbatches: list[Value] | None = None
    sizes: list[int] | None = None
    side_mbs: list[dict[str, Any]] = []
    with runtime.reported(here):
        check_side_inputs(pipe._side_names, side)
    if pipe.is_first:
        with runtime.reported("stage 0"):
            if input is None:
                raise ValueError("fastpipe: stage 0's rank needs the input")
            check_value(input, "input")
            microbatches = scatter(value_to(input, pipe.device), pipe.chunks)
            sizes = [batch_size(x) for x in microbatches]
            side_mbs = split_side_inputs(side, sum(sizes), pipe.chunks, len(sizes)) if side else []
    digest = schedule_digest(schedule)
    seed = draw_step_seed() if pipe.is_first else 0
    sizes, step_seed, first_digest = runtime.broadcast_sizes(sizes, pipe.chunks, seed, digest)
    count = len(sizes)
    with runtime.reported(here):
        if first_digest != digest:
            raise ValueError(
                "fastpipe: this rank's train_step(schedule=...) is not stage 0's rank's; pass the same "
                "Schedule (or none) on every rank"
            )
        if side and not pipe.is_first:
            side_mbs = split_side_inputs(side, sum(sizes), pipe.chunks, count)
    if schedule is not None:  # the same on every rank (the digests agree): all raise alike, nothing is lost
        schedule = given_schedule(schedule, len(pipe.balance), count)
    targets: list[Any] = [None] * count
    if pipe.is_last:
        with runtime.reported(f"stage {len(pipe.balance) - 1}"):
            split = split_targets(target, pipe.chunks, sizes)
            # Weighed where the caller's targets are (the CPU, usually): no device sync for a count.
            weights = microbatch_weights(loss_fn, split, sizes, "train_step")
            targets = [value_to(t, pipe.device) for t in split]
    else:  # only the last rank runs the loss, so only its weights count
        weights = loss_weights(getattr(loss_fn, "reduction", "mean"), sizes)
    built = schedule or build_for(pipe.schedule, len(pipe.balance), runtime.size, count)
    return RankStep(microbatches, sizes, step_seed, side_mbs, targets, list(weights), built)
