"""When a backward's gradients live: the rules :func:`fastpipe.memory.model.predict_memory` adds to its timeline.

* The combined backward (``BW``, or a ``B`` the runtime runs as one) that ends first in a stage's
  mini-batch makes its gradient sums, unless a ``W`` that runs deferred GEMMs starts before: while it
  runs it holds its measured peak (:attr:`StageBytes.bw_peak <fastpipe.memory.model.StageBytes.bw_peak>`),
  the last layers' sums made while the earlier layers' saved tensors are alive. Where that was not
  measured, its end stands for it: the sums are all there while the gradient into its first layers
  is still in flight (:attr:`StageBytes.bw_first <fastpipe.memory.model.StageBytes.bw_first>`) and
  the step still holds the stage's output.
* A ``W`` that runs several micro-batches' records stacks each deferred Linear's into one copy for
  one GEMM, a Linear at a time (:mod:`fastpipe.runtime.wgrad`). Into sums that exist it holds the
  largest copy; where it makes the sums, a Linear's copy is freed before the sums of the Linears
  after it exist (:attr:`StageBytes.w_gemms <fastpipe.memory.model.StageBytes.w_gemms>`).
* The gradient a backward sends back waits on the device of the stage before it until that
  stage's backward ends: on one device it is a tensor of its own; across devices, the received copy.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from fastpipe.schedule.ir import Action

__all__ = ["backward_of", "check_stage_bytes", "first_sums", "sent_gradient", "stacked_bytes"]

Times = Mapping[Action, tuple[int, float, float]]


def first_sums(
    times: Times, unsplit: Collection[tuple[int, int]], writes: Collection[Action], per_minibatch: int
) -> frozenset[Action]:
    """Per stage and mini-batch, the action that makes the gradient sums.

    That is the combined backward that ends first or the ``W`` of ``writes`` that starts first,
    whichever comes earlier (a backward's sums exist at its end, a ``W``'s from its start).

    Args:
        times: each action's ``(worker, start, end)``.
        unsplit: the ``(stage, micro-batch)`` whose ``B`` runs as a combined backward.
        writes: the ``W`` s that run deferred GEMMs.
        per_minibatch: micro-batches per mini-batch.
    """
    combined = [
        (times[a][2], a) for a in times if a.kind == "BW" or (a.kind == "B" and (a.stage, a.microbatch) in unsplit)
    ]
    # Latest first, so that each mini-batch keeps its earliest; at equal times the backward, which has ended.
    at = sorted([*combined, *((times[a][1], a) for a in writes)], key=lambda p: (-p[0], p[1].kind != "W"))
    return frozenset({(a.stage, a.microbatch // per_minibatch): a for _, a in at}.values())


def stacked_bytes(largest: int, gemms: Sequence[tuple[int, int]], microbatches: int, makes_sums: bool) -> int:
    """The most bytes of stacked record copies a ``W`` of ``microbatches`` micro-batches' records holds beside its sums.

    Args:
        largest: one micro-batch's largest Linear record (:attr:`StageBytes.w_stacked`).
        gemms: per deferred Linear, in the order ``W`` runs them, one micro-batch's record bytes
            and the bytes of the sums its GEMM makes (:attr:`StageBytes.w_gemms`); empty: unknown.
        microbatches: the micro-batches whose records the ``W`` runs.
        makes_sums: whether the ``W`` makes the sums, which the model counts from its start.
    """
    if microbatches < 2:
        return 0  # one micro-batch's records are read in place
    if not gemms:
        return largest * microbatches
    most = later = 0  # where W makes the sums: those of the Linears after this one, not there yet while it runs
    for record, made in reversed(gemms):
        most = max(most, microbatches * record - later)
        later += made if makes_sums else 0
    return most


def check_stage_bytes(name: str, value: object) -> None:
    """Raise unless ``value`` fits :class:`~fastpipe.memory.model.StageBytes`' field ``name``.

    Raises:
        ValueError: not a whole number of bytes >= 0 (None allowed for ``gradients`` and
            ``optimized``; ``w_gemms`` and ``tie_grads``: a tuple of pairs of them), named.
    """
    if value is None and name in ("gradients", "optimized"):
        return
    numbers: list[object] = [value]
    paired = {"w_gemms": "(record, sums) pairs of bytes", "tie_grads": "(reader stage, bytes) pairs"}
    if name in paired:
        pairs = [p for p in value if isinstance(p, tuple) and len(p) == 2] if isinstance(value, tuple) else []
        numbers = [b for p in pairs for b in p] if isinstance(value, tuple) and len(pairs) == len(value) else [None]
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in numbers):
        what = f"a tuple of {paired[name]}" if name in paired else "a whole number of bytes"
        raise ValueError(f"fastpipe: StageBytes.{name} must be {what} >= 0, got {value!r}")


def sent_gradient(times: Times, stage: int, microbatch: int) -> tuple[int, float]:
    """``(worker, until)``: where the input gradient of ``(stage, microbatch)`` waits, and until when.

    Raises:
        KeyError: the stage before has no backward of that micro-batch in ``times``.
    """
    worker, _, end = times[backward_of(times, stage - 1, microbatch)]
    return worker, end


def backward_of(times: Times, stage: int, microbatch: int) -> Action:
    """The backward of ``(stage, microbatch)`` in ``times``: its ``B``, else its ``BW``."""
    split = Action("B", stage, microbatch)
    return split if split in times else Action("BW", stage, microbatch)
