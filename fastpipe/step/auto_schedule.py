"""``Pipe(..., schedule="auto")``: measure the stages once, then run the schedule the search picks.

At the first ``train_step`` under ``"auto"`` the pipe's layers are profiled on that step's first
micro-batch where they live (:func:`fastpipe.balance.profile_layers`: each layer's fastest
forward and backward of a few passes, and the bytes it saves for backward; a skip's bytes count
on the stage that stashes it and on the one that pops it). Summed per stage, these are the
costs :func:`fastpipe.schedule.search.search` simulates every candidate on; the fastest that
fits ``memory_limit`` runs. The costs are measured once per :class:`AutoSchedule`; the choice
is made once per number of micro-batches (a short last batch may make fewer) and kept. The
search itself took about 1 s for 8 stages and 32 micro-batches, 5 s for 16 and 64, on a loaded
2-core host (2026-12-01)::

    pipe = Pipe(model, balance=[2, 2, 2, 2], devices=["cpu"] * 4, chunks=8, schedule="auto")
    pipe.train_step(x, y, loss_fn)
    print(pipe.auto_schedule.choice.table())   # every candidate, and the one that ran

What the measurements cannot tell, and what is assumed instead:

* **B and W.** The profiler times one backward per layer; W's share of it is ``weight_share``
  (one half, as the balance planner takes it: a Linear layer's two gradients are two GEMMs of
  one shape).
* **Links.** ``comm`` seconds per stage boundary, 0 by default: on one device the local runtime
  hands an activation to the next stage's thread by reference. Copies between devices are not
  measured; give ``comm`` to price them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from fastpipe.balance._untouched import state_kept
from fastpipe.balance.profile import Timer, profile_layers
from fastpipe.model.batchnorm import DeferredBatchNorm, accumulating_into
from fastpipe.model.side_inputs import broadcast
from fastpipe.model.skip_memory import SkipSpan, measure_skips, skip_bytes
from fastpipe.model.skips import has_skips
from fastpipe.schedule import Schedule, ScheduleError
from fastpipe.schedule.search import Choice, StageCosts, search
from fastpipe.step.microbatch import Value

__all__ = ["AUTO", "AutoRun", "AutoSchedule", "is_auto"]

# The name that asks for the search instead of a named schedule.
AUTO = "auto"


def is_auto(schedule: object) -> bool:
    """True for ``"auto"`` or an :class:`AutoSchedule`."""
    return isinstance(schedule, AutoSchedule) or schedule == AUTO


class AutoSchedule:
    """The schedule search of a :class:`fastpipe.Pipe`, its options and what it measured and chose.

    ``Pipe(..., schedule="auto")`` makes one with the defaults; pass one to set them, e.g.
    ``Pipe(..., schedule=AutoSchedule(memory_limit=2**30))``.

    Args:
        memory_limit: the most bytes of activations (tensors saved for backward, parameters left
            out) and W records (what a split backward keeps from ``B`` to ``W``) one worker may
            hold at once; None: no limit. ``Pipe(memory_limit=)`` bounds the whole device.
        weight_share: W's part of each measured backward (see the module docstring).
        comm: link delay in seconds, a scalar or one per stage boundary.
        repeats: timed profiling passes (each layer's time is its fastest).
        timer: the profiler's clock (tests give a fake one); None: the wall clock.

    Attributes:
        costs: the per-stage costs measured at the first step (None before it).
        choice: the latest :class:`~fastpipe.schedule.search.Choice` (None before the first step).
        choices: every choice made, by number of micro-batches.
    """

    def __init__(
        self,
        memory_limit: float | None = None,
        *,
        weight_share: float = 0.5,
        comm: float | Sequence[float] = 0.0,
        repeats: int = 3,
        timer: Timer | None = None,
    ) -> None:
        if not 0.0 <= weight_share < 1.0:
            raise ValueError(f"fastpipe: weight_share must be in [0, 1) (W's part of the backward), got {weight_share}")
        self.weight_share = weight_share
        self.comm = comm
        self.repeats = repeats
        self.timer = timer
        self.costs: StageCosts | None = None
        #: What one micro-batch's ``B`` keeps until its ``W``, per stage (measured with the costs).
        self.w_records: list[float] | None = None
        self.choice: Choice | None = None
        self.choices: dict[int, Choice] = {}
        self.memory_limit = memory_limit

    @property
    def memory_limit(self) -> float | None:
        """The limit searched under; setting it drops the choices made (the costs stay measured)."""
        return self._memory_limit

    @memory_limit.setter
    def memory_limit(self, limit: float | None) -> None:
        if limit is not None and not (isinstance(limit, (int, float)) and limit > 0):
            raise ValueError(f"fastpipe: memory_limit must be a number of bytes > 0 (or None), got {limit!r}")
        self._memory_limit = limit
        self.choices.clear()

    def __repr__(self) -> str:
        chosen = self.choice.chosen.label if self.choice else None
        return f"AutoSchedule(memory_limit={self.memory_limit}, chosen={chosen!r})"

    def measure(self, partitions: Sequence[nn.Sequential], microbatch: Value, side: Mapping[str, Any]) -> StageCosts:
        """Profiles the stages' layers on ``microbatch`` (with its side inputs) and sums them per stage."""
        layers = [layer for stage in partitions for layer in stage]
        whole = {name: broadcast(value) for name, value in side.items()}  # already one micro-batch's
        # Deferred BatchNorms count the profiled runs into a slot of their own, dropped after: the
        # step's running statistics see only the step's micro-batches.
        slot = object()
        model = nn.Sequential(*layers)
        spans: list[SkipSpan] = []
        with accumulating_into(slot):
            try:
                profile = profile_layers(model, microbatch, repeats=self.repeats, side_inputs=whole, timer=self.timer)
                if has_skips(model):  # the skips' forward must not move the step's generators or statistics
                    with state_kept(model, None):
                        spans = measure_skips(model, microbatch, **whole)
                self.w_records = _w_records(model, [len(p) for p in partitions], microbatch, side)
            finally:
                for layer in layers:
                    for norm in layer.modules():
                        if isinstance(norm, DeferredBatchNorm):
                            norm.discard(slot)
        bounds = [0]
        for stage in partitions:
            bounds.append(bounds[-1] + len(stage))

        def per_stage(per_layer: Sequence[float]) -> list[float]:
            return [float(sum(per_layer[a:b])) for a, b in zip(bounds, bounds[1:])]

        forward, backward = per_stage(profile.forward), per_stage(profile.backward)
        # A skip is held by the stage that stashes it and the one that pops it (as peak_memory counts it).
        activation = [
            a + skip_bytes(spans, b, e) for a, b, e in zip(per_stage(profile.activation_bytes), bounds, bounds[1:])
        ]
        # A stage too fast for the clock still costs something: the search needs F, B > 0.
        tick = 1e-9
        return StageCosts.from_measured(
            [max(f, tick) for f in forward],
            [max(b, tick) for b in backward],
            activation,
            weight_share=self.weight_share,
            comm=self.comm,
        )

    def choose(
        self,
        partitions: Sequence[nn.Sequential],
        microbatches: Sequence[Value],
        side: Sequence[Mapping[str, Any]],
        wgrad_batch: int = 1,
    ) -> Choice:
        """The choice for this many micro-batches, measuring the stages first if not yet done.

        Raises:
            ValueError: no schedule fits ``memory_limit`` (the message names the least peak).
        """
        if self.costs is None:
            self.costs = self.measure(partitions, microbatches[0], side[0] if side else {})
        count = len(microbatches)
        if count not in self.choices:
            try:
                self.choices[count] = search(
                    self.costs,
                    self.costs.num_stages,
                    count,
                    self.memory_limit,
                    w_records=self.w_records,
                    wgrad_batch=wgrad_batch,
                )
            except ScheduleError as exc:
                raise ValueError(
                    f"fastpipe: schedule='auto': {exc} (memory in bytes of saved activations and W records)"
                ) from exc
        self.choice = self.choices[count]
        return self.choice


@dataclass(frozen=True)
class AutoRun:
    """One step's inputs to the search: the stages and the micro-batches it would measure on."""

    search: AutoSchedule
    partitions: Sequence[nn.Sequential]
    microbatches: Sequence[Value]
    side: Sequence[Mapping[str, Any]]
    wgrad_batch: int = 1

    def schedule(self, asked: object) -> Schedule:
        """The schedule to run: ``asked``'s choice if it is an :class:`AutoSchedule`, else this run's search's."""
        chooser = asked if isinstance(asked, AutoSchedule) else self.search
        return chooser.choose(self.partitions, self.microbatches, self.side, self.wgrad_batch).schedule


def _w_records(model: nn.Sequential, balance: Sequence[int], microbatch: Value, side: Mapping[str, Any]) -> list[float]:
    """Per stage, what one micro-batch's split backward keeps from ``B`` to ``W`` (no step is run)."""
    from fastpipe.memory.stage_bytes import measure_stages  # it imports the runtime, which imports this module

    with state_kept(model, None):  # the extra forward must not move generators or statistics
        stages = measure_stages(model, balance, microbatch, side_inputs=side, transients=False)
    return [float(st.w_records + st.w_kept) for st in stages]
