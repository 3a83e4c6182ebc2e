"""Every family the adapter takes trains through ``Pipe`` exactly as the HF model does, and stays causal.

Each family's tiny model (see ``_hf_models.PLAN_FAMILIES`` for what each one exercises) runs
on two stages and two micro-batches, with padding and without a mask. Its loss equals
``model(ids, attention_mask=mask, labels=labels).loss`` and the gradients on the HF model's
own parameters equal HF's, within ``fp_tolerance`` (micro-batches run GEMMs on fewer rows).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_models import VOCAB, batch, family_params, grads_by_name, reduction_length, reference_step, tiny  # noqa: E402
from fp_tolerance import assert_close_reordered, close_reordered  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.hf import causal_lm_loss, to_sequential  # noqa: E402


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "no-mask"])
@pytest.mark.parametrize(("family", "attn"), family_params())
def test_every_family_trains_through_the_pipe_like_hf(family: str, attn: str, padded: bool) -> None:
    model = tiny(family, attn=attn)
    ids, mask, labels = batch(padded=padded)
    ref_loss, ref_grads = reference_step(model, ids, mask, labels)
    pipe = fastpipe.Pipe(to_sequential(model), balance=[3, 4], chunks=2)
    loss = pipe.train_step(ids, labels, causal_lm_loss, **({} if mask is None else {"attention_mask": mask}))
    assert_close_reordered(loss.detach(), ref_loss, k=reduction_length())
    grads = grads_by_name(model)
    assert grads.keys() == ref_grads.keys()
    # One vector, so one scale: a gradient whose terms cancel to almost nothing (Doge's A)
    # still carries the rounding of the large terms it sums, which the whole gradient's size bounds.
    assert_close_reordered(
        torch.cat([grads[name].flatten() for name in ref_grads]),
        torch.cat([grad.flatten() for grad in ref_grads.values()]),
        k=reduction_length("grad"),
    )


@pytest.mark.parametrize(("family", "attn"), family_params())
def test_future_tokens_do_not_move_earlier_logits_without_a_mask(family: str, attn: str) -> None:
    """No padding mask: under SDPA a plain causal mask may be skipped, but only where the model allows it."""
    model = tiny(family, attn=attn)
    seq = to_sequential(model)
    ids, _, _ = batch(padded=False)
    future = ids.clone()
    future[:, 5:] = (future[:, 5:] + 1) % VOCAB
    with torch.no_grad():
        base, changed = seq(ids), seq(future)
        hf_base, hf_changed = model(ids).logits, model(future).logits
    assert torch.equal(base, hf_base) and torch.equal(changed, hf_changed)
    # Experts see other tokens beside the early ones, so their GEMMs may round differently.
    if not close_reordered(hf_changed[:, :5], hf_base[:, :5], k=reduction_length()):
        pytest.skip(f"this transformers' own {family} model sees future tokens under {attn}")
    assert_close_reordered(changed[:, :5], base[:, :5], k=reduction_length())
    assert not torch.allclose(changed[:, 5:], base[:, 5:])
