"""The error ``fastpipe.hf`` raises for a model it cannot pipeline exactly."""

from __future__ import annotations

__all__ = ["UnsupportedModelError"]


class UnsupportedModelError(ValueError):
    """The model is not one ``to_sequential`` can cut exactly; the message names what is missing.

    A ``ValueError``, so code that caught ``ValueError`` for a refused model still does.
    """
