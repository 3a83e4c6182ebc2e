"""Placement: which worker holds each stage of a :class:`~fastpipe.schedule.ir.Schedule`.

A placement is a tuple, one worker per stage. Two shapes are built in::

    round robin (interleaved), K=2, 4 stages     V shape (zb-v, dualpipev), K=2, 4 stages
        worker 0: stages 0, 2                        worker 0: stages 0, 3
        worker 1: stages 1, 3                        worker 1: stages 1, 2

    stage:  0 ─▶ 1 ─▶ 2 ─▶ 3                     stage:  0 ─▶ 1 ─┐
    worker: 0    1    0    1                     worker: 0    1  │
                                                        3 ◀─ 2 ◀─┘
                                                        0    1

In the V shape the activations go down the workers and come back up: the middle pair (K-1, K) and the
ends (0, 2K-1) share a worker, so the last stage (the loss) runs on worker 0, next to the input, and a
forward crosses 2K-2 links instead of round robin's 2K-1.
"""

from __future__ import annotations

__all__ = ["describe_placement", "placement_problem", "round_robin", "v_shape"]


def round_robin(num_stages: int, num_workers: int) -> tuple[int, ...]:
    """Stage ``s`` on worker ``s % num_workers`` (one stage per worker, or Megatron's interleaving)."""
    return tuple(s % num_workers for s in range(num_stages))


def v_shape(num_workers: int) -> tuple[int, ...]:
    """``2 * num_workers`` stages: stage ``s`` and stage ``2K - 1 - s`` on worker ``s``."""
    return tuple(range(num_workers)) + tuple(reversed(range(num_workers)))


def describe_placement(placement: tuple[int, ...], num_workers: int) -> str:
    """A short name for ``placement``: ``"round robin"``, ``"V shape"`` or ``"custom"``."""
    if placement == round_robin(len(placement), num_workers):
        return "round robin"
    if len(placement) == 2 * num_workers and placement == v_shape(num_workers):
        return "V shape"
    return "custom"


def placement_problem(placement: tuple[int, ...], num_stages: int, num_workers: int) -> str | None:
    """What is wrong with ``placement`` for ``num_stages`` stages on ``num_workers`` workers, or None.

    A placement maps every stage to a worker in ``0..num_workers-1``, and every worker holds the same
    number of stages (each worker is one device or rank of equal share).
    """
    if len(placement) != num_stages:
        return f"placement maps {len(placement)} stages; the schedule has {num_stages}"
    for stage, worker in enumerate(placement):
        if not isinstance(worker, int) or not 0 <= worker < num_workers:
            return f"placement puts stage {stage} on worker {worker!r}; workers are 0..{num_workers - 1}"
    held = [placement.count(w) for w in range(num_workers)]
    if len(set(held)) > 1:
        counts = ", ".join(f"worker {w}: {n}" for w, n in enumerate(held))
        return f"placement gives the workers different numbers of stages ({counts}); each must hold the same"
    return None
