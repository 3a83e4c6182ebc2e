"""``Pipe(..., schedule="auto")``: measure the stages once, then run the schedule the search picks.

At the first ``train_step`` under ``"auto"`` the pipe's layers are profiled on that step's first
micro-batch where they live (:func:`fastpipe.balance.profile_layers`: each layer's fastest
forward and backward of a few passes, and the bytes it saves for backward; a skip's bytes count
on the stage that stashes it and on the one that pops it). Summed per stage, these are the
costs :func:`fastpipe.schedule.search.search` simulates every candidate on. With a memory limit
(the :class:`AutoSchedule`'s, else the pipe's ``memory_limit``) each candidate is judged in device
bytes (:func:`fastpipe.memory.candidates.device_search`): its predicted peak on every device,
parameters, gradients, optimizer state, activations and W records counted, plus the 5% margin
``Pipe(memory_limit=)`` keeps, must fit; the fastest that fits runs. The costs and the stages'
bytes are measured once per :class:`AutoSchedule`; the choice
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

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fastpipe.balance._untouched import state_kept
from fastpipe.balance.profile import Timer, profile_layers
from fastpipe.memory.candidates import device_search
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes
from fastpipe.memory.sizes import parse_bytes
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.model.batchnorm import DeferredBatchNorm, accumulating_into
from fastpipe.model.side_inputs import broadcast
from fastpipe.model.skip_memory import SkipSpan, measure_skips, skip_bytes, stage_skip_edges
from fastpipe.model.skips import has_skips
from fastpipe.schedule import Schedule
from fastpipe.schedule.search import Choice, StageCosts
from fastpipe.step.microbatch import Value, tensors_of
from fastpipe.step.recompute_policy import stage_mode

__all__ = ["AUTO", "AutoRun", "AutoSchedule", "StepMemory", "is_auto"]

# The name that asks for the search instead of a named schedule.
AUTO = "auto"


def is_auto(schedule: object) -> bool:
    """True for ``"auto"`` or an :class:`AutoSchedule`."""
    return isinstance(schedule, AutoSchedule) or schedule == AUTO


@dataclass(frozen=True)
class StepMemory:
    """What a pipe's step tells the search about memory.

    Attributes:
        limit: the pipe's ``memory_limit`` in bytes per device (None: none), used where the
            :class:`AutoSchedule` has no limit of its own.
        checkpoint: the pipe's checkpoint mode (another policy than the three named ones counts
            as ``"never"``, which recomputes nothing and so predicts the most).
        target: one micro-batch's target, and ``loss_fn`` the step's loss: the last stage is
            measured with its loss, as the step runs it.
        loss_fn: see ``target``.
    """

    limit: int | None = None
    checkpoint: object = "never"
    target: Any = None
    loss_fn: Callable[[Any, Any], Tensor] | None = None


class AutoSchedule:
    """The schedule search of a :class:`fastpipe.Pipe`, its options and what it measured and chose.

    ``Pipe(..., schedule="auto")`` makes one with the defaults; pass one to set them, e.g.
    ``Pipe(..., schedule=AutoSchedule(memory_limit="24GiB"))``.

    Args:
        memory_limit: bytes per device, an int or a size such as ``"24GiB"``
            (:func:`~fastpipe.memory.sizes.parse_bytes`): a candidate runs only if every device's
            predicted peak plus 5% fits (see the module docstring); None: the pipe's
            ``memory_limit``, if any.
        weight_share: W's part of each measured backward (see the module docstring).
        comm: link delay in seconds, a scalar or one per stage boundary.
        repeats: timed profiling passes (each layer's time is its fastest).
        timer: the profiler's clock (tests give a fake one); None: the wall clock.
        optimizer: the optimizer whose state a device holds (:func:`~fastpipe.memory.model.optimizer_factor`).

    Attributes:
        costs: the per-stage costs measured at the first step (None before it).
        stage_bytes: each stage's bytes for one micro-batch, measured with the costs.
        choice: the latest :class:`~fastpipe.schedule.search.Choice` (None before the first step);
            each candidate's ``peak_memory`` holds every device's predicted peak in bytes.
        devices: the latest choice's prediction per device, by candidate label.
        choices: every choice made, by number of micro-batches.

    Raises:
        ValueError: a limit that is not a size (naming the accepted forms), or a bad ``weight_share``.
    """

    def __init__(
        self,
        memory_limit: int | float | str | None = None,
        *,
        weight_share: float = 0.5,
        comm: float | Sequence[float] = 0.0,
        repeats: int = 3,
        timer: Timer | None = None,
        optimizer: OptimizerSpec = "adam",
    ) -> None:
        if not 0.0 <= weight_share < 1.0:
            raise ValueError(f"fastpipe: weight_share must be in [0, 1) (W's part of the backward), got {weight_share}")
        self.weight_share = weight_share
        self.comm = comm
        self.repeats = repeats
        self.timer = timer
        self.optimizer = optimizer
        self.costs: StageCosts | None = None
        self.stage_bytes: list[StageBytes] | None = None
        self._exact = False  # stage_bytes measured with the transients and the loss, as a limit needs
        self._skips: list[tuple[int, int, float]] = []
        self.choice: Choice | None = None
        self.devices: dict[str, list[DeviceMemory]] = {}
        self.choices: dict[int, Choice] = {}
        self._devices: dict[int, dict[str, list[DeviceMemory]]] = {}
        self.memory_limit = memory_limit

    @property
    def memory_limit(self) -> int | None:
        """The limit searched under, in bytes per device; setting it drops the choices made (the costs stay)."""
        return self._memory_limit

    @memory_limit.setter
    def memory_limit(self, limit: int | float | str | None) -> None:
        self._memory_limit = None if limit is None else parse_bytes(limit)
        self.choices.clear()

    @property
    def w_records(self) -> list[float] | None:
        """What one micro-batch's ``B`` keeps until its ``W``, per stage (None before the first step)."""
        return None if self.stage_bytes is None else [float(st.w_records + st.w_kept) for st in self.stage_bytes]

    def __repr__(self) -> str:
        chosen = self.choice.chosen.label if self.choice else None
        return f"AutoSchedule(memory_limit={self.memory_limit}, chosen={chosen!r})"

    def measure(
        self,
        partitions: Sequence[nn.Sequential],
        microbatch: Value,
        side: Mapping[str, Any],
        memory: StepMemory | None = None,
    ) -> StageCosts:
        """Profiles the stages' layers on ``microbatch`` (with its side inputs) and sums them per stage.

        The stages' bytes (:attr:`stage_bytes`) are measured too: exactly (the transients each
        action holds, and the loss of ``memory``) where a limit applies, else only what ``W`` keeps.
        """
        layers = [layer for stage in partitions for layer in stage]
        whole = {name: broadcast(value) for name, value in side.items()}  # already one micro-batch's
        model = nn.Sequential(*layers)
        spans: list[SkipSpan] = []
        with _norms_untouched(layers):
            profile = profile_layers(model, microbatch, repeats=self.repeats, side_inputs=whole, timer=self.timer)
            if has_skips(model):  # the skips' forward must not move the step's generators or statistics
                with state_kept(model, None):
                    spans = measure_skips(model, microbatch, **whole)
        balance = [len(p) for p in partitions]
        self._skips = [(a, b, float(n)) for a, b, n in stage_skip_edges(spans, balance)]
        self._measure_bytes(partitions, microbatch, side, memory)
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

    def _measure_bytes(
        self, partitions: Sequence[nn.Sequential], microbatch: Value, side: Mapping[str, Any], memory: StepMemory | None
    ) -> None:
        layers = [layer for stage in partitions for layer in stage]
        model = nn.Sequential(*layers)
        exact = self._limit(memory) is not None
        loss = {"loss_fn": memory.loss_fn, "target": memory.target} if exact and memory is not None else {}
        with _norms_untouched(layers), state_kept(model, None):  # the extra runs must leave no trace
            self.stage_bytes = measure_stages(
                model, [len(p) for p in partitions], microbatch, side_inputs=side, transients=exact, **loss
            )
        self._exact = exact

    def _limit(self, memory: StepMemory | None) -> int | None:
        return self.memory_limit if self.memory_limit is not None else (memory.limit if memory else None)

    def choose(
        self,
        partitions: Sequence[nn.Sequential],
        microbatches: Sequence[Value],
        side: Sequence[Mapping[str, Any]],
        wgrad_batch: int = 1,
        memory: StepMemory | None = None,
    ) -> Choice:
        """The choice for this many micro-batches, measuring the stages first if not yet done.

        Raises:
            ValueError: no schedule fits the memory limit on every device (the message names the
                leanest candidate's fullest device and what it holds).
        """
        first_side = side[0] if side else {}
        if self.costs is None:
            self.costs = self.measure(partitions, microbatches[0], first_side, memory)
        limit = self._limit(memory)
        if limit is not None and not self._exact:  # measured before a limit applied
            self._measure_bytes(partitions, microbatches[0], first_side, memory)
            self.choices.clear()
        assert self.stage_bytes is not None
        count = len(microbatches)
        if count not in self.choices:
            mode = memory.checkpoint if memory is not None else "never"
            found = device_search(
                self.costs,
                self.stage_bytes,
                count,
                limit,
                checkpoint=stage_mode(mode),
                optimizer=self.optimizer,
                wgrad_batch=wgrad_batch,
                input_grad=any(t.requires_grad for t in tensors_of(microbatches[0])),
                skips=self._skips,
            )
            self.choices[count], self._devices[count] = found.choice, found.devices
        self.choice, self.devices = self.choices[count], self._devices[count]
        return self.choice


@contextlib.contextmanager
def _norms_untouched(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Deferred BatchNorms count the block's runs into a slot of their own, dropped after: the
    step's running statistics see only the step's micro-batches."""
    slot = object()
    with accumulating_into(slot):
        try:
            yield
        finally:
            for layer in layers:
                for norm in layer.modules():
                    if isinstance(norm, DeferredBatchNorm):
                        norm.discard(slot)


@dataclass(frozen=True)
class AutoRun:
    """One step's inputs to the search: the stages and the micro-batches it would measure on."""

    search: AutoSchedule
    partitions: Sequence[nn.Sequential]
    microbatches: Sequence[Value]
    side: Sequence[Mapping[str, Any]]
    wgrad_batch: int = 1
    memory: StepMemory | None = None

    def schedule(self, asked: object) -> Schedule:
        """The schedule to run: ``asked``'s choice if it is an :class:`AutoSchedule`, else this run's search's."""
        chooser = asked if isinstance(asked, AutoSchedule) else self.search
        return chooser.choose(self.partitions, self.microbatches, self.side, self.wgrad_batch, self.memory).schedule
