"""Skips within one device on the timeline of :func:`fastpipe.memory.model.predict_memory`.

A skip whose producer and consumer stages share a device is one tensor there (no copy is sent),
alive from the producer's forward until the last of the two stages' backwards and ``W`` s lets go
of it (a split ``B`` leaves its outputs, stashed ones included, to its ``W``). Two of the model's
other parts can be that very storage, and count once:

* a stage that stashes its output: under recompute the next stage's input, on the same device,
  is the skip's tensor (:attr:`StageBytes.output_stashed <fastpipe.memory.stage_parts.StageBytes.output_stashed>`);
  it is held until the later of the skip's end and the ``W`` that keeps that input;
* a skip's gradient waits from the consumer's backward to the producer's; where the consumer's
  split ``B`` hands the skip and its input one gradient tensor (an add), that tensor is the
  gradient the model already counts as sent to the stage before, and only outlives it
  (:attr:`StageBytes.skip_grads_shared <fastpipe.memory.stage_parts.StageBytes.skip_grads_shared>`).
  A combined backward accumulates into ``.grad``, which gives each leaf a storage of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fastpipe.memory.backward_points import Times, backward_of, sent_gradient
from fastpipe.memory.stage_parts import StageBytes
from fastpipe.schedule.ir import Action, Schedule

__all__ = ["local_skips", "sent_skip_grads"]

Point = tuple[int, float, float]  # (worker, time, bytes)


def local_skips(
    schedule: Schedule,
    times: Times,
    stages: Sequence[StageBytes],
    local: Sequence[tuple[int, int, int]],
    release: Mapping[tuple[int, int], Action],
    recomputed: Sequence[bool],
) -> tuple[list[int], list[Point]]:
    """What the skips of ``local`` hold, and what of each stage's input they hold.

    Args:
        schedule: the schedule; ``times`` its timing.
        stages: one :class:`StageBytes` per stage.
        local: ``(producer, consumer, bytes)`` of the skips within one device.
        release: per split ``(stage, micro-batch)``, the ``W`` that frees its records.
        recomputed: per micro-batch, whether it runs recomputed.

    Returns:
        Per stage, the bytes of its input (when recomputed) that a skip of the stage before
        holds; and the skips' ``(worker, time, bytes)`` points.
    """
    n = schedule.num_stages
    left = [st.output_stashed for st in stages]
    given, share = [0] * n, []
    for p, _, nbytes in local:
        take = min(nbytes, left[p]) if p + 1 < n and schedule.worker_of(p + 1) == schedule.worker_of(p) else 0
        left[p] -= take
        if take:
            given[p + 1] += take
        share.append(take)
    points: list[Point] = []
    for m in range(schedule.num_microbatches):
        shared_left = [st.skip_grads_shared for st in stages]
        for (p, c, nbytes), take in zip(local, share):
            w = schedule.worker_of(p)
            ends = [times[backward_of(times, p, m)][2], times[backward_of(times, c, m)][2]]
            ends += [times[Action("W", s, m)][2] for s in (p, c) if (s, m) in release]  # W keeps B's outputs
            last = max(ends)
            points += [(w, times[Action("F", p, m)][1], nbytes), (w, last, -nbytes)]
            if take and recomputed[m] and (p + 1, m) in release:  # the next stage's W keeps its input
                kept = times[release[(p + 1, m)] if stages[p + 1].w_input else Action("W", p + 1, m)][2]
                if kept > last:
                    points += [(w, last, take), (w, kept, -take)]
            if ends[1] >= ends[0]:
                continue
            one = 0  # the skip's gradient: from the consumer's backward to the producer's
            if (c, m) in release and schedule.worker_of(c - 1) == w:
                one = min(nbytes, shared_left[c])
                shared_left[c] -= one
                _, sent_until = sent_gradient(times, c, m)
                if one and ends[0] > sent_until:
                    points += [(w, sent_until, one), (w, ends[0], -one)]
            if nbytes > one:
                points += [(w, ends[1], nbytes - one), (w, ends[0], one - nbytes)]
    return given, points


def sent_skip_grads(schedule: Schedule, times: Times, crossing: Sequence[tuple[int, int, int]]) -> list[Point]:
    """A skip's gradient from another device: on the producer's, from the consumer's backward to the producer's.

    ``crossing``: ``(producer, consumer, bytes)`` of skips between devices whose gradients arrive
    as tensors of their own (not into a transport's kept buffers).
    """
    points: list[Point] = []
    for m in range(schedule.num_microbatches):
        for p, c, nbytes in crossing:
            sent, used = times[backward_of(times, c, m)][2], times[backward_of(times, p, m)][2]
            if sent < used:
                points += [(schedule.worker_of(p), sent, nbytes), (schedule.worker_of(p), used, -nbytes)]
    return points
