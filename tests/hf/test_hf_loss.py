"""``causal_lm_loss`` is HF's ``ForCausalLMLoss``, and declares the normaliser that makes micro-batches exact."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_models import VOCAB, batch  # noqa: E402
from fp_tolerance import assert_close_reordered  # noqa: E402
from transformers.loss.loss_utils import ForCausalLMLoss  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.hf import causal_lm_loss  # noqa: E402
from fastpipe.step.rules import microbatch_loss, microbatch_weights  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [True, False])
def test_equals_hf_for_causal_lm_loss(padded: bool, dtype: torch.dtype) -> None:
    _, _, labels = batch(padded=padded)
    logits = torch.randn(*labels.shape, VOCAB, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = ForCausalLMLoss(logits, labels, vocab_size=VOCAB)  # upcasts to float32, as ours must
    got = causal_lm_loss(logits, labels)
    assert got.dtype == torch.float32
    # The same value through another path (a sum over the count here, torch's mean in HF's):
    # equal within rounding, not necessarily bit for bit on every CPU.
    assert_close_reordered(got, expected, k=labels.numel(), dtype=torch.float32)


def test_is_a_token_loss_whose_microbatches_add_up_to_the_minibatch_loss() -> None:
    """Summed per micro-batch and divided by the mini-batch's valid tokens: the loss of the whole batch.

    Row 2's padding leaves it fewer valid tokens than the others, so weighing by samples would be off.
    """
    assert isinstance(causal_lm_loss, fastpipe.TokenLoss)
    _, _, labels = batch()
    labels[0, 1:] = -100  # a row with no valid token at all: its micro-batch adds 0, not NaN
    logits = torch.randn(*labels.shape, VOCAB, generator=torch.Generator().manual_seed(2))
    parts = list(labels.chunk(4))
    per_mb = microbatch_loss(causal_lm_loss, parts)
    weights = microbatch_weights(causal_lm_loss, parts, [1] * 4, "train_step")
    total = sum(w * per_mb(out, y) for w, out, y in zip(weights, logits.chunk(4), parts))
    torch.testing.assert_close(total, causal_lm_loss(logits, labels), rtol=1e-6, atol=0)
    assert causal_lm_loss.normaliser(labels) == (labels[:, 1:] != -100).sum()


def test_the_labels_shift_inside_the_loss() -> None:
    """Position t's logits are scored against label t+1; the first label is never a target."""
    labels = torch.tensor([[5, 7, 9]])
    logits = torch.full((1, 3, VOCAB), -30.0)
    logits[0, 0, 7] = logits[0, 1, 9] = 30.0  # sure and right about the next token
    assert causal_lm_loss(logits, labels) < 1e-6
    assert causal_lm_loss(logits, torch.tensor([[0, 7, 9]])) < 1e-6  # the first label plays no part
    assert causal_lm_loss(logits, torch.tensor([[5, 9, 7]])) > 10
