"""The seeds a pipeline's random streams start from: one per step, one per task.

One number is drawn from the caller's default CPU generator per step
(:func:`draw_step_seed`), so the caller's generator moves once per step however many
stages and micro-batches draw. Each (stage, micro-batch) task gets a seed of its own,
mixed from that number with SplitMix64 (:func:`task_seed`), and its stream on a device is
the one ``torch.manual_seed(task_seed(...))`` starts there. Apart from that one draw these
are pure functions: the same step seed gives the same task seeds whatever the thread order
or checkpoint mode. :mod:`fastpipe.rng.streams` routes each task's draws to its streams.
"""

from __future__ import annotations

import torch

__all__ = ["draw_step_seed", "task_seed"]

_MASK64 = (1 << 64) - 1


def draw_step_seed() -> int:
    """Consume one number (below 2**62) from the caller's default CPU generator."""
    return int(torch.empty((), dtype=torch.int64).random_(0, 1 << 62).item())


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def task_seed(step_seed: int, stage: int, microbatch: int) -> int:
    """A well-mixed seed for one (stage, micro-batch) task, stable across runs."""
    return _splitmix64(_splitmix64(step_seed ^ (stage << 32)) ^ microbatch) >> 1
