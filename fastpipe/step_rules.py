"""The rules of a training step, decided in one place for ``Pipe``, ``DistributedPipe`` and ``fit``.

A step turns a mini-batch into micro-batches, recomputes some of them in the backward, and
weighs each micro-batch's loss so that the gradients equal those of the plain model on the
whole mini-batch. Each of these rules is one function here, so the three faces cannot
drift apart:

* :func:`check_chunks` and :func:`check_checkpoint`: the arguments, with one message each;
* :func:`checkpoint_predicate`: which micro-batches are recomputed;
* :func:`split_targets`: targets split like the input, or a clear error;
* :func:`loss_reduction` and :func:`loss_weights`: each micro-batch's factor in the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

from fastpipe.microbatch import batch_size, check_value, scatter

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
    Nothing is recomputed in ``eval()``, where there is no backward.
    """
    if not training or mode == "never":
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
        target: a tensor, a tuple holding tensors, or None.
        chunks: micro-batches per mini-batch.
        sizes: the input's micro-batch sizes to match; None to take the target's own.

    Raises:
        ValueError: the target's micro-batches differ in size from the input's.
    """
    if target is None:
        if sizes is None:
            raise ValueError("fastpipe: a target of None gives no micro-batch sizes; pass the input too")
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
