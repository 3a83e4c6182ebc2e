"""A pipeline stage: one contiguous slice of the model, pinned to a device, with what the
step runner (:mod:`fastpipe.runtime.step`) needs to know of it before the first step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from fastpipe.model.side_inputs import declared
from fastpipe.model.skips import StageSkips, has_skips
from fastpipe.runtime.offload import OffloadPolicy
from fastpipe.runtime.options import RuntimeOptions
from fastpipe.runtime.wgrad import fusable_linears, summing_linears

__all__ = ["Stage"]


@dataclass
class Stage:
    """One contiguous slice of the model, pinned to a device.

    Attributes:
        module: the layers of this stage.
        device: where its parameters live and its work runs.
        clone_input: copy the incoming activation before use, because the first layer
            works in place and would otherwise write into a tensor that autograd (or a
            recompute) still needs.
        options: the pipe's switches; this stage reads ``fused_wgrad`` and ``wgrad_batch``.
        offload: what its forwards offload to host memory (:mod:`fastpipe.runtime.offload`), or None.
    """

    module: nn.Module
    device: torch.device
    clone_input: bool = False
    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    offload: OffloadPolicy | None = None
    params: list[nn.Parameter] = field(init=False)
    linears: list[nn.Linear] = field(init=False)  # defer weight grads to W under a split backward (see wgrad)
    summing: list[nn.Linear] = field(init=False)  # those that sum in the GEMM in a combined backward
    early: list[int] = field(init=False)  # params whose gradient B takes under a split (see split_backward)
    wgrad_batch: int = field(init=False)  # micro-batches per deferred-W GEMM (see wgrad.CarriedRecords)
    side_names: tuple[str, ...] = field(init=False)  # the side inputs its layers take
    skips: StageSkips = field(init=False)  # where its skips (fastpipe.model.skips) go and come from: set by the runtime

    def __post_init__(self) -> None:
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.side_names = declared(self.module)
        self.skips = StageSkips(layers=has_skips(self.module))
        fused = self.options.fused_wgrad
        self.linears = fusable_linears(self.module, self.params) if fused else []
        self.summing = summing_linears(self.linears, self.options.wgrad_fuse_min_on(self.device))
        # Vector parameters (norm weights, biases) have reductions for gradients, cheap next to the
        # input gradient: B takes them too, which spares W the graph walk and lets B free the graph.
        self.early = [i for i, p in enumerate(self.params) if fused and p.dim() <= 1]
        self.wgrad_batch = self.options.wgrad_batch_on(self.device)
