"""What a pipeline's transport holds for received values, beyond what the memory model counts per action.

The model (:func:`fastpipe.memory.model.predict_memory`) counts a stage's input from its forward to
its task's end. How the values arrive adds to that, by transport:

* ``"local"`` (:class:`fastpipe.Pipe`'s threads) hands tensors over and holds nothing;
* ``"tags"`` (:class:`~fastpipe.DistributedPipe` on gloo) posts every receive of a schedule at its
  start, each payload into a buffer of its own kept for the next step, and a received input is a
  view of its buffer: M inputs and M output gradients per stage, whatever the schedule. Those
  inputs are then counted in the buffers, not again per action (:func:`buffered_stages`);
* ``"ordered"`` (NCCL) receives each payload into a fresh buffer when its round is posted, which
  may be before the model counts it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fastpipe.distributed.wire import HEADER
from fastpipe.memory.model import StageBytes
from fastpipe.schedule.ir import Schedule
from fastpipe.schedule.ordered import plan

__all__ = ["TRANSPORTS", "buffered_stages", "receive_buffer_bytes"]

#: How values reach a stage: ``"local"`` (:class:`fastpipe.Pipe`'s threads), ``"tags"`` (a
#: :class:`~fastpipe.DistributedPipe` on gloo) or ``"ordered"`` (one on NCCL, or ``FASTPIPE_P2P=ordered``).
TRANSPORTS = ("local", "tags", "ordered")


def receive_buffer_bytes(
    schedule: Schedule,
    stages: Sequence[StageBytes],
    transport: str = "local",
    skips: Sequence[tuple[int, int, float]] = (),
) -> list[int]:
    """Per stage, the bytes its transport holds for received values beyond what the model counts.

    A value between stages on different workers is received into a header
    (:data:`fastpipe.distributed.wire.HEADER` bytes) per micro-batch of the schedule, kept for
    the next one. Its payload is a stage's input (``StageBytes.input``) or the gradient of its
    output (the next stage's input):

    * ``"tags"`` receives every payload of the schedule into a buffer of its own, posted at the
      start and kept for the next schedule;
    * ``"ordered"`` receives each payload into a fresh buffer when the round plan
      (:func:`fastpipe.schedule.ordered.plan`) posts it, which may be actions before the model
      counts it (an input from its forward, a gradient not at all): the most such bytes a
      worker holds at once, on its first stage;
    * ``"local"`` hands values over and holds nothing.

    ``skips`` (``(producer, consumer, bytes)``) between workers travel the same way: the value to
    the consumer, its gradient back to the producer (``"tags"``: into buffers kept as well, which
    :func:`~fastpipe.memory.model.predict_memory` is then told with ``skip_buffers=True``).

    Raises:
        ValueError: an unknown ``transport``.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"fastpipe: transport must be one of {TRANSPORTS}, got {transport!r}")
    n, window = schedule.num_stages, schedule.num_microbatches
    kept = [0] * n
    if transport == "local":
        return kept
    payload = transport == "tags"
    for s in range(n):
        if s > 0 and schedule.crosses(s - 1, s):
            kept[s] += window * (HEADER + (stages[s].input if payload else 0))
        if s < n - 1 and schedule.crosses(s, s + 1):
            kept[s] += window * (HEADER + (stages[s + 1].input if payload else 0))
    for producer, consumer, nbytes in skips:
        if schedule.crosses(producer, consumer):
            for s in (producer, consumer):
                kept[s] += window * (HEADER + (int(nbytes) if payload else 0))
    if not payload:
        for w in range(schedule.num_workers):
            kept[schedule.stages_of(w)[0]] += _received_early(schedule, stages, w)
    return kept


def _received_early(schedule: Schedule, stages: Sequence[StageBytes], worker: int) -> int:
    """The most payload bytes ``worker`` holds at once that ``ordered`` received ahead of the model's count."""
    alive: dict[tuple[str, int, int], int] = {}
    most = 0
    for step in plan(schedule, worker):
        for op in step.ops:
            msg = op.message
            if not op.send and msg.kind in ("F", "B"):
                alive[(msg.kind, msg.stage, msg.microbatch)] = stages[msg.stage + (msg.kind == "B")].input
        a = step.action
        if a is not None and a.kind == "F":
            alive.pop(("F", a.stage, a.microbatch), None)  # the model counts it from here
        most = max(most, sum(alive.values()))
        if a is not None and a.kind in ("B", "BW"):
            alive.pop(("B", a.stage, a.microbatch), None)
    return most


def buffered_stages(schedule: Schedule, stages: Sequence[StageBytes], transport: str) -> list[StageBytes]:
    """``stages`` with the inputs that ``transport`` keeps in its buffers taken out of the per-action count."""
    if transport != "tags":
        return list(stages)
    return [
        dataclasses.replace(st, input=0) if s > 0 and schedule.crosses(s - 1, s) else st for s, st in enumerate(stages)
    ]
