"""The rules of a training step, decided in one place for ``Pipe``, ``DistributedPipe`` and ``fit``.

A step turns a mini-batch into micro-batches, recomputes some of them in the backward, and
weighs each micro-batch's loss so that the gradients equal those of the plain model on the
whole mini-batch. Each of these rules is one function here, so the three faces cannot
drift apart:

* :func:`check_chunks` and :func:`check_checkpoint`: the arguments, with one message each;
* :func:`checkpoint_predicate`: which micro-batches are recomputed;
* :func:`split_targets`: targets split like the input, or a clear error;
* :func:`loss_reduction`, :func:`microbatch_loss` and :func:`microbatch_weights`: the loss
  each micro-batch computes and its factor in the mini-batch loss.

A mean loss is not always a mean over samples. ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` on
class indices divide their sum by the weight of the targets that count: every target but
``ignore_index``, each by its class ``weight`` (1 without one). Padded language-model
batches are the common case, where micro-batches hold different numbers of real tokens.
Weighing each micro-batch's mean by its samples would then be off the plain loss, so these
losses run sum-reduced per micro-batch and every micro-batch counts by 1 / (the mini-batch's
target weight), which equals ``loss_fn(model(x), y)`` (also for a micro-batch whose targets
are all ignored, whose mean alone would be NaN).

A loss of your own that averages over a count of its own (valid tokens, a mask's sum) says
so with two methods, ``summed(output, target)`` (the loss summed over what counts) and
``normaliser(target)`` (what its mean divides by); :func:`token_loss` builds one from two
functions (:mod:`fastpipe.step.token_loss`). The pipeline then runs ``summed`` per micro-batch
and divides by the mini-batch's normaliser, as for cross-entropy. A plain function has no
``reduction`` to read: it is taken for a per-sample mean, with a warning once when that
weighting matters (several micro-batches).

The counts and normalisers are computed where the targets are, per micro-batch, and read
together once (:func:`fastpipe.step.host_io.read_floats`): one host read a step, not one per
micro-batch.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from fastpipe.memory.optimizer import OptimizerSpec
from fastpipe.schedule import Schedule, ScheduleError
from fastpipe.schedule.builders import STAGES_PER_WORKER, build_for
from fastpipe.step.auto_schedule import AutoRun, AutoSchedule, is_auto
from fastpipe.step.host_io import read_floats
from fastpipe.step.microbatch import batch_size, check_value, scatter
from fastpipe.step.token_loss import TokenLoss, TokenNormalised, declares_normaliser, token_loss

__all__ = [
    "CHECKPOINT_MODES",
    "Checkpoint",
    "check_chunks",
    "check_checkpoint",
    "checkpoint_predicate",
    "check_loss_fn",
    "loss_reduction",
    "loss_weights",
    "split_targets",
    "pipe_schedule",
    "pipe_auto_schedule",
    "TokenNormalised",
    "TokenLoss",
    "token_loss",
    "microbatch_loss",
    "microbatch_weights",
]

CHECKPOINT_MODES = ("always", "except_last", "never")
Checkpoint = Literal["always", "except_last", "never"]


def check_chunks(chunks: object) -> int:
    """``chunks`` (micro-batches per mini-batch) if it is an int >= 1; ``ValueError`` otherwise."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"fastpipe: chunks must be an int >= 1 (micro-batches per mini-batch), got {chunks!r}")
    return chunks


