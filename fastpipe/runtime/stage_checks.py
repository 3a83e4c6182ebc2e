"""What a stage's forward must return, checked where it returns, with errors that say what to change."""

from __future__ import annotations

from typing import Any

from torch import Tensor

__all__ = ["check_output", "checked_loss", "in_place_on_input"]


def check_output(out: Any, stage: int) -> None:
    """A stage returns a Tensor or a tuple holding tensors."""
    if isinstance(out, Tensor):
        return
    if isinstance(out, tuple) and any(isinstance(v, Tensor) for v in out):
        return
    raise TypeError(
        f"fastpipe: stage {stage} returned {type(out).__name__}; a stage must return a Tensor or a tuple "
        "holding tensors (the next stage, or the caller, receives it)"
    )


def checked_loss(loss: Any) -> Tensor:
    """``loss_fn``'s result as a 0-d tensor; anything but one element is refused."""
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise TypeError(
            f"fastpipe: loss_fn must return a scalar tensor, got "
            f"{type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)}; "
            "use a mean- or sum-reduced loss"
        )
    return loss.reshape(())


def in_place_on_input(exc: RuntimeError, stage: int) -> RuntimeError | None:
    """Autograd's in-place-on-a-leaf error, restated for a stage's input; None for other errors."""
    if "leaf Variable that requires grad is being used in an in-place" not in str(exc):
        return None
    return RuntimeError(
        f"fastpipe: stage {stage} writes in place into its input, which it receives as a leaf that "
        "requires grad; autograd refuses that. Write into a copy in the stage (e.g. `x = x.clone()` "
        "first), or make the in-place layer the stage's first one (the stage then gets a copy)."
    )
