"""``Pipe.forward`` as one autograd node, whose backward runs the pipeline's backward.

autograd sees the whole pipeline as a single node between the caller's input (and the
stages' parameters) and the output::

    x ──┐                                       ┌── out ── loss
        ├── PipelineNode (F of every stage) ────┤
    W ──┘        ▲ backward: BW of every stage, in the stages' workers

Its backward runs every stage's backward in that stage's worker (see
:mod:`fastpipe.runtime.threads`), instead of letting autograd's single CPU thread walk one
graph stitched across stages; on a GPU device thread the GPU stages run inline
(:mod:`fastpipe.runtime.inline`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from fastpipe.runtime.step import StepState
from fastpipe.runtime.threads import LocalRuntime
from fastpipe.runtime.worker import CallerState
from fastpipe.schedule import Schedule
from fastpipe.step.microbatch import Value, gather, tensors_of

__all__ = ["NodeRun", "PipelineNode", "join_input_grads"]


@dataclass
class NodeRun:
    """Carries one step's arguments into and out of the autograd node.

    Attributes:
        runtime: the thread driver that runs the step.
        after_forward: called once the forward has run (e.g. commits deferred BatchNorm statistics).
    """

    runtime: LocalRuntime
    after_forward: Callable[[], None]
    schedule: Schedule
    microbatches: list[Value]
    checkpoint: Callable[[int], bool]
    caller: CallerState
    step_seed: int
    input_devices: list[torch.device]
    side: Sequence[Mapping[str, Any]] = ()
    fold_grads: Callable[[list[list[Tensor | None]]], list[list[Tensor | None]]] = lambda grads: grads
    output_structure: Value = ()
    state: StepState | None = None
    output_sizes: list[int] = field(default_factory=list)


class PipelineNode(torch.autograd.Function):
    """The whole pipeline as one autograd node: ``apply(run, *inputs, *params)``."""

    @staticmethod
    def forward(ctx: Any, run: NodeRun, *tensors: Tensor) -> Any:
        outputs, state = run.runtime.forward(
            run.schedule,
            run.microbatches,
            grad=True,
            checkpoint=run.checkpoint,
            caller=run.caller,
            step_seed=run.step_seed,
            side=run.side,
        )
        run.after_forward()
        run.microbatches = []  # the state holds what backward needs
        run.state = state
        run.output_sizes = [tensors_of(o)[0].size(0) for o in outputs]
        joined = gather(outputs)
        run.output_structure = joined
        flat = tensors_of(joined)
        ctx.run = run
        ctx.mark_non_differentiable(*[t for t in flat if not (t.is_floating_point() or t.is_complex())])
        return tuple(flat)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        run: NodeRun = ctx.run
        assert run.state is not None
        # The outputs themselves, kept for Pipe.forward to rebuild their structure: they hold
        # this node, so keeping them past a failed backward would keep the pipe alive.
        run.output_structure = ()
        per_mb: list[list[Tensor | None]] = [[] for _ in run.output_sizes]
        for g in grads:
            pieces = [None] * len(run.output_sizes) if g is None else list(g.split(run.output_sizes, dim=0))
            for m, piece in enumerate(pieces):
                per_mb[m].append(piece)
        # autograd runs this node on the engine thread of its gradients' device (the first
        # non-CPU one, as the engine picks it); on a device thread the stages on that
        # device must run their backward here (see runtime.inline).
        thread_device = next((g.device for g in grads if g is not None and g.device.type != "cpu"), None)
        input_grads, param_grads = run.runtime.backward(run.state, per_mb, thread_device=thread_device)
        flat_params = [g for stage in run.fold_grads(param_grads) for g in stage]
        return (None, *join_input_grads(input_grads, run.input_devices), *flat_params)


def join_input_grads(
    input_grads: Sequence[Sequence[Tensor | None]], devices: Sequence[torch.device]
) -> list[Tensor | None]:
    """One gradient per input tensor, joined over micro-batches, on that input's device.

    Stage 0 computes them on its own device; autograd wants each where its input lives
    (e.g. a CPU batch fed to a pipeline whose first stage is on a GPU).
    """
    joined: list[Tensor | None] = []
    for i, device in enumerate(devices):
        parts = [g for mb in input_grads if (g := mb[i]) is not None]
        joined.append(torch.cat(parts).to(device) if parts and len(parts) == len(input_grads) else None)
    return joined
