"""The step runner of a stream: forwards and backwards on version tensors, updates in place.

It extends the one-step :class:`~fastpipe.runtime.step.StepRunner` (same transport, same
recompute, same loss weighting) in three ways:

* each (stage, micro-batch) runs on the tensors its :class:`StageWeights` chose, through
  :func:`torch.func.functional_call`, never on the parameters themselves;
* a backward accumulates into its mini-batch's gradient sum, one per (stage, mini-batch);
* ``U(s, n)`` hands stage s's sum for mini-batch n to ``apply_update`` (the optimizer step)
  and moves the stage's live version on;
* each forward of mini-batch n accumulates :class:`~fastpipe.DeferredBatchNorm` statistics
  into that mini-batch's own slot, and ``U(s, n)`` commits exactly that slot of stage s's
  layers. A stage runs forwards of mini-batch n + 1 before ``U(s, n)`` (asynchronous
  stream), so committing whatever had accumulated would mix mini-batches. A recompute
  accumulates nothing, as in ``train_step``. Running statistics are buffers, not trainable
  parameters: the weight versions (stash, predict) do not version them, so every forward
  reads and every commit writes the stage's one set.
"""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn
from torch.func import functional_call

from fastpipe.asynchronous.weights import StageWeights
from fastpipe.model.batchnorm import DeferredBatchNorm, accumulating_into
from fastpipe.runtime.step import LossSpec, Stage, StepRunner, StepState
from fastpipe.runtime.transport import Transport
from fastpipe.schedule import Action
from fastpipe.step.microbatch import Value

__all__ = ["MultistepRunner"]

ApplyUpdate = Callable[[int, int, Sequence[Tensor | None]], None]


def norm_slot(minibatch: int) -> tuple[str, int]:
    """The DeferredBatchNorm slot of a window's mini-batch (never the default slot, None)."""
    return ("fit", minibatch)


class _OnVersion(nn.Module):
    """Calls ``inner`` with its trainable parameters replaced by ``self.tensors``."""

    def __init__(self, inner: nn.Module, names: list[str]) -> None:
        super().__init__()
        self.inner = inner
        self.names = names
        self.tensors: Sequence[Tensor] = ()

    def forward(self, inputs: Any) -> Any:
        return functional_call(self.inner, dict(zip(self.names, self.tensors)), (inputs,), strict=False)


class _Bound(nn.Module):
    """Runs a callable while ``functional_call`` binds ``inner``'s parameters to version tensors."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, fn: Callable[[], Value]) -> Value:
        return fn()


class MultistepRunner(StepRunner):
    """F, BW and U handlers of one window of a stream (see the module docstring).

    Args:
        stages, num_stages, transport, state, checkpoint, loss: as for ``StepRunner``.
        weights: per stage, who chooses each micro-batch's weights.
        minibatch_size: micro-batches per update.
        apply_update: ``apply_update(stage, minibatch, grads)`` steps the optimizer for one
            stage; called from that stage's worker.
    """

    def __init__(
        self,
        stages: Mapping[int, Stage],
        num_stages: int,
        transport: Transport,
        state: StepState,
        *,
        checkpoint: Callable[[int], bool],
        loss: LossSpec,
        weights: Mapping[int, StageWeights],
        minibatch_size: int,
        apply_update: ApplyUpdate,
    ) -> None:
        own: dict[int, Stage] = {}
        self._live_params: dict[int, list[nn.Parameter]] = {}
        self._modules: dict[int, _OnVersion] = {}
        self.norms: dict[int, list[DeferredBatchNorm]] = {}
        for s, stage in stages.items():
            names = [n for n, p in stage.module.named_parameters() if p.requires_grad]
            mine = copy.copy(stage)  # its params are swapped per action; the Pipe's Stage stays as it is
            self._modules[s] = mine.module = _OnVersion(stage.module, names)
            self._live_params[s] = list(stage.params)
            self.norms[s] = [m for m in stage.module.modules() if isinstance(m, DeferredBatchNorm)]
            own[s] = mine
        super().__init__(own, num_stages, transport, state, grad=True, checkpoint=checkpoint, loss=loss)
        self.weights = weights
        self.minibatch_size = minibatch_size
        self.apply_update = apply_update
        self.sums: dict[tuple[int, int], list[Tensor | None]] = {}

    def handlers(self) -> dict[str, Callable[[Action], float]]:
        return {"F": self.forward, "BW": self.backward, "U": self.update, "P": self.state.offload.prefetch}

    def forward(self, action: Action) -> float:
        self.weights[action.stage].acquire(action.microbatch)
        with accumulating_into(norm_slot(action.microbatch // self.minibatch_size)):
            return super().forward(action)

    def _run_module(self, s: int, m: int, inputs: Value) -> Value:
        module = self._modules[s]
        module.tensors = self.weights[s].tensors(m)
        try:
            one_by_one = (s, m) in self.skip_flow.stores or bool(self.state.side)
            if (s != self.last or self.loss is None) and not one_by_one:
                return super()._run_module(s, m, inputs)
            # The loss may read the last stage's parameters too (an LM head's projection in
            # kernels.linear_cross_entropy), and a stage with skips or side inputs runs its
            # layers one by one (fastpipe.model.skips, fastpipe.model.side_inputs), past _OnVersion: bind
            # them to the version as well, or the loss would see the live weights and their
            # gradient would never reach the update.
            bound = {f"inner.{n}": t for n, t in zip(module.names, module.tensors)}
            run = functools.partial(StepRunner._run_module, self, s, m, inputs)
            return functional_call(_Bound(module.inner), bound, (run,), strict=False)
        finally:
            module.tensors = ()

    def backward(self, action: Action) -> float:
        s, m = action.stage, action.microbatch
        key = (s, m // self.minibatch_size)
        stage = self.stages[s]
        stage.params = self.weights[s].tensors(m)  # type: ignore[assignment]  # gradients w.r.t. the version used
        self.param_grads[s] = self.sums.setdefault(key, [None] * len(stage.params))
        try:
            started = super().backward(action)
        finally:
            stage.params = self._live_params[s]
        self.weights[s].release(m)
        return started

    def update(self, action: Action) -> float:
        started = time.perf_counter()
        s, n = action.stage, action.microbatch
        grads = self.sums.pop((s, n), None) or [None] * len(self._live_params[s])
        # The backward's accumulator is that same list: let go of it, or the sums outlive the
        # update through the next mini-batch's forwards, until its first backward.
        self.param_grads[s] = [None] * len(grads)
        self.weights[s].before_update()
        self.apply_update(s, n, grads)
        self.weights[s].after_update()
        for norm in self.norms[s]:
            norm.commit(norm_slot(n))
        return started

    def discard_norm_stats(self, minibatches: int) -> None:
        """Drop the statistics of mini-batches whose update never ran (a window that failed)."""
        for norms in self.norms.values():
            for norm in norms:
                for n in range(minibatches):
                    norm.discard(norm_slot(n))
