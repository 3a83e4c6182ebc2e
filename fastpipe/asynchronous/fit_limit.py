"""``fit(memory_limit=...)``: each window's predicted peak per device, checked before its first action.

The first window of each shape (mini-batches, micro-batches, micro-batch shapes) measures the
stages once on its first micro-batch (:func:`fastpipe.memory.stage_bytes.measure_stages`),
with the layers' buffers and the random generators put back afterwards, so a run with a limit
trains exactly as one without. It then predicts every device's peak over the window
(:func:`fastpipe.asynchronous.memory.fit_devices`): what a ``train_step`` holds, plus the weight
copies of the consistency policy, one gradient sum per mini-batch, the optimizer step's
temporaries during each update, the state of the optimizer given to ``fit`` and, on a
:class:`~fastpipe.DistributedPipe`, its transport's receive buffers. A device whose prediction
plus :data:`~fastpipe.memory.limit.MARGIN` exceeds the limit stops the run with the same
``ValueError`` as ``train_step`` (:func:`fastpipe.memory.limit.refusal`), before any weight changes.

On a :class:`~fastpipe.DistributedPipe` each rank measures its own stages and the figures are
relayed down the pipeline as for its ``train_step`` (:mod:`fastpipe.distributed.memory_limit`),
so every rank reaches the same verdict.

Under ``checkpoint="auto"`` (a pipe's default under ``memory_limit``) each window shape runs the
least whole-stage recompute whose prediction fits: ``"never"``, then ``"except_last"``, then
``"always"``, from the one measurement. Under ``offload="auto"`` each recompute tried first gets,
per device, the least offloaded share in eighths whose prediction fits
(:func:`~fastpipe.memory.offload_choice.choose_fractions`, as a ``train_step`` chooses), and the
window's stages run with it. Every rank of a pipeline predicts from the same figures, so all
choose alike; data-parallel replicas may choose apart, which changes only their memory and time,
not their gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from fastpipe.asynchronous.memory import fit_devices, update_temporaries
from fastpipe.asynchronous.window import Window
from fastpipe.balance._untouched import grads_set_aside, state_kept
from fastpipe.memory.limit import over_limit, refusal
from fastpipe.memory.model import DeviceMemory, StageBytes
from fastpipe.memory.offload_choice import StageOffload, choose_fractions, offloaded_stages, prefetching
from fastpipe.memory.optimizer import optimizer_factor
from fastpipe.memory.sizes import parse_bytes
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.model.skip_memory import measure_skips, stage_skip_edges
from fastpipe.model.skips import has_skips
from fastpipe.schedule.multistep import build_multistep
from fastpipe.step.microbatch import tensors_of, to_device
from fastpipe.step.recompute_policy import stage_mode

if TYPE_CHECKING:
    from fastpipe.asynchronous.fit_run import FitRun

__all__ = ["FitMemoryGuard"]

#: State bytes per parameter byte counted for an optimizer whose state is not known yet (Adam's two moments).
_UNKNOWN_STATE = 2.0
_LEAST_FIRST = ("never", "except_last", "always")  # what checkpoint="auto" tries, in this order


class FitMemoryGuard:
    """Checks a ``fit`` run's windows against ``limit`` bytes per device.

    Args:
        limit: bytes per device: an int, or a size such as ``"24GiB"`` (:func:`~fastpipe.memory.sizes.parse_bytes`).
        source: what the limit is where no ``memory_limit`` was given (:func:`~fastpipe.memory.limit.limit_source`).

    Attributes:
        limit: the budget in bytes.
        predicted: every device's prediction, by window shape.
        chosen: the whole-stage recompute each window shape runs with.
        offload: each stage's offloaded share, by window shape (under ``offload="auto"``, the least that fits).
        last: every device's prediction for the last window checked.
        checkpoint: what the last window checked recomputes: the pipe's mode, or what ``"auto"`` chose.
    """

    def __init__(self, limit: int | float | str, source: str | None = None) -> None:
        self.limit = parse_bytes(limit)
        self.source = source
        self.predicted: dict[tuple[Any, ...], list[DeviceMemory]] = {}
        self.chosen: dict[tuple[Any, ...], str] = {}
        self.offload: dict[tuple[Any, ...], list[float]] = {}
        self.last: list[DeviceMemory] = []
        self.checkpoint: str | None = None

    def check(self, run: FitRun, window: Window) -> list[DeviceMemory]:
        """The devices' predicted peaks over ``window``; ``ValueError`` if one exceeds the limit.

        Call it on every rank, before the window's first action. Ranks key the window by what
        they all know (its micro-batch sizes), so that they measure again together.
        """
        local = hasattr(run.pipe, "partitions")
        shape = tuple((tuple(t.shape), t.dtype) for t in tensors_of(window.inputs[0])) if local else ()
        key = (window.minibatches, window.microbatches, tuple(window.sizes), shape)
        auto = isinstance(run.checkpoint_mode, str) and run.checkpoint_mode == "auto"
        offload: Any = cast(Any, run.pipe)._offload
        if key not in self.predicted:
            measured = _measure(run, window)
            told = measured[0].told
            fractions = [0.0 if t is None else t.fraction for t in told]
            stream = build_multistep(run.num_stages, window.microbatches, window.minibatches,
                                     flush=run.consistency == "sync", workers=run.num_workers)  # fmt: skip
            for mode in _LEAST_FIRST if auto else (run.checkpoint_mode,):  # the least recompute first
                predict = partial(_predict, run, window, measured, mode)
                if offload.auto:
                    fractions = choose_fractions(predict, stream, told, self.limit)
                devices = predict(fractions)
                if over_limit(devices, self.limit) is None:
                    break
            self.predicted[key], self.chosen[key], self.offload[key] = devices, mode, fractions
        devices, self.checkpoint = self.predicted[key], self.chosen[key]
        offload.apply(self.offload[key])  # "auto"'s shares, set before the window's prefetches are added
        self.last = devices
        over = over_limit(devices, self.limit)
        if over is not None:
            tried = f" (checkpoint='auto' tried {', '.join(_LEAST_FIRST)})" if auto else ""
            raise ValueError(refusal(over, self.limit, self.source) + tried)
        return devices


def _measure(run: FitRun, window: Window) -> tuple[_Measured, dict[int, int]]:
    """The window's stages, measured once on its first micro-batch, and each stage's update temporaries."""
    transient = {s: update_temporaries(run.optimizer, st.params, run.max_grad_norm) for s, st in run.stages.items()}
    mode: Any = run.checkpoint_mode
    policy = None if isinstance(mode, str) else mode  # a per-layer policy: measured with its regions recomputed
    if hasattr(run.pipe, "partitions"):
        return _local(run, window, policy), transient
    return _ranks(run, window, transient), transient


def _predict(
    run: FitRun, window: Window, measured: tuple[_Measured, dict[int, int]], mode: Any, fractions: Sequence[float]
) -> list[DeviceMemory]:
    """Every device's peak over ``window`` under recompute ``mode`` and offloaded ``fractions`` (one per stage)."""
    try:
        factor = optimizer_factor(run.optimizer)
    except ValueError:  # an optimizer of its own kind, before its first step: count Adam's state
        factor = _UNKNOWN_STATE
    found, transient = measured
    stages = offloaded_stages(found.stages, found.told, fractions)
    moving = [s for s, f in enumerate(fractions) if f > 0]
    whole = stage_mode(mode)  # what recomputes whole stages in fit
    return fit_devices(
        stages,
        microbatches=window.microbatches,
        minibatches=window.minibatches,
        consistency=run.consistency,
        checkpoint=whole,
        optimizer=factor,
        update_transient=[transient.get(s, 0) for s in range(run.num_stages)],
        workers=run.num_workers,
        transport=found.transport,
        skips=found.skips,
        first_input=found.first_input,
        window_bytes=found.window_bytes,
        prefetch=partial(prefetching, stages=moving, lookahead=found.lookahead),
    )


