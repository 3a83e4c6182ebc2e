"""``DistributedPipe(offload=...)``: this rank's stages offload saved activations to host memory.

The forms are :class:`fastpipe.Pipe`'s (:data:`fastpipe.memory.offload.FORMS`): a fraction, a layer
predicate ``fn(index, layer)`` with ``index`` in the whole model, a list with one entry per stage of
the whole pipeline, or ``"auto"``. Each rank resolves the entries of its own stages; a CPU stage
offloads nothing (its memory is host memory already), warned once when the pipe is built.

Each step's schedule gets a ``P`` ahead of the backward of each of this rank's micro-batches that
gains from offload (:func:`~fastpipe.schedule.prefetch.worth_prefetching`). ``P`` moves nothing
between ranks, so each rank adds its own: the ranks' schedules differ only in them.

Under ``memory_limit`` every stage's owner measures what its forward can offload
(:class:`StageOffload`, sent with its bytes by :mod:`fastpipe.distributed.memory_limit`), so every
rank predicts every device with the whole pipeline's prefetches, and ``"auto"`` chooses per device
the least fraction, in eighths, whose prediction fits: the same on every rank. ``fit`` under a
limit chooses alike for each window shape (:mod:`fastpipe.asynchronous.fit_limit`). Without a
limit, ``"auto"`` offloads nothing.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from fastpipe.memory.offload import FORMS, OffloadSpec, stage_policy
from fastpipe.memory.offload_bytes import OffloadBytes
from fastpipe.memory.offload_choice import StageOffload, prefetching
from fastpipe.runtime.host_copies import HostMemoryError, check_host_memory
from fastpipe.runtime.offload import OffloadPolicy
from fastpipe.runtime.stage import Stage
from fastpipe.schedule.ir import Schedule

__all__ = ["RankOffload"]


class RankOffload:
    """What a :class:`~fastpipe.DistributedPipe` offloads on this rank, and each step's prefetches.

    Args:
        spec: the pipe's ``offload``.
        stages: this rank's stages, by index in the whole pipeline.
        balance: layers per stage of the whole pipeline.
        limited: whether the pipe has a ``memory_limit`` (``"auto"`` chooses only under one).
        lookahead: compute actions between a prefetch and its backward.

    Raises:
        ValueError: ``spec`` is not one of :data:`~fastpipe.memory.offload.FORMS`, or a list of the wrong length.
        fastpipe.runtime.host_copies.HostMemoryError: a stage to offload from a device whose host
            cannot give page-locked memory.
    """

    def __init__(
        self, spec: OffloadSpec, stages: Mapping[int, Stage], balance: Sequence[int], limited: bool, lookahead: int = 1
    ) -> None:
        asked = isinstance(spec, str) and spec == "auto"
        if isinstance(spec, str) and not asked:
            raise ValueError(f"fastpipe: offload={spec!r} is not valid; accepted forms: {FORMS}")
        if isinstance(spec, (list, tuple)) and len(spec) != len(balance):
            raise ValueError(
                f"fastpipe: offload= got a list of {len(spec)} for {len(balance)} stages; give one per stage"
            )
        self.stages, self.lookahead = dict(stages), lookahead
        #: The stages ``"auto"`` may offload: those off the CPU.
        self.movable = {s: st.device.type != "cpu" for s, st in self.stages.items()}
        #: Whether ``offload="auto"`` was asked: a guard (the pipe's, or ``fit``'s) then chooses the shares.
        self.auto = asked
        starts = [0, *itertools.accumulate(balance)]
        on_cpu = []
        for s, st in self.stages.items():
            entry = None if asked else spec[s] if isinstance(spec, (list, tuple)) else spec
            policy = stage_policy(entry, list(st.module.children()), starts[s], spec)
            if policy is not None and st.device.type == "cpu":
                on_cpu.append(s)
                policy = None
            if st.device.type != "cpu" and (policy is not None or (asked and limited)):
                check_host_memory(st.device)
            st.offload = policy
        if on_cpu:
            warnings.warn(
                f"fastpipe: offload= does nothing on CPU stages ({', '.join(map(str, on_cpu))}): their activations "
                "are in host memory already; those stages run without offload",
                stacklevel=3,
            )
        self._prefetched: dict[tuple[Any, ...], Schedule] = {}

    @classmethod
    def reported(
        cls, spec: OffloadSpec, stages: Mapping[int, Stage], balance: Sequence[int], limited: bool
    ) -> tuple[RankOffload, str]:
        """A :class:`RankOffload`, and what was wrong with ``spec`` here ("" if nothing): a predicate may
        fail on this rank's layers alone, so the error is raised on every rank once the ranks have met
        (:func:`~fastpipe.distributed.rank_recompute.check_regions`), not here, where the others would wait."""
        try:
            return cls(spec, stages, balance, limited), ""
        except (ValueError, HostMemoryError) as exc:
            return cls(None, stages, balance, limited), f"{type(exc).__name__}: {exc}"

    def prefetch(self, schedule: Schedule) -> Schedule:
        """``schedule`` with a ``P`` ahead of each of this rank's backwards whose micro-batch gains from offload."""
        if all(st.offload is None for st in self.stages.values()):
            return schedule  # the usual case, without hashing the schedule (which walks all its actions)
        key = (schedule, tuple((s, st.offload) for s, st in self.stages.items()))
        found = self._prefetched.get(key)
        if found is None:
            mine = [s for s, st in self.stages.items() if st.offload is not None and st.offload.fraction > 0]
            found = prefetching(schedule, mine, self.lookahead)
            self._prefetched[key] = found
        return found

    def measure(
        self, s: int, sample: Any, target: Any, loss_fn: Callable[[Any, Any], Tensor] | None
    ) -> StageOffload | None:
        """Stage ``s`` (held here) on one micro-batch: what it can offload; None where it offloads nothing."""
        stage = self.stages[s]
        policy = stage.offload
        movable = self.auto and self.movable[s]
        if policy is None and not movable:
            return None
        scope = None if policy is None else policy.layers
        (sizes,) = OffloadBytes([stage]).sizes(sample, target, loss_fn, (scope,))
        return StageOffload(0.0 if policy is None else policy.fraction, sizes, movable)

    def apply(self, fractions: Sequence[float]) -> None:
        """Set ``"auto"``'s choice, one fraction per stage of the pipeline, on this rank's stages.

        Raises:
            fastpipe.runtime.host_copies.HostMemoryError: a share for a device whose host cannot
                give page-locked memory (checked when the pipe is built where it has a limit).
        """
        if self.auto:
            for s, st in self.stages.items():
                if fractions[s] > 0 and st.device.type != "cpu":
                    check_host_memory(st.device)
                # A CPU stage is movable only where a test made it so: it then takes _C's host path.
                policy = OffloadPolicy(fractions[s], force=st.device.type == "cpu")
                st.offload = policy if fractions[s] > 0 else None
