"""A small GPT whose weights are tied across layers: what the tied-weight and sharded-state tests train.

Layers: an embedding, 7 middle layers (Linears, with a Tanh at every even index, and one Linear
module used at several indices), a LayerNorm, and a head whose weight is the embedding's (GPT-2's
tie). Its ids run over :data:`VOCAB` tokens of :data:`DIM` features.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DIM", "K", "VOCAB", "Embed", "TokenCE", "gpt"]

VOCAB, DIM = 11, 6
K = 64  # reductions from the ids to a gradient: dims of 6 and 11, 32 tokens, over 10 layers


class Embed(nn.Module):
    """The token embedding, under GPT-2's attribute name ``wte``."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids)


class TokenCE(nn.Module):
    """Cross-entropy over every token: a mean over samples of equal length."""

    reduction = "mean"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def gpt(seed: int = 0, block_at: tuple[int, ...] = (3, 7), shared: tuple[int, int] | None = None) -> nn.Sequential:
    """Embedding, 7 layers, LayerNorm, head tied to the embedding.

    Args:
        seed: the seed of the initial weights.
        block_at: the middle layers (1 to 7) that are one and the same Linear module.
        shared: ``(a, b)``: middle layer ``b``'s weight is layer ``a``'s (two modules, one tensor).
    """
    torch.manual_seed(seed)
    embed = Embed()
    head = nn.Linear(DIM, VOCAB, bias=False)
    head.weight = embed.wte.weight
    block = nn.Linear(DIM, DIM)
    middle = [block if i in block_at else nn.Tanh() if i % 2 == 0 else nn.Linear(DIM, DIM) for i in range(1, 8)]
    if shared is not None:
        a, b = shared
        middle[b - 1].weight = middle[a - 1].weight
    return nn.Sequential(embed, *middle, nn.LayerNorm(DIM), head)
