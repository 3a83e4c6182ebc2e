"""A GPT-style character language model written as an ``nn.Sequential``, so ``Pipe`` can cut it.

::

    ids [B, T] ─▶ Embedding (tokens + positions) ─▶ Block × n_layer ─▶ LMHead (final norm) ─▶ h [B, T, D]
                                                                            │ weight [V, D]
    loss = linear_cross_entropy(h, LMHead.weight, targets)   ◀──────────────┘  (LMLoss, on the last stage)

Attention runs through ``F.scaled_dot_product_attention``; norms and MLPs are
``fastpipe.kernels`` (fused LayerNorm, ``MLPBlock``: LayerNorm+Linear and bias+GELU+Linear
pairs that save half of eager's activations).

Why the projection is in the loss and not a layer: the chunked ``linear_cross_entropy`` needs
the targets, which ``Pipe.train_step`` hands only to ``loss_fn`` on the last stage. The head's
weight still belongs to the last layer, so it is a parameter of the last stage and its gradient
is computed there like any other (the runtime differentiates the loss with respect to the
stage's parameters); the full ``[tokens, vocab]`` logits never exist in training.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fastpipe import kernels

__all__ = ["GPTConfig", "Embedding", "Block", "LMHead", "LMLoss", "build_gpt"]


@dataclass(frozen=True)
class GPTConfig:
    """Model shape.

    Attributes:
        vocab: number of character ids.
        seq_len: longest context (positions).
        n_layer: transformer blocks.
        dim: model width; must divide by ``n_head``.
        n_head: attention heads.
        dropout: dropout after attention and MLP (seed-based, replayed exactly by recomputation).
    """

    vocab: int
    seq_len: int = 64
    n_layer: int = 4
    dim: int = 128
    n_head: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "n_layer", "dim", "n_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} must be a multiple of n_head {self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def to_dict(self) -> dict[str, float | int]:
        """A JSON-serialisable copy."""
        return asdict(self)


class Embedding(nn.Module):
    """Token plus learned position embeddings: ids ``[B, T]`` to ``[B, T, D]``."""

    fastpipe_may_draw = False  # no random ops: the stage skips the task RNG's interception

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.positions = nn.Parameter(torch.zeros(cfg.seq_len, cfg.dim))
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.01)

    def forward(self, ids: Tensor) -> Tensor:
        t = ids.size(1)
        if t > self.positions.size(0):
            raise ValueError(f"sequence of {t} tokens is longer than the model's seq_len {self.positions.size(0)}")
        return self.tokens(ids) + self.positions[:t]


class Block(nn.Module):
    """Pre-norm causal self-attention plus a fused ``kernels.MLPBlock``, both residual."""

    def __init__(self, cfg: GPTConfig, depth_scale: float) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.p = cfg.dropout
        self.norm = kernels.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.mlp = kernels.MLPBlock(cfg.dim, 4 * cfg.dim, dropout=cfg.dropout, approximate="tanh")
        # GPT-2's initialisation: residual projections scaled down with depth.
        for linear in (self.qkv, self.proj, self.mlp.fc1, self.mlp.fc2):
            nn.init.normal_(linear.weight, std=0.02)
            nn.init.zeros_(linear.bias)
        self.proj.weight.data.mul_(depth_scale)
        self.mlp.fc2.weight.data.mul_(depth_scale)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + kernels.dropout(y, self.p, self.training)
        return self.mlp(x)

    def fastpipe_may_draw(self) -> bool:
        """Only the dropouts draw (attention has none): while training with ``p > 0``."""
        return self.training and self.p > 0


class LMHead(nn.Module):
    """The final LayerNorm; owns the output projection ``weight [V, D]`` that :class:`LMLoss` applies."""

    fastpipe_may_draw = False

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.norm = kernels.LayerNorm(cfg.dim)
        self.weight = nn.Parameter(torch.empty(cfg.vocab, cfg.dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        """Full logits of normalised hidden states (sampling; training never builds them)."""
        return h @ self.weight.to(h.dtype).t()


class LMLoss:
    """``loss_fn`` for ``Pipe.train_step``: mean next-character cross-entropy, chunked over tokens.

    Args:
        head: the model's last layer (its ``weight`` is the projection).
    """

    reduction = "mean"  # train_step weights each micro-batch by its share of the samples
    fastpipe_may_draw = False  # a chunked cross-entropy: no random ops

    def __init__(self, head: LMHead) -> None:
        self.head = head

    def __call__(self, h: Tensor, target: Tensor) -> Tensor:
        return kernels.linear_cross_entropy(h.reshape(-1, h.size(-1)), self.head.weight, target.reshape(-1))


def build_gpt(cfg: GPTConfig, seed: int) -> nn.Sequential:
    """The model, initialised from ``seed``: ``[Embedding, Block × n_layer, LMHead]``."""
    torch.manual_seed(seed)
    scale = 1.0 / math.sqrt(2 * cfg.n_layer)
    return nn.Sequential(Embedding(cfg), *[Block(cfg, scale) for _ in range(cfg.n_layer)], LMHead(cfg))
