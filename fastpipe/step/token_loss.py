"""A mean loss that declares what it divides by, so that micro-batches weigh exactly.

A loss of your own that averages over a count of its own (valid tokens, a mask's sum) says
so with two methods, ``summed(output, target)`` (the loss summed over what counts) and
``normaliser(target)`` (what its mean divides by); :func:`token_loss` builds one from two
functions. The pipeline then runs ``summed`` per micro-batch and divides by the mini-batch's
normaliser (:func:`fastpipe.step.rules.microbatch_weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

__all__ = ["TokenNormalised", "TokenLoss", "token_loss", "declares_normaliser"]


@runtime_checkable
class TokenNormalised(Protocol):
    """A mean loss that declares what it divides by, so that micro-batches can be weighed exactly.

    ``loss(output, target)`` equals ``loss.summed(output, target) / loss.normaliser(target)``
    on any batch; the pipeline runs ``summed`` on each micro-batch and divides the sum by
    the mini-batch's normaliser, the sum of the micro-batches' ones.
    """

    def summed(self, output: Any, target: Any) -> Tensor:
        """The loss summed over what counts (valid tokens, weighted samples)."""
        ...

    def normaliser(self, target: Any) -> float | Tensor:
        """What the mean over ``target`` divides by (e.g. the number of valid tokens)."""
        ...


class TokenLoss:
    """A mean loss built from its sum and its normaliser (see :func:`token_loss`)."""

    reduction = "mean"

    def __init__(
        self, summed: Callable[[Any, Any], Tensor], normaliser: Callable[[Any], float | Tensor], name: str = ""
    ) -> None:
        self._summed = summed
        self._normaliser = normaliser
        self.name = name or getattr(summed, "__name__", "token_loss")

    def summed(self, output: Any, target: Any) -> Tensor:
        """The loss summed over what counts."""
        return self._summed(output, target)

    def normaliser(self, target: Any) -> float | Tensor:
        """What the mean over ``target`` divides by."""
        return self._normaliser(target)

    def __call__(self, output: Any, target: Any) -> Tensor:
        """The mean: ``summed / normaliser`` (what the plain model's loss computes)."""
        return self._summed(output, target) / self._normaliser(target)

    def __repr__(self) -> str:
        return f"TokenLoss({self.name})"


def token_loss(summed: Callable[[Any, Any], Tensor], normaliser: Callable[[Any], float | Tensor]) -> TokenLoss:
    """A loss ``summed(output, target) / normaliser(target)`` that pipelines exactly.

    Example, a masked mean whose target is a namedtuple (each micro-batch's is one too)::

        Target = collections.namedtuple("Target", "value mask")
        loss_fn = fastpipe.token_loss(
            lambda out, y: (F.mse_loss(out, y.value, reduction="none") * y.mask).sum(),
            lambda y: y.mask.sum(),
        )
        loss = pipe.train_step(x, Target(value, mask), loss_fn)

    Args:
        summed: the loss of a batch summed over what counts.
        normaliser: what the loss's mean over a batch's target divides by.

    Returns:
        A :class:`TokenLoss`, whose call is the mean.
    """
    return TokenLoss(summed, normaliser)


def declares_normaliser(loss_fn: Any) -> bool:
    """Whether ``loss_fn`` has the ``summed`` and ``normaliser`` methods of :class:`TokenNormalised`."""
    return callable(getattr(loss_fn, "summed", None)) and callable(getattr(loss_fn, "normaliser", None))
