"""The GPT family of the largest-model benchmark: ``[Embedding, Block x N, Head]`` and its cut into stages.

Nothing in it draws random numbers, and each layer says so (``fastpipe_may_draw = False``, the
declaration :mod:`fastpipe.rng.registry` reads), as the GPT of ``fastpipe train`` does: without
it fastpipe cannot see through a custom ``forward`` and routes every op of the stage through its
task RNG, which cost every rank 60-120 ms of CPU per step here (2026-12-02, 4 gloo ranks, N = 54).
The declaration changes nothing for the other systems.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["Block", "Embedding", "Head", "TokenLoss", "build_layer", "layer_count", "stage_layers"]


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids ``[B, T]`` to ``[B, T, D]``."""

    fastpipe_may_draw = False  # no dropout: fastpipe's task RNG need not route its ops (fastpipe.rng.registry)

    def __init__(self, vocab: int, seq: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(0.01 * torch.randn(seq, width))

    def forward(self, ids: Tensor) -> Tensor:
        return self.tokens(ids) + self.positions[: ids.size(1)]


class Block(nn.Module):
    """A pre-norm GPT block: causal attention (SDPA) and a 4x GELU MLP, both residual."""

    fastpipe_may_draw = False  # no dropout: fastpipe's task RNG need not route its ops (fastpipe.rng.registry)

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class _Recomputed(nn.Module):
    """A block under ``torch.utils.checkpoint``: only its input is kept, the rest is recomputed in backward."""

    fastpipe_may_draw = False  # no dropout: fastpipe's task RNG need not route its ops (fastpipe.rng.registry)

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Tensor) -> Tensor:
        out = checkpoint(self.block, x, use_reentrant=False)
        assert isinstance(out, Tensor)
        return out


class Head(nn.Module):
    """The final LayerNorm and the projection to the vocabulary: the logits ``[B, T, V]``."""

    fastpipe_may_draw = False  # no dropout: fastpipe's task RNG need not route its ops (fastpipe.rng.registry)

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.norm(x))


class TokenLoss(nn.Module):
    """Mean next-token cross-entropy over every token of the logits."""

    fastpipe_may_draw = False  # no dropout: fastpipe's task RNG need not route its ops (fastpipe.rng.registry)

    reduction = "mean"

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def layer_count(layers: int) -> int:
    """Layers of the Sequential: the embedding, ``layers`` blocks, the head."""
    return layers + 2


def build_layer(i: int, shape: dict[str, Any], per_block_checkpoint: bool) -> nn.Module:
    """Layer ``i`` of the Sequential ``[Embedding, Block x layers, Head]``, seeded by its index."""
    torch.manual_seed(1000 + i)
    last = layer_count(shape["layers"]) - 1
    if i == 0:
        return Embedding(shape["vocab"], shape["seq"], shape["width"])
    if i == last:
        return Head(shape["width"], shape["vocab"])
    block = Block(shape["width"], shape["heads"])
    return _Recomputed(block) if per_block_checkpoint else block


def stage_layers(layers: int, stages: int) -> list[int]:
    """Layers per stage: the ``layers + 2`` layers cut as evenly as counts allow, the earlier stages first."""
    total = layer_count(layers)
    if total < stages:
        raise ValueError(
            f"{layers} blocks plus the embedding and the head cannot give {stages} stages a layer each; "
            f"use at least {stages - 2} blocks"
        )
    base, extra = divmod(total, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]
