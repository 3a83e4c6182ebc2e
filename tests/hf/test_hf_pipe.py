"""Through ``Pipe``: the adapter's layers give HF's logits, loss and gradients in every schedule and mode.

The contract of ``fastpipe.hf``, with the tied embedding on the first stage and the head
that reads it on the last:

* ``pipe(ids, attention_mask=mask)`` equals ``model(ids, attention_mask=mask).logits``;
* ``pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)`` equals
  ``model(ids, attention_mask=mask, labels=labels).loss``, and the gradients land on the HF
  model's own parameters, equal to HF's.

Micro-batches run GEMMs on fewer rows than the whole batch, so values agree up to the
rounding of ``fp_tolerance`` (reductions of the model's length), not bit for bit.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_models import batch, grads_by_name, reduction_length, reference_step, tiny  # noqa: E402
from fp_tolerance import assert_close_reordered  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.hf import causal_lm_loss, to_sequential  # noqa: E402

# 7 layers: the embedding, 4 blocks, the final norm, the head. Interleaved: 4 stages on 2
# workers, stage 0 (the embedding) and stage 3 (the head) on different workers.
LAYOUTS = {"gpipe": ([3, 4], 1), "1f1b": ([3, 4], 1), "zb-h1": ([3, 4], 1), "interleaved": ([2, 2, 1, 2], 2)}
CHUNKS = 4


def _pipe(model: torch.nn.Module, schedule: str = "1f1b", checkpoint: str = "except_last") -> fastpipe.Pipe:
    balance, virtual = LAYOUTS[schedule]
    return fastpipe.Pipe(
        to_sequential(model),
        balance=balance,
        chunks=CHUNKS,
        checkpoint=checkpoint,  # type: ignore[arg-type]
        schedule=schedule,
        virtual_stages=virtual,
    )


def _check_step(model: torch.nn.Module, pipe: fastpipe.Pipe, padded: bool, schedule: str | None = None) -> None:
    ids, mask, labels = batch(padded=padded)
    side = {} if mask is None else {"attention_mask": mask}
    ref_loss, ref_grads = reference_step(model, ids, mask, labels)
    loss = pipe.train_step(ids, labels, causal_lm_loss, schedule=schedule, **side)
    assert_close_reordered(loss.detach(), ref_loss, k=reduction_length())
    grads = grads_by_name(model)  # the HF model's parameters, the tied one once
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        assert_close_reordered(grads[name], grad, k=reduction_length("grad"), msg=name)


@pytest.mark.parametrize("checkpoint", fastpipe.CHECKPOINT_MODES)
@pytest.mark.parametrize("schedule", sorted(LAYOUTS))
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_train_step_in_every_schedule_and_mode(family: str, schedule: str, checkpoint: str) -> None:
    """Eager attention with padding and the tie across the first and last stage: the hardest case."""
    model = tiny(family, attn="eager", tie=True)
    _check_step(model, _pipe(model, schedule, checkpoint), padded=True)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "no-mask"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_train_step_and_forward_with_and_without_mask_tie_and_eager(
    family: str, attn: str, tie: bool, padded: bool
) -> None:
    model = tiny(family, attn=attn, tie=tie)
    pipe = _pipe(model)
    ids, mask, _ = batch(padded=padded)
    side = {} if mask is None else {"attention_mask": mask}
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        assert_close_reordered(pipe(ids, **side), expected, k=reduction_length())
    _check_step(model, pipe, padded)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_forward_and_backward_through_autograd(family: str) -> None:
    model = tiny(family, attn="eager")
    pipe = _pipe(model, "gpipe", "always")
    ids, mask, labels = batch()
    ref_loss, ref_grads = reference_step(model, ids, mask, labels)
    loss = causal_lm_loss(pipe(ids, attention_mask=mask), labels)
    assert_close_reordered(loss.detach(), ref_loss, k=reduction_length())
    loss.backward()
    grads = grads_by_name(model)
    for name, grad in ref_grads.items():
        assert_close_reordered(grads[name], grad, k=reduction_length("grad"), msg=name)


def test_the_pipe_holds_the_hf_models_parameters_once() -> None:
    model = tiny("gpt2")
    pipe = _pipe(model)
    assert sum(p.numel() for p in pipe.parameters()) == sum(p.numel() for p in model.parameters())
    assert pipe.state_dict().keys() == to_sequential(model).state_dict().keys()


def test_training_through_the_pipe_trains_the_hf_model_and_save_pretrained_keeps_it(tmp_path: object) -> None:
    model = tiny("llama", tie=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pipe = _pipe(model)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    ids, mask, labels = batch()
    for _ in range(3):
        opt.zero_grad()
        pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)
        opt.step()
    model.save_pretrained(str(tmp_path))
    loaded = type(model).from_pretrained(str(tmp_path)).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # still tied
    trained = model.state_dict()
    assert not torch.equal(trained["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, trained[key]), key
    with torch.no_grad():
        assert_close_reordered(
            pipe(ids, attention_mask=mask), loaded(ids, attention_mask=mask).logits, k=reduction_length()
        )
