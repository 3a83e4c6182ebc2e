"""The recompute a pipe runs each step: its ``checkpoint=`` setting, or what ``"auto"`` picks.

``checkpoint="auto"`` with ``memory_limit=`` tries, on the first ``train_step`` of each
schedule and micro-batch shape, the candidates of
:func:`~fastpipe.step.recompute_policy.auto_candidates` from the least recompute to the most::

    never ─▶ mlp ─▶ attention ─▶ every other layer ─▶ attention + mlp ─▶ except_last ─▶ every layer ─▶ always
    (parts only where the layers have them)                     first whose prediction + 5% fits

Each candidate's peak is predicted from the stages measured under it
(:meth:`~fastpipe.memory.limit.MemoryGuard.predict`, once per key), so a candidate that fits
is one the limit lets through. When none fits, the step raises before it runs, as
``memory_limit`` does, naming the device and what it holds under the candidate that needs the
least. Without ``memory_limit`` the limit is the stage devices' capacity where they report one
(CUDA: :mod:`fastpipe.memory.capacity`); on host memory ``"auto"`` recomputes nothing, there
being no device budget to save memory for.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.utils._pytree import tree_leaves

from fastpipe.memory.capacity import capacity_limit
from fastpipe.memory.limit import MemoryGuard, limit_source, over_limit, refusal
from fastpipe.memory.model import DeviceMemory, OptimizerSpec
from fastpipe.memory.sizes import format_bytes
from fastpipe.runtime.selective import set_regions
from fastpipe.runtime.stage import Stage
from fastpipe.schedule.ir import Schedule
from fastpipe.step.recompute_policy import Recompute, auto_candidates, checkpoint_setting, stage_mode
from fastpipe.step.rules import Checkpoint, checkpoint_predicate

if TYPE_CHECKING:
    from fastpipe.memory.offload import PipeOffload

__all__ = ["PipeRecompute"]

_log = logging.getLogger("fastpipe")


class PipeRecompute:
    """What a :class:`~fastpipe.Pipe` recomputes, and the memory guard that checks it.

    The pipe's ``checkpoint`` is read at each step (it may be set between steps); a per-layer
    policy's regions are set on the stages when it changes (:func:`~fastpipe.runtime.selective.set_regions`).

    Args:
        setting: the pipe's ``checkpoint`` at construction: a per-layer policy is set on the stages
            at once, so a part that no layer has is refused when the pipe is built.
        stages: the pipe's stages.
        memory_limit: the pipe's ``memory_limit``. None: under ``"auto"``, the stage devices' capacity
            (:func:`~fastpipe.memory.capacity.capacity_limit`) where they report one, else no guard.
        optimizer: the optimizer state the guard counts (:func:`~fastpipe.memory.optimizer.optimizer_factor`).
    """

    def __init__(
        self,
        setting: object,
        stages: Sequence[Stage],
        memory_limit: float | str | None,
        optimizer: OptimizerSpec = "adam",
    ) -> None:
        self.stages = list(stages)
        options = self.stages[0].options if self.stages else None
        checked = checkpoint_setting(setting)
        self.guard = None if memory_limit is None else MemoryGuard(memory_limit, optimizer, options)
        if memory_limit is None and checked == "auto":
            devices = [s.device for s in self.stages]
            capacity = capacity_limit(devices)
            if capacity is not None:
                self.guard = MemoryGuard(capacity, optimizer, options, source=limit_source(devices))
        #: What the last step ran: the pipe's setting, or ``"auto"``'s choice (None before its first step).
        self.chosen: str | Recompute | None = None
        #: The pipe's offload: under ``offload="auto"`` each recompute tried gets the least offload that fits it.
        self.offload: PipeOffload | None = None
        self._applied: str | Recompute = "never"
        self._auto: dict[tuple[Any, ...], str | Recompute] = {}  # "auto"'s choice per schedule and shape
        if checked != "auto":
            self._run(checked)

    def predicate(self, setting: object, training: bool, per_minibatch: int) -> Callable[[int], bool]:
        """Which micro-batches recompute their whole stage, for a step not checked against the limit.

        ``"auto"`` runs the last choice of :meth:`for_step` (nothing before the first).
        """
        checked = checkpoint_setting(setting)
        if checked != "auto":
            self._run(checked)
        return checkpoint_predicate(_whole_stage(self.chosen), training, per_minibatch)

    def for_forward(
        self, setting: object, schedule: Schedule, sample: Any, grad: bool
    ) -> tuple[Callable[[int], bool], Schedule]:
        """A ``forward``'s recompute and schedule (with the offload's prefetches).

        A training forward that builds a graph is checked (or, for ``"auto"``, chosen) against the
        limit as :meth:`for_step` does; the caller's loss is not the pipe's, so the output's
        gradient stands in for it (ones). Otherwise it runs :meth:`predicate`'s choice.
        """
        training = self.stages[0].module.training  # the pipe's mode: Pipe.train sets its stages'
        if grad and training and self.guard is not None:
            return self.for_step(setting, schedule, sample, None, None)
        prefetched = schedule if self.offload is None else self.offload.prefetch(schedule)
        return self.predicate(setting, training, schedule.num_microbatches), prefetched

    def for_step(
        self,
        setting: object,
        schedule: Schedule,
        sample: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
    ) -> tuple[Callable[[int], bool], Schedule]:
        """Check (or, for ``"auto"``, choose) a ``train_step``'s recompute against the limit.

        Under ``offload="auto"`` too, each recompute tried, least first, runs with the least offload
        that fits it (:meth:`~fastpipe.memory.offload.PipeOffload.for_step`), as ``DistributedPipe``
        and ``fit`` choose.

        Args:
            setting: the pipe's ``checkpoint``.
            schedule: the step's schedule, without prefetches.
            sample: one micro-batch of input.
            target: its target.
            loss_fn: the step's loss (None for ``forward``: the output's gradient is ones).

        Returns:
            Which micro-batches recompute their whole stage, and the schedule with the offload's prefetches.

        Raises:
            ValueError: the step's predicted peak exceeds the limit (for ``"auto"``: under every candidate).
        """
        checked = checkpoint_setting(setting)
        choice = "never" if checked == "auto" else checked
        offload = self.offload

        def prefetched(candidate: str | Recompute) -> Schedule:
            return schedule if offload is None else offload.for_step(schedule, sample, target, loss_fn, candidate)

        if self.guard is not None:
            modules = [s.module for s in self.stages]
            layers = [layer for m in modules for layer in m.children()]
            balance = [len(list(m.children())) for m in modules]
            rest = (self.stages[-1].wgrad_batch, sample, target, loss_fn)
            if checked == "auto":
                key = (schedule, self.stages[-1].wgrad_batch, _signature(sample), loss_fn is None)
                found = self._auto.get(key)
                if found is None:
                    found = self._choose(self.guard, auto_candidates(modules), (layers, balance, prefetched), rest)
                    self._auto[key] = found
                choice = found
            self.guard.check(layers, balance, prefetched(choice), choice, *rest)
            if checked == "auto" and choice != self.chosen:
                peak = format_bytes(max(d.total for d in self.guard.last))
                _log.info(
                    "fastpipe: checkpoint='auto' runs %s under schedule %s (peak %s)", choice, schedule.name, peak
                )
        self._run(choice)
        training = self.stages[0].module.training  # the pipe's mode: Pipe.train sets its stages'
        return checkpoint_predicate(_whole_stage(choice), training, schedule.num_microbatches), prefetched(choice)

    @staticmethod
    def _choose(
        guard: MemoryGuard, candidates: Sequence[str | Recompute], where: tuple[Any, ...], rest: tuple[Any, ...]
    ) -> str | Recompute:
        """The first candidate whose prediction fits, or the refusal of the one that needs the least."""
        tried: list[tuple[str | Recompute, list[DeviceMemory]]] = []
        layers, balance, prefetched = where  # prefetched(candidate): the schedule under its offload
        # Each measurement collects garbage around what it meters; with the objects alive now set
        # aside (collected once, here), those collections walk only what the measurements made.
        gc.collect()
        gc.freeze()
        try:
            for candidate in candidates:
                devices = guard.predict(layers, balance, prefetched(candidate), candidate, *rest)
                if over_limit(devices, guard.limit) is None:
                    return candidate
                tried.append((candidate, devices))
        finally:
            gc.unfreeze()
        _, least = min(tried, key=lambda t: max(d.total for d in t[1]))
        over = over_limit(least, guard.limit)
        assert over is not None
        names = ", ".join(str(c) for c, _ in tried)
        raise ValueError(f"{refusal(over, guard.limit, guard.source)} (checkpoint='auto' tried, least first: {names})")

    def _run(self, choice: str | Recompute) -> None:
        """Make ``choice`` what the stages run: its regions set, or none."""
        if choice != self._applied:
            regions = choice.regions([s.module for s in self.stages]) if isinstance(choice, Recompute) else None
            for i, stage in enumerate(self.stages):
                set_regions(stage, regions[i] if regions is not None else ())
            self._applied = choice
        self.chosen = choice


def _whole_stage(choice: str | Recompute | None) -> Checkpoint:
    """The whole-stage mode of ``choice`` (a per-layer policy's own ``stage``)."""
    return stage_mode(choice)


def _signature(value: Any) -> tuple[Any, ...]:
    """The shapes, dtypes and devices of the tensors in a micro-batch: what a measurement depends on."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tree_leaves(value) if isinstance(t, Tensor))
