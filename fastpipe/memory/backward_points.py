"""When a backward's gradients live: the rules :func:`fastpipe.memory.model.predict_memory` adds to its timeline.

* The combined backward (``BW``, or a ``B`` the runtime runs as one) that ends first in a stage's
  mini-batch makes its gradient sums: as it ends they are all there while the gradient into its
  first layers is still in flight (:attr:`StageBytes.bw_first <fastpipe.memory.model.StageBytes.bw_first>`).
* The gradient a backward sends back waits on the device of the stage before it until that
  stage's backward ends: on one device it is a tensor of its own; across devices, the received copy.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from fastpipe.schedule.ir import Action

__all__ = ["first_backwards", "sent_gradient"]

Times = Mapping[Action, tuple[int, float, float]]


def first_backwards(times: Times, unsplit: Collection[tuple[int, int]], per_minibatch: int) -> frozenset[Action]:
    """Per stage and mini-batch, the combined backward that ends first (it makes the sums).

    Args:
        times: each action's ``(worker, start, end)``.
        unsplit: the ``(stage, micro-batch)`` whose ``B`` runs as a combined backward.
        per_minibatch: micro-batches per mini-batch.
    """
    combined = [a for a in times if a.kind == "BW" or (a.kind == "B" and (a.stage, a.microbatch) in unsplit)]
    # Latest first, so that each mini-batch keeps its earliest.
    first = {(a.stage, a.microbatch // per_minibatch): a for a in sorted(combined, key=lambda a: -times[a][2])}
    return frozenset(first.values())


def sent_gradient(times: Times, stage: int, microbatch: int) -> tuple[int, float]:
    """``(worker, until)``: where the input gradient of ``(stage, microbatch)`` waits, and until when.

    Raises:
        KeyError: the stage before has no backward of that micro-batch in ``times``.
    """
    before = Action("B", stage - 1, microbatch)
    worker, _, end = times[before if before in times else Action("BW", stage - 1, microbatch)]
    return worker, end