def _nbytes(values: Any) -> int:
    return sum(t.numel() * t.element_size() for v in values for t in tensors_of(v))


@dataclass
class _Measured:
    """What a window shape's prediction starts from, measured once.

    Attributes:
        stages: each stage's bytes, nothing offloaded.
        skips: the skips between stages, ``(producer, consumer, bytes)``.
        first_input: whether ``fit`` copies the micro-batches to stage 0's device.
        window_bytes: per stage, the bytes its device holds for the whole window besides.
        transport: the pipeline's transport, as the memory model names it.
        told: per stage, what it can offload (:class:`~fastpipe.memory.offload_choice.StageOffload`).
        lookahead: compute actions between a prefetch and its backward.
    """

    stages: list[StageBytes]
    skips: list[tuple[int, int, float]]
    first_input: bool
    window_bytes: list[int]
    transport: str
    told: list[StageOffload | None]
    lookahead: int


def _local(run: FitRun, window: Window, policy: Any) -> _Measured:
    """A :class:`fastpipe.Pipe`'s stages, measured here on the window's first micro-batch."""
    pipe: Any = run.pipe
    module = nn.Sequential(*[m for p in pipe.partitions for m in p])
    first, last = run.stages[0], run.stages[run.num_stages - 1]
    sample = to_device(window.inputs[0], first.device)
    target = to_device(window.targets[0], last.device)
    side = window.side[0] if window.side else {}
    with state_kept(module, None), grads_set_aside(module):
        stages = measure_stages(
            module,
            pipe.balance,
            sample,
            side_inputs=side,
            loss_fn=run.loss_fn,
            target=target,
            fused_wgrad=first.options.fused_wgrad,
            wgrad_fuse_min=first.options.wgrad_fuse_min,
            recompute=policy,
        )
        spans = measure_skips(module, sample, **side) if has_skips(module) else []
    told = pipe._offload.told(sample, target, run.loss_fn)  # what each stage can take off its device
    skips = [(a, b, float(n)) for a, b, n in stage_skip_edges(spans, pipe.balance)]
    # fit copies the micro-batches to stage 0's device and the window's targets to the last stage's.
    first_input = any(t.device != first.device for t in tensors_of(window.inputs[0]))
    moved = _nbytes(t for t in window.targets if any(x.device != last.device for x in tensors_of(t)))
    window_bytes = [0] * (run.num_stages - 1) + [moved]
    return _Measured(stages, skips, first_input, window_bytes, "local", told, pipe._offload.lookahead)


