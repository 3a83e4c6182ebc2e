"""A model the adapter cannot pipeline exactly is refused by ``to_sequential``, before anything runs.

The message names what is missing. Refusals are ``UnsupportedModelError``, a ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from _hf_models import DIM, LAYERS, VOCAB, batch, needs, reduction_length, reference_step, tiny  # noqa: E402
from fp_tolerance import assert_close_reordered  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, LlamaModel  # noqa: E402
from transformers.masking_utils import create_causal_mask  # noqa: E402
from transformers.modeling_outputs import BaseModelOutputWithPast  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.hf import UnsupportedModelError, causal_lm_loss, to_sequential  # noqa: E402


def test_a_model_without_a_plan_that_is_not_gpt2() -> None:
    cfg = AutoConfig.for_model(
        "opt", num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2, vocab_size=50,
        word_embed_proj_dim=16, max_position_embeddings=16,
    )  # fmt: skip
    message = (
        r"OPTForCausalLM is not GPT-2 .*OPTConfig.*base_model_pp_plan.*docs/hf\.md, section 'Building a Sequential"
    )
    with pytest.raises(UnsupportedModelError, match=message):
        to_sequential(AutoModelForCausalLM.from_config(cfg))


def test_a_plan_naming_a_module_the_model_lacks() -> None:
    model = tiny("llama", layers=1)
    del model.model.norm
    with pytest.raises(UnsupportedModelError, match=r"base_model_pp_plan names the module 'norm'.*LlamaModel"):
        to_sequential(model)


def test_gpt2_without_its_head() -> None:
    model = tiny("gpt2", layers=1)
    del model.lm_head
    with pytest.raises(UnsupportedModelError, match=r"'lm_head'"):
        to_sequential(model)


def test_the_base_model_instead_of_the_causal_lm() -> None:
    with pytest.raises(UnsupportedModelError, match=r"LlamaModel has no base model.*ForCausalLM"):
        to_sequential(tiny("llama", layers=1).model)


def test_not_a_huggingface_model() -> None:
    with pytest.raises(UnsupportedModelError, match=r"Linear has no \.config"):
        to_sequential(nn.Linear(2, 2))


@pytest.mark.parametrize(
    "family",
    [pytest.param(family, marks=needs(family)) for family in ("qwen3_next", "minimax", "deepseek_v32")],
)
def test_linear_and_indexed_attention_are_refused_as_unsupported_models(family: str) -> None:
    kinds = "'full_attention', 'sliding_attention' only"
    with pytest.raises(
        UnsupportedModelError, match=rf"decoder layer \d is of type '\w+'; .* of types {kinds}"
    ) as refused:
        to_sequential(tiny(family))
    assert isinstance(refused.value, ValueError)  # what callers caught before there was a class for it


GEMMA3N = {
    "layer_types": ["sliding_attention", "full_attention"] * (LAYERS // 2), "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": VOCAB, "altup_num_inputs": 2,
    "laurel_rank": 4, "activation_sparsity_pattern": [0.0] * LAYERS, "intermediate_size": [2 * DIM] * LAYERS,
}  # fmt: skip


@needs("gemma3n_text")
def test_gemma3n_and_its_streams_outside_the_plan_are_refused() -> None:
    with pytest.raises(
        UnsupportedModelError, match=r"Gemma3nTextModel has modules with parameters .*altup_projections"
    ):
        to_sequential(tiny("gemma3n_text", **GEMMA3N))


@needs("gemma4_text")
def test_gemma4_text_and_its_per_layer_inputs_are_refused() -> None:
    model = tiny("gemma4_text", hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB)
    with pytest.raises(UnsupportedModelError, match=r"Gemma4TextModel has modules with parameters .*per_layer"):
        to_sequential(model)


@needs("gemma4_text")
def test_gemma4_text_without_per_layer_inputs_is_refused_for_its_shared_kv_states() -> None:
    model = tiny("gemma4_text", hidden_size_per_layer_input=0)
    with pytest.raises(UnsupportedModelError, match=r"decoder layer 0 the argument shared_kv_states, a \w+Dict"):
        to_sequential(model)


def test_a_router_aux_loss_is_refused() -> None:
    with pytest.raises(UnsupportedModelError, match=r"output_router_logits=True.*router_aux_loss_coef \(0\.001\)"):
        to_sequential(tiny("mixtral", output_router_logits=True, router_aux_loss_coef=0.001))


def test_router_logits_without_an_aux_loss_train_exactly() -> None:
    model = tiny("mixtral", output_router_logits=True, router_aux_loss_coef=0.0)
    ids, mask, labels = batch()
    ref_loss, _ = reference_step(model, ids, mask, labels)
    pipe = fastpipe.Pipe(to_sequential(model), balance=[3, 4], chunks=2)
    loss = pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)
    assert_close_reordered(loss.detach(), ref_loss, k=reduction_length())


class _LeakyLlama(LlamaModel):
    """A Llama whose forward hands its layers something beside the hidden states, as ``leak`` says."""

    leak = "nothing"

    def forward(  # type: ignore[override]
        self, input_ids: Any = None, attention_mask: Any = None, inputs_embeds: Any = None, **kwargs: Any
    ) -> BaseModelOutputWithPast:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        mask = create_causal_mask(self.config, hidden, attention_mask, None, positions)
        rotary = self.rotary_emb(hidden, positions)
        shared: dict[str, Any] = {}
        first = hidden
        for layer in self.layers:
            extra = {"nothing": {}, "dict": {"leak": shared}, "hidden": {"leak": hidden.mean()}}.get(self.leak, {})
            hidden = layer(hidden, attention_mask=mask, position_embeddings=rotary, position_ids=positions, **extra)
            if self.leak == "between":
                hidden = hidden * 2
        if self.leak == "after":
            hidden = hidden + first
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden))


def _leaky(leak: str) -> nn.Module:
    model = tiny("llama")
    model.model.__class__ = _LeakyLlama
    model.model.leak = leak
    return model


def test_a_forward_of_its_own_that_passes_only_plain_values_is_pipelined() -> None:
    model = _leaky("nothing")
    ids, mask, _ = batch()
    assert torch.equal(to_sequential(model)(ids, attention_mask=mask), model(ids, attention_mask=mask).logits)


@pytest.mark.parametrize(
    ("leak", "message"),
    [
        ("dict", r"decoder layer 0 the argument leak, a dict: layers can pass state"),
        ("hidden", r"decoder layer 0 the argument leak, computed from the hidden states"),
        ("between", r"changes the hidden states between decoder layers 0 and 1"),
        ("after", r"combines the last decoder layer's output with values from before the layers"),
    ],
)
def test_state_passed_to_layers_beside_the_hidden_states_is_refused(leak: str, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        to_sequential(_leaky(leak))
