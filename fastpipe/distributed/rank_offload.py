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
the least fraction, in eighths, whose prediction fits: the same on every rank. Without a limit,
``"auto"`` offloads nothing.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor

from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import DeviceMemory, StageBytes
from fastpipe.memory.offload import FORMS, OffloadSpec, stage_policy
from fastpipe.memory.offload_bytes import OffloadBytes
from fastpipe.runtime.host_copies import HostMemoryError, check_host_memory
from fastpipe.runtime.offload import OffloadPolicy, chosen_prefix
from fastpipe.runtime.stage import Stage
from fastpipe.schedule.ir import Schedule
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching

__all__ = ["RankOffload", "StageOffload", "choose_fractions", "offloaded", "offloaded_stages", "prefetching"]

_AUTO_STEPS = 8  # "auto" tries fractions in eighths, as Pipe's does


@dataclasses.dataclass(frozen=True)
class StageOffload:
    """What one stage's owner tells every rank about its offload.

    Attributes:
        fraction: the share its policy offloads (0: none; under ``"auto"``, the choice is the guard's).
        sizes: the bytes of the tensors its forward can offload, in the order saved; None where the
            stage cannot run apart (skips, side inputs): ``fraction`` of its activation stands in.
        movable: whether ``"auto"`` may offload it (not a CPU stage).
    """

    fraction: float
    sizes: list[int] | None
    movable: bool


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
        self.auto = asked and limited
        starts = [0, *itertools.accumulate(balance)]
        on_cpu = []
        for s, st in self.stages.items():
            entry = None if asked else spec[s] if isinstance(spec, (list, tuple)) else spec
            policy = stage_policy(entry, list(st.module.children()), starts[s], spec)
            if policy is not None and st.device.type == "cpu":
                on_cpu.append(s)
                policy = None
            if st.device.type != "cpu" and (policy is not None or self.auto):
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
            found = with_prefetch(schedule, _worth(schedule, mine, self.lookahead), self.lookahead)
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
        """Set ``"auto"``'s choice, one fraction per stage of the pipeline, on this rank's stages."""
        if self.auto:
            for s, st in self.stages.items():
                # A CPU stage is movable only where a test made it so: it then takes _C's host path.
                policy = OffloadPolicy(fractions[s], force=st.device.type == "cpu")
                st.offload = policy if fractions[s] > 0 else None


def _worth(schedule: Schedule, stages: Sequence[int], lookahead: int) -> frozenset[tuple[int, int]]:
    pairs = [(s, m) for s in stages for m in range(schedule.num_microbatches)]
    return worth_prefetching(schedule, pairs, lookahead) if pairs else frozenset()


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


def prefetching(schedule: Schedule, stages: Sequence[int], lookahead: int = 1) -> Schedule:
    """``schedule`` with the prefetches of ``stages``' micro-batches that gain from offload."""
    return with_prefetch(schedule, _worth(schedule, stages, lookahead), lookahead)


def offloaded_stages(
    stages: Sequence[StageBytes], offload: Sequence[StageOffload | None], fractions: Sequence[float]
) -> list[StageBytes]:
    """``stages`` with what ``fractions`` (one per stage) offload of each, as their owners measured it."""
    held = []
    for st, told, f in zip(stages, offload, fractions):
        if told is None or f <= 0:
            held.append(st)
            continue
        taken = round(f * st.activation) if told.sizes is None else sum(told.sizes[: chosen_prefix(told.sizes, f)])
        held.append(dataclasses.replace(st, offloaded=min(taken, st.activation)))
    return held


def choose_fractions(
    predict: Callable[[Sequence[float]], list[DeviceMemory]],
    schedule: Schedule,
    offload: Sequence[StageOffload | None],
    limit: int,
) -> list[float]:
    """``"auto"``'s offload: per device, the least fraction in eighths at which its prediction fits.

    A device that fits at none takes the whole (the guard then refuses the step, naming it).
    """
    movable = [s for s, told in enumerate(offload) if told is not None and told.movable]
    least: dict[int, float] = {}
    for step in range(_AUTO_STEPS + 1):
        share = step / _AUTO_STEPS
        fractions = [share if s in movable else 0.0 for s in range(len(offload))]
        for d in predict(fractions):
            if d.worker not in least and d.total * (1 + MARGIN) <= limit:
                least[d.worker] = share
        if len(least) == schedule.num_workers or not movable:
            break
    return [least.get(schedule.worker_of(s), 1.0) if s in movable else 0.0 for s in range(len(offload))]