def _ranks(run: FitRun, window: Window, transient: dict[int, int]) -> _Measured:
    """A :class:`~fastpipe.DistributedPipe`'s stages, each measured by its rank and relayed to every rank."""
    from fastpipe.distributed.memory_limit import _relay

    pipe: Any = run.pipe
    runtime = pipe.runtime
    step: Any = SimpleNamespace(microbatches=window.inputs or None, side=window.side, targets=window.targets)
    stages, skips, _, _, told = _relay(pipe, step, run.loss_fn)

    def shared(value: int, stage: int, what: str) -> int:
        return int(runtime.broadcast(torch.tensor([value], dtype=torch.int64), runtime.placement[stage], what).item())

    for s in range(run.num_stages):  # each rank knows only its own stages' optimizer steps
        transient[s] = shared(transient.get(s, 0), s, f"stage {s}'s update bytes")
    # fit copies the whole window's inputs to stage 0's device, and its targets to the last stage's.
    first, last = run.stages.get(0), run.stages.get(run.num_stages - 1)
    inputs = _nbytes(v for v in window.inputs if first and any(t.device != first.device for t in tensors_of(v)))
    targets = _nbytes(t for t in window.targets if last and any(x.device != last.device for x in tensors_of(t)))
    window_bytes = [0] * run.num_stages
    window_bytes[0] += shared(inputs, 0, "the window's input bytes")
    window_bytes[-1] += shared(targets, run.num_stages - 1, "the window's target bytes")
    transport = "ordered" if runtime.ordered else "tags"
    return _Measured(stages, skips, False, window_bytes, transport, told, pipe._offload.lookahead)
