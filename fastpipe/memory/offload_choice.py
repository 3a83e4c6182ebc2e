"""What ``offload=`` takes off each device under given shares, and ``"auto"``'s choice of shares.

A stage's owner measures the sizes of the saved tensors its forward can offload, in the order
saved (:class:`StageOffload`); a share then offloads the same prefix the runtime picks
(:func:`~fastpipe.runtime.offload.chosen_prefix`). :func:`offloaded` turns shares, one per
stage, into the step's schedule with its ``P`` actions and each stage's bytes with
``offloaded`` set, the memory model's inputs. :func:`choose_fractions` is ``"auto"``: per
device, the least share in eighths whose prediction fits the limit.

``Pipe``, ``DistributedPipe`` and ``fit`` all choose through these, so a limit chooses alike
wherever it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import DeviceMemory, StageBytes
from fastpipe.runtime.offload import chosen_prefix
from fastpipe.schedule.ir import Schedule
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching

__all__ = ["AUTO_STEPS", "StageOffload", "choose_fractions", "offloaded", "offloaded_stages", "prefetching", "taken"]

#: ``"auto"`` tries shares in eighths.
AUTO_STEPS = 8


@dataclasses.dataclass(frozen=True)
class StageOffload:
    """What one stage's owner tells the memory model about its offload.

    Attributes:
        fraction: the share its policy offloads (0: none; under ``"auto"``, the choice is the guard's).
        sizes: the bytes of the tensors its forward can offload, in the order saved; None where the
            stage cannot run apart (skips, side inputs): ``fraction`` of its activation stands in.
        movable: whether ``"auto"`` may offload it (not a CPU stage).
    """

    fraction: float
    sizes: list[int] | None
    movable: bool


def taken(sizes: Sequence[int] | None, fraction: float, activation: int) -> int:
    """The bytes a share ``fraction`` offloads of a stage whose offloadable tensors are ``sizes``.

    Where the sizes are unknown (None), ``fraction`` of the stage's ``activation`` stands in.
    """
    got = round(fraction * activation) if sizes is None else sum(sizes[: chosen_prefix(list(sizes), fraction)])
    return min(got, activation)


def prefetching(schedule: Schedule, stages: Sequence[int], lookahead: int = 1) -> Schedule:
    """``schedule`` with the prefetches of ``stages``' micro-batches that gain from offload."""
    pairs = [(s, m) for s in stages for m in range(schedule.num_microbatches)]
    if not pairs:
        return schedule
    return with_prefetch(schedule, worth_prefetching(schedule, pairs, lookahead), lookahead)


def offloaded_stages(
    stages: Sequence[StageBytes], offload: Sequence[StageOffload | None], fractions: Sequence[float]
) -> list[StageBytes]:
    """``stages`` with what ``fractions`` (one per stage) offload of each, as their owners measured it."""
    held = []
    for st, told, f in zip(stages, offload, fractions):
        if told is None or f <= 0:
            held.append(st)
            continue
        held.append(dataclasses.replace(st, offloaded=taken(told.sizes, f, st.activation)))
    return held


def offloaded(
    schedule: Schedule,
    stages: Sequence[StageBytes],
    offload: Sequence[StageOffload | None],
    fractions: Sequence[float],
    lookahead: int = 1,
) -> tuple[Schedule, list[StageBytes]]:
    """The whole pipeline's step under ``fractions`` (one per stage): its prefetches, each stage's bytes offloaded."""
    moving = [s for s, f in enumerate(fractions) if f > 0]
    return prefetching(schedule, moving, lookahead), offloaded_stages(stages, offload, fractions)


def choose_fractions(
    predict: Callable[[Sequence[float]], list[DeviceMemory]],
    schedule: Schedule,
    offload: Sequence[StageOffload | None],
    limit: int,
) -> list[float]:
    """``"auto"``'s offload: per device, the least share in eighths at which its prediction fits.

    ``predict`` gives every device's prediction under shares, one per stage. A device that fits at
    none takes the whole (the guard then refuses the step, naming it).
    """
    movable = [s for s, told in enumerate(offload) if told is not None and told.movable]
    least: dict[int, float] = {}
    for step in range(AUTO_STEPS + 1):
        share = step / AUTO_STEPS
        fractions = [share if s in movable else 0.0 for s in range(len(offload))]
        for d in predict(fractions):
            if d.worker not in least and d.total * (1 + MARGIN) <= limit:
                least[d.worker] = share
        if len(least) == schedule.num_workers or not movable:
            break
    return [least.get(schedule.worker_of(s), 1.0) if s in movable else 0.0 for s in range(len(offload))]
