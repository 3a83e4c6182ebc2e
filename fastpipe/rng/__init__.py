"""Reproducible randomness: each (stage, micro-batch) task draws from streams of its own.

* :mod:`fastpipe.rng.seeds`: one seed drawn per step, one mixed per task.
* :mod:`fastpipe.rng.registry`: which calls and layers draw, and the hooks that extend it.
* :mod:`fastpipe.rng.streams`: :class:`~fastpipe.rng.streams.TaskRNG`, which routes a task's
  draws to its streams.
* :mod:`fastpipe.rng.state`: torch's RNG-state functions, made to see the running task's stream.

What a custom op or layer needs is importable from here: :func:`register_random_op` (an op
that draws from a default generator), :func:`register_deterministic` (a layer that never
draws) and :func:`current_generator` (the running task's generator, to pass as ``generator=``).
"""

from fastpipe.rng.registry import register_deterministic, register_random_op
from fastpipe.rng.streams import current_generator

__all__ = ["current_generator", "register_deterministic", "register_random_op"]
