"""What a :meth:`DistributedPipe.train_step` does on each rank once its actions ran.

The loss is unscaled, deferred BatchNorm statistics are committed, a non-finite loss raises or
skips (``on_nan``), and otherwise the tied weights' gradients are summed over their uses and the
step's gradients are added into ``.grad``. Every rank of the pipeline (and of its replicas) sees
the same outcome here, so the tie groups either all reduce or all skip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from fastpipe.distributed.runtime import StepOutcome
from fastpipe.errors import PipelineError
from fastpipe.model.batchnorm import commit_deferred_batch_norm
from fastpipe.runtime.param_hooks import accumulate_grads

if TYPE_CHECKING:
    from fastpipe.distributed_pipe import DistributedPipe

__all__ = ["apply_outcome"]


def apply_outcome(pipe: DistributedPipe, outcome: StepOutcome, scale: float, scaling: bool) -> Tensor:
    """Finish the step on this rank (see the module doc) and return its loss.

    Args:
        outcome: what the runtime returned.
        scale: the loss scale the backward ran with (1.0 without a scaler).
        scaling: a GradScaler is enabled: it, not ``on_nan``, handles a non-finite loss.
    """
    pipe.ties.check_constant()
    if scaling:
        outcome.loss = outcome.loss / scale
    stages = pipe.runtime.stages
    if pipe.deferred_batch_norm and pipe.training:
        for st in stages.values():
            commit_deferred_batch_norm(st.module)
    if outcome.nonfinite is not None and not scaling:
        if pipe.on_nan == "raise":
            raise PipelineError(
                f"fastpipe: the loss is {outcome.loss.item()} at step {pipe.runtime.steps}, "
                f"{outcome.nonfinite}; gradients were not applied (on_nan='skip' skips such steps)"
            )
        return outcome.loss
    pipe.ties.reduce(outcome.param_grads)
    for s, st in stages.items():
        accumulate_grads(st.params, outcome.param_grads[s])
    return outcome.loss
