"""What a stage needs on its device: the memory side of ``balance="auto"`` with ``memory_limit``.

Each layer is measured once as a stage of its own (:func:`layer_bytes`, by
:func:`~fastpipe.memory.stage_bytes.measure_stages`). A stage of layers ``a:b`` is composed from
them (:func:`compose`): parameters, gradients, optimizer bytes, activations and W records add up;
its input is its first layer's; what one action holds only while it runs is the largest of its
layers'. Adding the layers' activations counts every layer's output as held, which a next layer
that does not save its input frees early, so the sum is at or above the stage measured whole.

:class:`StageNeed` turns that into device bytes: the peak
:func:`~fastpipe.memory.model.predict_memory` predicts for the device of stage ``s`` if it held
layers ``a:b`` (its other stages, under interleaved or V schedules, counted apart), plus
:data:`~fastpipe.memory.limit.MARGIN`, as ``Pipe(memory_limit=)`` checks it. A skip that leaves
the stage is held by it until its backward, one that arrives until its ``W``; both are counted as
part of the stage's input, which recompute keeps too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fastpipe.balance._untouched import state_kept
from fastpipe.balance.planner import BalanceError
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes, predict_memory
from fastpipe.memory.sizes import format_bytes
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.model.skip_memory import SkipSpan
from fastpipe.schedule import Schedule, ScheduleError
from fastpipe.schedule.simulate import simulate_times
from fastpipe.step.microbatch import Value, replace_tensors, tensors_of
from fastpipe.step.recompute_policy import stage_mode

__all__ = ["StageNeed", "compose", "layer_bytes"]

# Bytes that one action holds only while it runs: a stage holds its largest layer's, not their sum.
# A first backward's bytes above its end (bw_first) too: while layer i's backward runs, the sums of
# the layers before it, which its end holds, are not made yet, so the stage is at most layer i's
# above its end.
_UNSHARED = ("output_stashed", "skip_grads_shared", "tie_grads")
_LARGEST = frozenset({"f_transient", "b_transient", "bw_transient", "w_stacked", "bw_first"})


def layer_bytes(module: nn.Sequential, microbatch: Value, side_inputs: Mapping[str, Any]) -> list[StageBytes]:
    """Each layer's :class:`~fastpipe.memory.model.StageBytes` on one micro-batch, measured where the layers are.

    The model's buffers and torch's generators are left as they were (:func:`state_kept`).
    """
    device = next((t.device for t in [*module.parameters(), *module.buffers()]), torch.device("cpu"))
    sample = replace_tensors(microbatch, [t.to(device) for t in tensors_of(microbatch)])
    with state_kept(module, None):
        return measure_stages(module, [1] * len(module), sample, side_inputs=side_inputs)


def compose(layers: Sequence[StageBytes], a: int, b: int, spans: Sequence[SkipSpan] = ()) -> StageBytes:
    """The bytes of a stage of layers ``a:b`` from theirs, with the skips that cross its bounds (see the module)."""
    part = layers[a:b]
    values: dict[str, Any] = {}  # the int fields
    for f in dataclasses.fields(StageBytes):
        # Which skips and ties stay inside the stage is not known per layer: skips' sharing is left
        # out (more bytes), and so is a tie's copy at the step's end (the pipe's guard measures it).
        if f.name in ("input", "gradients", "optimized", "w_gemms", "w_input", "bw_peak", *_UNSHARED):
            continue
        numbers = [getattr(st, f.name) for st in part]
        values[f.name] = max(numbers) if f.name in _LARGEST else sum(numbers)
    crossing = sum(s.nbytes for s in spans if (a <= s.producer < b) != (a <= s.consumer < b))
    return StageBytes(
        **values,
        input=part[0].input + crossing,
        w_input=part[0].w_input,  # only the first layer reads the stage's input
        # A first backward reaches layer i with the sums of the layers after it made.
        bw_peak=max((st.bw_peak + sum(t.trainable for t in part[i + 1 :]) for i, st in enumerate(part)), default=0),
        gradients=sum(st.trainable for st in part),
        optimized=sum(st.stepped for st in part),
        w_gemms=tuple(g for st in reversed(part) for g in st.w_gemms),  # W runs the last layer's Linears first
    )


class StageNeed:
    """``need(a, b, s)``: the device bytes stage ``s`` needs holding layers ``a:b``, margin included.

    Args:
        layers: each layer's bytes (:func:`layer_bytes`).
        schedule: the schedule the pipe will run (its stages and placement).
        checkpoint: the pipe's checkpoint mode (another policy counts as ``"never"``: the most).
        optimizer: the optimizer whose state to count.
        wgrad_batch: micro-batches per batched ``W``.
        spans: the model's skips (:func:`~fastpipe.model.skip_memory.measure_skips`).
    """

    def __init__(
        self,
        layers: Sequence[StageBytes],
        schedule: Schedule,
        *,
        checkpoint: object = "never",
        optimizer: OptimizerSpec = "adam",
        wgrad_batch: int = 1,
        spans: Sequence[SkipSpan] = (),
    ) -> None:
        self.layers = list(layers)
        self.schedule = schedule
        self.checkpoint = stage_mode(checkpoint)
        self.optimizer = optimizer
        self.wgrad_batch = wgrad_batch
        self.spans = list(spans)
        self._times = simulate_times(schedule)
        self._memo: dict[tuple[int, int, int], DeviceMemory] = {}

    def __call__(self, a: int, b: int, s: int) -> float:
        return self.device(a, b, s).total * (1 + MARGIN)

    def device(self, a: int, b: int, s: int) -> DeviceMemory:
        """The prediction for stage ``s``'s device with layers ``a:b`` as stage ``s`` and nothing else."""
        key = (a, b, s)
        if key not in self._memo:
            stages = [StageBytes(parameters=0, activation=0)] * self.schedule.num_stages
            stages[s] = compose(self.layers, a, b, self.spans)
            own = {action: when for action, when in self._times.items() if action.stage == s}
            try:  # the other stages hold nothing: only this one's actions add bytes
                devices = self._predict(stages, own)
            except ScheduleError:
                devices = self._predict(stages, self._times)
            self._memo[key] = devices[self.schedule.worker_of(s)]
        return self._memo[key]

    def devices(self, balance: Sequence[int]) -> list[DeviceMemory]:
        """Every device's prediction under ``balance`` (each device with all of its stages)."""
        bounds = [0]
        for size in balance:
            bounds.append(bounds[-1] + size)
        stages = [compose(self.layers, a, b, self.spans) for a, b in zip(bounds, bounds[1:])]
        return self._predict(stages, self._times)

    def _predict(self, stages: list[StageBytes], times: Any) -> list[DeviceMemory]:
        return predict_memory(
            self.schedule,
            stages,
            times=times,
            checkpoint=self.checkpoint,
            optimizer=self.optimizer,
            wgrad_batch=self.wgrad_batch,
        )

    def refusal(self, limit: int) -> BalanceError:
        """Why no balance fits ``limit``: the stage that needs the most at its least, and what it holds.

        Every stage at its smallest (one layer; the first and last stages keep the ends) must fit;
        where each does, the cut whose fullest stage needs the least is named instead.
        """
        n, k = len(self.layers), self.schedule.num_stages
        floors = []
        for s in range(k):
            starts = [0] if s == 0 else [n - 1] if s == k - 1 else range(s, n - k + s + 1)
            floors.append(min(((a, a + 1, s) for a in starts), key=lambda e: self(*e)))
        where = max(floors, key=lambda e: self(*e))
        head = f"no balance into {k} stages fits memory_limit={format_bytes(limit)} per device: "
        if self(*where) > limit:
            which = (
                f"stage {where[2]} needs at least {format_bytes(self.device(*where).total)} (layer {where[0]} alone)"
            )
        else:
            cut = self._least_fullest(n, k)
            where = max(cut, key=lambda e: self(*e))
            balance = [b - a for a, b, _ in cut]
            which = (
                f"each stage fits alone, but every cut overfills one; the closest, {balance}, has stage {where[2]} "
                f"needing {format_bytes(self.device(*where).total)} (layers {where[0]}..{where[1] - 1})"
            )
        parts = ", ".join(f"{name} {format_bytes(v)}" for name, v in self.device(*where).parts.items() if v)
        return BalanceError(
            f"{head}{which}, plus {MARGIN:.0%} kept for the prediction's error: {parts}. Raise the limit, recompute "
            "(checkpoint='always'), use smaller micro-batches (more chunks), or plan more stages"
        )

    def _least_fullest(self, n: int, k: int) -> list[tuple[int, int, int]]:
        """The cut, as ``(a, b, s)`` per stage, whose fullest stage needs the least."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(k + 1)]
        came: dict[tuple[int, int], int] = {}
        best[0][0] = 0.0
        for j in range(1, k + 1):
            for i in range(j, n - (k - j) + 1):
                for h in range(j - 1, i):
                    value = max(best[j - 1][h], self(h, i, j - 1))
                    if value < best[j][i]:
                        best[j][i], came[(j, i)] = value, h
        cut, i = [], n
        for j in range(k, 0, -1):
            h = came[(j, i)]
            cut.append((h, i, j - 1))
            i = h
        return cut[::-1]