def check_checkpoint(mode: object) -> Checkpoint:
    """``mode`` if it is one of :data:`CHECKPOINT_MODES`; ``ValueError`` otherwise."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"fastpipe: checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    return mode  # type: ignore[return-value]


def checkpoint_predicate(mode: Checkpoint, training: bool, per_minibatch: int) -> Callable[[int], bool]:
    """Whether micro-batch ``i`` is recomputed in the backward instead of keeping its graph.

    Micro-batches are numbered across the mini-batches of a run, ``per_minibatch`` to a
    mini-batch (one mini-batch for a step, a window of them for ``fit``). ``except_last``
    keeps the graph of each mini-batch's last micro-batch, whose backward starts at once.
    Nothing is recomputed in ``eval()``, where there is no backward. ``"auto"`` recomputes
    nothing here (``fit`` checks no memory limit to choose by).

    Raises:
        ValueError: a per-layer policy, which ``Pipe`` applies itself and ``fit`` does not run.
    """
    if not isinstance(mode, str):
        raise ValueError(
            f"fastpipe: fit recomputes whole stages only, and checkpoint={mode} is a per-layer policy "
            "(train_step's and forward's); set pipe.checkpoint to 'never', 'except_last' or 'always' before fit"
        )
    if not training or mode not in ("always", "except_last"):
        return lambda i: False
    if mode == "always":
        return lambda i: True
    return lambda i: i % per_minibatch != per_minibatch - 1


def check_loss_fn(loss_fn: object) -> None:
    """``TypeError`` unless ``loss_fn`` can be called as ``loss_fn(output, target)``."""
    if not callable(loss_fn):
        raise TypeError(
            f"fastpipe: loss_fn must be callable as loss_fn(output, target), got "
            f"{type(loss_fn).__name__}; e.g. nn.CrossEntropyLoss()"
        )


def loss_reduction(loss_fn: Any, caller: str) -> Literal["mean", "sum"]:
    """The reduction of ``loss_fn``: its ``reduction`` attribute, ``"mean"`` when it has none.

    Args:
        loss_fn: the loss function.
        caller: the method that needs it, for the message (``"train_step"``, ``"fit"``).

    Raises:
        ValueError: the reduction is neither ``"mean"`` nor ``"sum"`` (a per-sample loss
            cannot be summed into a mini-batch loss by micro-batches).
    """
    reduction = getattr(loss_fn, "reduction", "mean")
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"fastpipe: loss_fn.reduction={reduction!r}; {caller} needs 'mean' or 'sum' (a scalar loss per micro-batch)"
        )
    return "sum" if reduction == "sum" else "mean"


def loss_weights(reduction: str, sizes: Sequence[int]) -> list[float]:
    """Each micro-batch's factor in the mini-batch loss, from its number of samples.

    For a mean each micro-batch counts by its share of the samples, so uneven micro-batches
    are weighted right; for a sum the micro-batch losses are added.
    """
    if reduction == "sum":
        return [1.0] * len(sizes)
    total = sum(sizes)
    return [n / total for n in sizes]


def split_targets(target: Any, chunks: int, sizes: Sequence[int] | None) -> list[Any]:
    """``target`` split into micro-batches like the input (``None``: one ``None`` each).

    Args:
        target: a tensor, a tuple holding tensors (a namedtuple's micro-batches are of its
            class), or None.
        chunks: micro-batches per mini-batch.
        sizes: the input's micro-batch sizes to match; None to take the target's own.

    Raises:
        ValueError: the target's micro-batches differ in size from the input's.
    """
    if target is None:
        if sizes is None:
            raise ValueError(
                "fastpipe: the target is None on the rank that computes the loss; pass each mini-batch's "
                "target there (the last stage's rank)"
            )
        return [None] * len(sizes)
    check_value(target, "target")
    targets = scatter(target, chunks)
    got = [batch_size(t, "target") for t in targets]
    if sizes is not None and got != list(sizes):
        raise ValueError(
            f"fastpipe: target batch size {sum(got)} differs from the input's {sum(sizes)} (micro-batches {got} "
            f"against {list(sizes)}); give one target row per input row (they are split into micro-batches "
            "together)"
        )
    return targets


_COUNTING_LOSSES = (nn.CrossEntropyLoss, nn.NLLLoss)


def _counts_targets(loss_fn: Any, targets: Sequence[Any]) -> bool:
    """Whether ``loss_fn``'s mean divides by the targets' weight: a mean-reduced
    ``nn.CrossEntropyLoss``/``nn.NLLLoss`` (its own forward, not a subclass's) on class indices."""
    kind = next((k for k in _COUNTING_LOSSES if isinstance(loss_fn, k)), None)
    if kind is None or type(loss_fn).forward is not kind.forward:
        return False
    if getattr(loss_fn, "reduction", None) != "mean":
        return False
    present = [t for t in targets if t is not None]
    return bool(present) and all(isinstance(t, Tensor) and not t.is_floating_point() for t in present)


def target_weight(loss_fn: Any, targets: Sequence[Tensor]) -> float:
    """What the mean of a class-index ``CrossEntropyLoss``/``NLLLoss`` divides by, over ``targets``.

    Every target that is not ``ignore_index`` counts by its class weight (1 without ``weight``).
    Each micro-batch's share is computed where its targets are and all are read at once.
    """
    ignore = int(loss_fn.ignore_index)
    weight: Tensor | None = loss_fn.weight
    weights = {t.device: weight.to(t.device) for t in targets} if weight is not None else {}
    shares: list[Tensor] = []
    for t in targets:
        counts = t != ignore
        if weight is None:
            shares.append(counts.sum())
        elif t.device.type == "cpu":
            shares.append(weights[t.device][t[counts]].sum())
        else:  # boolean indexing would read its length on the host: the same sum, zeros kept in place
            shares.append(torch.where(counts, weights[t.device][t.where(counts, 0)], 0).sum())
    total = 0.0
    for share in read_floats(shares, "a class-index target's weight"):
        total += share
    return total


def microbatch_loss(loss_fn: Any, targets: Sequence[Any]) -> Callable[[Any, Any], Tensor]:
    """The loss each micro-batch runs: ``loss_fn``, or its sum-reduced twin when its mean counts targets.

    The twin is a shallow copy with ``reduction="sum"``: it shares the class weights and the
    caller's ``loss_fn`` is left as it is. A loss that declares its normaliser runs its ``summed``.
    """
    if declares_normaliser(loss_fn):
        return loss_fn.summed
    if not _counts_targets(loss_fn, targets):
        return loss_fn
    summed = copy.copy(loss_fn)
    summed.reduction = "sum"
    return summed


def microbatch_weights(loss_fn: Any, targets: Sequence[Any], sizes: Sequence[int], caller: str) -> list[float]:
    """Each micro-batch's factor in the mini-batch loss, to go with :func:`microbatch_loss`.

    Args:
        loss_fn: the caller's loss.
        targets: each micro-batch's target (None where this process does not hold them).
        sizes: each micro-batch's number of samples.
        caller: the method, for messages.

    Returns:
        ``1 / target_weight`` for every micro-batch when the loss counts targets (NaN, as the
        plain loss, when no target counts), ``1 / sum of normalisers`` for a loss that declares
        its own (:class:`TokenNormalised`); else :func:`loss_weights` by samples.
    """
    if declares_normaliser(loss_fn):
        present = [t for t in targets if t is not None]
        total = float(sum(read_floats([loss_fn.normaliser(t) for t in present], "loss_fn.normaliser(target)")))
        return [1.0 / total if total else math.nan] * len(sizes)
    if len(sizes) > 1 and not hasattr(loss_fn, "reduction"):
        warnings.warn(
            f"fastpipe: {caller} cannot tell how loss_fn {getattr(loss_fn, '__name__', type(loss_fn).__name__)} "
            "reduces, so it weighs each micro-batch's loss by its share of the samples (exact for a mean over "
            "samples or a sum with loss_fn.reduction = 'sum'). For a mean over tokens or a mask, declare the "
            "normaliser: fastpipe.token_loss(summed, normaliser); set loss_fn.reduction = 'mean' to silence this",
            stacklevel=3,
        )
    reduction = loss_reduction(loss_fn, caller)
    if reduction == "mean" and _counts_targets(loss_fn, targets):
        total = target_weight(loss_fn, targets)
        return [1.0 / total if total else math.nan] * len(sizes)
    return loss_weights(reduction, sizes)


def pipe_schedule(
    name: str | AutoSchedule | Schedule,
    stages: int,
    microbatches: int,
    virtual_stages: int,
    auto: AutoRun | None = None,
) -> Schedule:
    """The schedule ``Pipe`` runs: ``name`` over ``stages``, ``virtual_stages`` to a worker.

    ``"auto"`` (or an :class:`~fastpipe.step.auto_schedule.AutoSchedule`) runs the search's choice for
    this step's micro-batches, which ``auto`` carries (the stages pick their own stages per worker,
    so ``virtual_stages`` does not apply); a :class:`~fastpipe.schedule.Schedule` runs as given, once
    it fits the stages and micro-batches. The messages speak of Pipe's own arguments;
    :func:`~fastpipe.schedule.builders.build_for` checks the rest. ``zb-v`` and ``dualpipev`` hold
    2 stages per worker in a V, so they need ``virtual_stages=2`` and ``len(balance) = 2 x workers``.
    """
    if is_auto(name):
        if auto is None:
            raise ValueError("fastpipe: schedule='auto' needs the stages and a step's micro-batches to measure on")
        return auto.schedule(name)
    if isinstance(name, Schedule):
        return given_schedule(name, stages, microbatches)
    if virtual_stages < 1 or stages % virtual_stages:
        raise ValueError(
            f"fastpipe: {stages} stages cannot be spread over workers with virtual_stages={virtual_stages}; "
            "len(balance) must be a multiple of virtual_stages"
        )
    key = str(name).lower().replace("_", "-")
    own = STAGES_PER_WORKER.get(key)
    if own is not None and virtual_stages != own:
        raise ValueError(
            f"fastpipe: schedule {key!r} places {own} stages on each worker in a V (stages w and 2K-1-w on "
            f"worker w): pass virtual_stages={own} and a balance of {own} x workers entries; got "
            f"virtual_stages={virtual_stages} with {stages} stages"
        )
    if virtual_stages != 1 and own is None and name != "interleaved":
        raise ValueError(
            f"fastpipe: virtual_stages={virtual_stages} only applies to the 'interleaved', 'zb-v' and 'dualpipev' "
            "schedules"
        )
    return build_for(str(name), stages, stages // virtual_stages, microbatches)


def given_schedule(schedule: Schedule, stages: int, microbatches: int) -> Schedule:
    """A schedule built by the caller (IR data): it must fit this pipe and this step."""
    if schedule.minibatch_size:
        raise ValueError("fastpipe: train_step runs one step; a stream of mini-batches (U actions) is fit's")
    if schedule.num_stages != stages or schedule.num_microbatches != microbatches:
        raise ValueError(
            f"fastpipe: the schedule {schedule.name!r} is for {schedule.num_stages} stages and "
            f"{schedule.num_microbatches} micro-batches; this step has {stages} stages and {microbatches} "
            "micro-batches (chunks, or fewer for a small batch)"
        )
    try:
        schedule.validate()
    except ScheduleError as exc:
        raise ValueError(f"fastpipe: the schedule {schedule.name!r} is invalid: {exc}") from None
    return schedule


def pipe_auto_schedule(
    schedule: object, stages: int, virtual_stages: int, optimizer: OptimizerSpec = "adam"
) -> AutoSchedule:
    """Checks ``Pipe``'s ``schedule`` and ``virtual_stages`` at construction, not at the first step.

    Returns the pipe's :class:`~fastpipe.step.auto_schedule.AutoSchedule`: the one given, else a new one
    that ``schedule="auto"`` (also in ``train_step``) searches with, counting ``optimizer``'s state.

    Raises:
        ValueError: an unknown schedule, virtual stages it cannot take, or ``virtual_stages`` with
            ``"auto"`` (which picks the stages per worker itself).
    """
    if is_auto(schedule):
        if virtual_stages != 1:
            raise ValueError(
                f"fastpipe: schedule='auto' picks the stages per worker itself; drop virtual_stages={virtual_stages}"
            )
        return schedule if isinstance(schedule, AutoSchedule) else AutoSchedule(optimizer=optimizer)
    if not isinstance(schedule, str):
        raise TypeError(f"fastpipe: schedule must be a schedule's name, 'auto' or an AutoSchedule, got {schedule!r}")
    # 2 x workers micro-batches satisfy every builder (dualpipev needs at least that many).
    pipe_schedule(schedule, stages, 2 * max(stages // max(virtual_stages, 1), 1), virtual_stages)
    return AutoSchedule(optimizer=optimizer)
