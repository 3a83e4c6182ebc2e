"""The adapter's Sequential is the HF model: the same logits, loss and gradients, on the model's own parameters.

The logits are compared bit for bit: with dropout 0 and no cache, every layer runs the HF
modules on the same tensors in the same order as the HF model's forward. The loss and the
gradients, within fp_tolerance: ``causal_lm_loss`` divides a sum by the token count where
HF's loss takes torch's mean, the same value through another path of torch's kernels.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_models import batch, family_params, grads_by_name, reference_step, tiny  # noqa: E402
from fp_tolerance import assert_close_reordered  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.hf import causal_lm_loss, to_sequential  # noqa: E402

MASKS = [pytest.param(True, id="padded"), pytest.param(False, id="no-mask")]


@pytest.mark.parametrize("padded", MASKS)
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logits_loss_and_gradients_equal_the_hf_model(family: str, attn: str, tie: bool, padded: bool) -> None:
    model = tiny(family, attn=attn, tie=tie)
    ids, mask, labels = batch(padded=padded)
    side = {} if mask is None else {"attention_mask": mask}
    ref_loss, ref_grads = reference_step(model, ids, mask, labels)

    seq = to_sequential(model)
    assert isinstance(seq, fastpipe.Sequential)
    logits = seq(ids, **side)
    assert torch.equal(logits, model(ids, attention_mask=mask).logits)
    loss = causal_lm_loss(logits, labels)
    assert_close_reordered(loss, ref_loss, k=labels.numel())
    loss.backward()
    grads = grads_by_name(model)  # the HF model's own parameters got the gradients
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_close_reordered(grads[name], grad, k=256, msg=name)


@pytest.mark.parametrize(("family", "attn"), family_params())
def test_every_planned_family_gives_its_logits(family: str, attn: str) -> None:
    """One adapter for every model with a base_model_pp_plan: sliding windows, per-type rotary, scaled embeddings."""
    model = tiny(family, attn=attn)
    ids, mask, _ = batch()
    seq = to_sequential(model)
    assert torch.equal(seq(ids, attention_mask=mask), model(ids, attention_mask=mask).logits)
    assert torch.equal(seq(ids), model(ids).logits)


def test_gemma2_softcaps_its_logits_like_hf() -> None:
    model = tiny("gemma2", attn="eager", final_logit_softcapping=2.0)  # gemma2 refuses SDPA
    ids, mask, _ = batch()
    logits = to_sequential(model)(ids, attention_mask=mask)
    assert logits.abs().max() < 2.0
    assert torch.equal(logits, model(ids, attention_mask=mask).logits)


def test_position_ids_reach_the_blocks_like_hf() -> None:
    ids, mask, _ = batch()
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # what generate() passes for left padding
    for family in ("gpt2", "llama"):
        model = tiny(family)
        seq = to_sequential(model)
        expected = model(ids, attention_mask=mask, position_ids=positions).logits
        assert torch.equal(seq(ids, attention_mask=mask, position_ids=positions), expected)
        assert not torch.equal(expected, model(ids, attention_mask=mask).logits)  # the positions mattered


def test_the_layers_are_the_models_modules_not_copies() -> None:
    model = tiny("llama")
    seq = to_sequential(model)
    assert len(seq) == 1 + 4 + 1 + 1  # embedding, 4 blocks, final norm, head
    mine = {id(p) for p in seq.parameters()}
    assert mine == {id(p) for p in model.parameters()}
    assert seq[0].embed_tokens is model.model.embed_tokens and seq[-1].head is model.lm_head
    assert seq[-1].head.weight is seq[0].embed_tokens.weight  # tied: one parameter, first and last layer
    untied = to_sequential(tiny("llama", tie=False))
    assert untied[-1].head.weight is not untied[0].embed_tokens.weight


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_blocks_are_causal_and_skip_padding(family: str, attn: str) -> None:
    """Eager attention applies only the mask a block is given: without one it would see the future."""
    seq = to_sequential(tiny(family, attn=attn))
    ids, mask, _ = batch()
    base = seq(ids, attention_mask=mask)
    future = ids.clone()
    future[:, 5:] = (future[:, 5:] + 1) % 100
    changed = seq(future, attention_mask=mask)
    real = mask[:, :5].bool()  # a padded query attends to nothing real: its logits mean nothing (in HF too)
    assert torch.equal(changed[:, :5][real], base[:, :5][real])
    assert not torch.equal(changed[:, 5:], base[:, 5:])
    padding = ids.clone()
    padding[1, :3] = (padding[1, :3] + 1) % 100  # row 1's left padding: masked out
    assert torch.equal(seq(padding, attention_mask=mask)[1, 3:], base[1, 3:])


def test_no_cache_is_made_even_where_the_config_asks_for_one() -> None:
    model = tiny("llama")
    model.config.use_cache = True
    out = to_sequential(model)(batch()[0])
    assert type(out) is torch.Tensor


def test_training_the_sequential_trains_the_hf_model_and_save_pretrained_keeps_it(tmp_path: object) -> None:
    model = tiny("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    seq = to_sequential(model).train()
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2)
    ids, mask, labels = batch()
    for _ in range(3):
        opt.zero_grad()
        causal_lm_loss(seq(ids, attention_mask=mask), labels).backward()
        opt.step()
    model.save_pretrained(str(tmp_path))
    loaded = type(model).from_pretrained(str(tmp_path)).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    trained = model.state_dict()
    assert any(not torch.equal(trained[k], before[k]) for k in before)
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert torch.equal(loaded(ids, attention_mask=mask).logits, model.eval()(ids, attention_mask=mask).logits)
