"""``causal_lm_loss``: HuggingFace's causal LM loss, declared so that a pipeline weighs micro-batches exactly.

HF's ``ForCausalLMLoss`` shifts the labels left by one inside the loss (the logits at
position ``t`` predict the label at ``t + 1``), skips the labels equal to ``-100`` and takes
the mean over the tokens that remain in the whole batch, in float32. A mean over tokens is
not a mean over samples: micro-batches hold different numbers of valid tokens once the
labels are padded. :data:`causal_lm_loss` therefore declares its sum and its normaliser
(:func:`fastpipe.token_loss`), and ``Pipe.train_step`` divides the micro-batches' summed
losses by the valid tokens of the mini-batch, which is HF's loss on the mini-batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastpipe.step.rules import TokenLoss, token_loss

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "shifted_labels"]

IGNORE_INDEX = -100  # HF's label for a token that does not count (padding, a prompt)


def shifted_labels(labels: Tensor) -> Tensor:
    """``labels`` moved left by one, the last position ignored: what each position's logits predict."""
    return F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def _summed_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """The next-token cross-entropy summed over the valid tokens, in float32 as HF computes it."""
    logits = logits.float()  # HF upcasts before the loss (bf16 logits lose the small probabilities)
    target = shifted_labels(labels).reshape(-1).to(logits.device)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), target, ignore_index=IGNORE_INDEX, reduction="sum")


def _valid_tokens(labels: Tensor) -> Tensor:
    """How many shifted labels count: HF's mean divides by this."""
    return (labels[..., 1:] != IGNORE_INDEX).sum().to(torch.float32)


causal_lm_loss: TokenLoss = token_loss(_summed_cross_entropy, _valid_tokens)
"""``causal_lm_loss(logits, labels)``: HF's ``model(ids, labels=labels).loss`` from the logits.

``labels`` are ``[B, T]`` token ids, usually the input ids with ``-100`` where a token must
not count (padding); they are shifted inside the loss, as HF does. Pass it to
``Pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)``.
"""
