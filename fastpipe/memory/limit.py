"""``Pipe(memory_limit=...)``: each device's predicted peak checked before the first step runs.

The first ``train_step`` of each schedule and micro-batch count measures the stages once on
one micro-batch (:func:`fastpipe.memory.stage_bytes.measure_stages`), predicts every
device's peak over the step (:func:`fastpipe.memory.model.predict_memory`: parameters,
gradients, optimizer state, activations, W records, skips), and raises before any action
runs when one device would exceed the limit, naming the device and what it holds.

The model is within 5% of the counted bytes on every schedule
(tests/memory/test_model_ranks.py), so a device passes only if its prediction plus
:data:`MARGIN` fits. The optimizer is not the pipe's to know: its state is counted as
``optimizer`` says (Adam's two moments by default, the most the common optimizers keep).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from fastpipe.balance._untouched import state_kept
from fastpipe.memory.model import DeviceMemory, OptimizerSpec, StageBytes, predict_memory
from fastpipe.memory.sizes import format_bytes, parse_bytes
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.model.skip_memory import measure_skips, stage_skip_edges
from fastpipe.model.skips import has_skips
from fastpipe.runtime.options import RuntimeOptions
from fastpipe.schedule.ir import Schedule
from fastpipe.step.recompute_policy import Recompute, stage_mode

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations only, so 3.10 runs this module too

    from fastpipe.memory.offload_bytes import OffloadBytes

__all__ = ["MARGIN", "GuardedStep", "MemoryGuard", "limit_source", "over_limit", "refusal", "sample_key"]

#: A step as :meth:`MemoryGuard.predict` takes it: layers, balance, schedule, checkpoint, wgrad_batch,
#: sample, target, loss_fn.
GuardedStep = tuple[
    Sequence[nn.Module], Sequence[int], Schedule, str | Recompute, int, Any, Any, Callable[[Any, Any], Tensor] | None
]

#: The share of a prediction kept free for the model's error (it is within 5% of counted bytes).
MARGIN = 0.05


class MemoryGuard:
    """Checks a pipe's steps against ``limit`` bytes per device, once per schedule and step shape.

    Args:
        limit: bytes per device: an int, or a size such as ``"24GiB"`` (:func:`~fastpipe.memory.sizes.parse_bytes`).
        optimizer: the optimizer whose state to count (:func:`~fastpipe.memory.model.optimizer_factor`).
        options: the pipe's switches, which decide how its Linears' weight gradients are made.
        source: what the limit is where no ``memory_limit`` was given (:func:`limit_source`); None: ``memory_limit``.
    """

    def __init__(
        self,
        limit: int | float | str,
        optimizer: OptimizerSpec = "adam",
        options: RuntimeOptions | None = None,
        source: str | None = None,
    ) -> None:
        self.limit = parse_bytes(limit)
        self.source = source
        self.optimizer = optimizer
        self.options = options or RuntimeOptions()
        self.predicted: dict[tuple[Any, ...], list[DeviceMemory]] = {}
        #: The prediction of the last step checked, one :class:`~fastpipe.memory.model.DeviceMemory` per device.
        self.last: list[DeviceMemory] = []
        #: What the last step checked recomputes: the pipe's ``checkpoint``, or what ``"auto"`` chose.
        self.checkpoint: str | Recompute | None = None
        #: What the pipe's offload takes off each device (:mod:`fastpipe.memory.offload`), or None.
        self.offload: OffloadBytes | None = None
        self._measured: dict[tuple[Any, ...], list[StageBytes]] = {}  # a step's stages do not depend on its schedule
        self._skips: dict[Any, list[tuple[int, int, float]]] = {}  # per sample shape: the skips between stages

    def predict(
        self,
        layers: Sequence[nn.Module],
        balance: Sequence[int],
        schedule: Schedule,
        checkpoint: str | Recompute,
        wgrad_batch: int,
        sample: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Tensor] | None,
    ) -> list[DeviceMemory]:
        """The devices' predicted peaks for a step, measured once per key.

        Args:
            layers: the pipe's layers in order.
            balance: layers per stage.
            schedule: the step's schedule.
            checkpoint: the pipe's checkpoint mode, or a per-layer policy (the stages are then
                measured with its regions recomputed).
            wgrad_batch: micro-batches per batched W.
            sample: one micro-batch of input.
            target: its target.
            loss_fn: the step's loss (None: the output's gradient is ones).
        """
        key = (
            schedule,
            checkpoint,
            wgrad_batch,
            sample_key(sample),
            None if self.offload is None else self.offload.key,
            loss_fn is None,  # forward's measure, with no loss on the last stage
        )
        devices = self.predicted.get(key)
        if devices is None:
            policy = checkpoint if isinstance(checkpoint, Recompute) else None
            module = nn.Sequential(*layers)
            measured = (None if policy is None else policy.regions_key, key[3], schedule.split_backward, key[-1])
            stages = self._measured.get(measured) or measure_stages(
                module,
                balance,
                sample,
                loss_fn=loss_fn,
                target=target,
                recompute=policy,
                split=measured[2],
                fused_wgrad=self.options.fused_wgrad,
                wgrad_fuse_min=self.options.wgrad_fuse_min,
            )
            self._measured[measured] = stages
            skips = self._skips.get(key[3])
            if skips is None:  # a skip between stages is held apart from both (fastpipe.model.skip_memory)
                spans = []
                if has_skips(module):
                    with state_kept(module, None):
                        spans = measure_skips(module, sample)
                skips = self._skips[key[3]] = [(a, b, float(n)) for a, b, n in stage_skip_edges(spans, balance)]
            if self.offload is not None:
                stages = self.offload.stage_bytes(stages, sample, target, loss_fn)
            input_grad = isinstance(sample, Tensor) and sample.requires_grad
            devices = predict_memory(
                schedule,
                stages,
                checkpoint=stage_mode(checkpoint),
                optimizer=self.optimizer,
                wgrad_batch=wgrad_batch,
                input_grad=input_grad,
                skips=skips,
            )
            self.predicted[key] = devices
        return devices

    def check(self, *step: Unpack[GuardedStep]) -> list[DeviceMemory]:
        """The devices' predicted peaks for this step (:meth:`predict`'s); ``ValueError`` if one exceeds the limit.

        Args:
            step: the step, as :meth:`predict` takes it.
        """
        devices = self.predict(*step)
        self.last = devices
        self.checkpoint = step[3]
        over = over_limit(devices, self.limit)
        if over is not None:
            raise ValueError(refusal(over, self.limit, self.source))
        return devices


def over_limit(devices: Sequence[DeviceMemory], limit: int) -> DeviceMemory | None:
    """The device furthest over ``limit`` bytes once :data:`MARGIN` is kept free; None when all fit."""
    over = [d for d in devices if d.total * (1 + MARGIN) > limit]
    return max(over, key=lambda d: d.total) if over else None


def refusal(device: DeviceMemory, limit: int, source: str | None = None) -> str:
    """Why ``device`` cannot run under ``limit`` bytes: what it needs, by part, and what to change.

    ``source`` names the limit where no ``memory_limit`` was given (:func:`limit_source`).
    """
    named = f"memory_limit={format_bytes(limit)}" if source is None else f"{source} ({format_bytes(limit)})"
    parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in device.parts.items() if n)
    offload = "" if device.offloaded else ", offload saved activations to host memory (offload='auto')"
    return (
        f"fastpipe: device {device.worker} (stages {', '.join(map(str, device.stages))}) needs "
        f"{format_bytes(device.total)}, plus {MARGIN:.0%} kept for the prediction's error, over "
        f"{named}: {parts}. Raise the limit, recompute "
        f"(checkpoint='always'){offload}, use fewer or smaller micro-batches, or spread the model over more devices"
    )


def limit_source(devices: Sequence[Any]) -> str:
    """How a refusal names a limit taken from ``devices``' capacity (:mod:`fastpipe.memory.capacity`)."""
    names = ", ".join(dict.fromkeys(str(d) for d in devices))
    return f"the capacity of {names}, taken as the limit since no memory_limit was given"


def sample_key(value: Any) -> Any:
    """What a measurement of one micro-batch depends on: its tensors' shapes, dtypes and devices, nested as given."""
    if isinstance(value, Tensor):
        return (tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (tuple, list)):
        return tuple(sample_key(v) for v in value)
    return type(value).__name__
