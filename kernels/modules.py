"""Drop-in modules: same constructor arguments and ``state_dict`` keys as their torch twins.

Each subclasses the torch module and only overrides ``forward``, so parameters, buffers,
``extra_repr`` and checkpoints are untouched; ``patch`` swaps the class of a live module.
"""

from __future__ import annotations

import torch

from .bias_gelu import bias_gelu
from .dropout import dropout
from .layer_norm import add_dropout_layer_norm, add_dropout_rms_norm

__all__ = ["LayerNorm", "RMSNorm", "Dropout", "GELU"]


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` with the fused kernel (last-dim normalisation only; else torch)."""

    fastpipe_may_draw = False  # read by fastpipe's task RNG: this layer never draws random numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        return add_dropout_layer_norm(x, None, self.weight, self.bias, 0.0, self.eps)[0]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with the fused kernel (last-dim normalisation only; else torch).

    As in torch, ``eps=None`` means ``torch.finfo(x.dtype).eps``.
    """

    fastpipe_may_draw = False  # read by fastpipe's task RNG: this layer never draws random numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.normalized_shape) != 1:
            return super().forward(x)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        return add_dropout_rms_norm(x, None, self.weight, 0.0, eps)[0]


class Dropout(torch.nn.Dropout):
    """``torch.nn.Dropout`` whose mask is derived from a seed (never stored; reproducible).

    ``inplace=True`` is accepted for compatibility; the result is always a new tensor.
    """

    def fastpipe_may_draw(self) -> bool:
        """Read by fastpipe's task RNG: the seed is drawn only while training with ``p > 0``."""
        return self.training and self.p > 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)


class GELU(torch.nn.GELU):
    """``torch.nn.GELU`` that saves its input only and recomputes the activation in backward."""

    fastpipe_may_draw = False  # read by fastpipe's task RNG: this layer never draws random numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bias_gelu(x, None, self.approximate)
