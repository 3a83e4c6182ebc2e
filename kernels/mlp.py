"""A pre-norm MLP block built from the fused pairs; drop-in for the eager block below.

Eager block it replaces (same parameter names, same ``state_dict``)::

    class EagerMLPBlock(nn.Module):            # norm -> fc1 -> GELU -> fc2 -> dropout, + x
        norm = nn.LayerNorm(hidden, eps)
        fc1  = nn.Linear(hidden, ffn_hidden)
        fc2  = nn.Linear(ffn_hidden, hidden)
        def forward(self, x):
            return x + dropout(fc2(gelu(fc1(norm(x)))))

Saved activations per token (fp32, parameters excluded): eager ``2*hidden + 2*ffn + 2``
(5,122 floats at 512/2048); this block ``hidden + ffn`` (2,560) plus one dropout seed.
"""

from __future__ import annotations

import torch

from .dropout import dropout
from .fused_linear import bias_gelu_linear, layer_norm_linear
from .modules import LayerNorm

__all__ = ["MLPBlock"]


class MLPBlock(torch.nn.Module):
    """Pre-norm MLP with residual: ``x + dropout(fc2(gelu(fc1(norm(x)))))``.

    Args:
        hidden: model width.
        ffn_hidden: inner width.
        dropout: dropout probability after ``fc2`` (seed-based, recomputable).
        eps: LayerNorm epsilon.
        approximate: GELU flavour, ``"none"`` or ``"tanh"``.
        bias: whether ``fc1``/``fc2`` have biases.
        device, dtype: forwarded to the parameters.

    Submodules ``norm`` (LayerNorm), ``fc1``, ``fc2`` (Linear) carry all parameters, so the
    ``state_dict`` equals the eager block's.
    """

    def __init__(
        self,
        hidden: int,
        ffn_hidden: int,
        dropout: float = 0.0,
        eps: float = 1e-5,
        approximate: str = "none",
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.norm = LayerNorm(hidden, eps=eps, device=device, dtype=dtype)
        self.fc1 = torch.nn.Linear(hidden, ffn_hidden, bias=bias, device=device, dtype=dtype)
        self.fc2 = torch.nn.Linear(ffn_hidden, hidden, bias=bias, device=device, dtype=dtype)
        self.p = dropout
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm, fc1, fc2 = self.norm, self.fc1, self.fc2
        h = layer_norm_linear(x, norm.weight, norm.bias, fc1.weight, fc1.bias, norm.eps)
        y = bias_gelu_linear(h, None, fc2.weight, fc2.bias, self.approximate)
        return x + dropout(y, self.p, self.training)

    def extra_repr(self) -> str:
        return f"dropout={self.p}, approximate={self.approximate!r}"

    def fastpipe_may_draw(self) -> bool:
        """Read by fastpipe's task RNG: only the dropout draws (its seed), while training with ``p > 0``."""
        return self.training and self.p > 0
