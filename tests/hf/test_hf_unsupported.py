"""A model the adapter cannot cut is refused, and the message names what is missing."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from _hf_models import tiny  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from fastpipe.hf import UnsupportedModelError, to_sequential  # noqa: E402


def test_a_model_without_a_plan_that_is_not_gpt2() -> None:
    cfg = AutoConfig.for_model(
        "opt", num_hidden_layers=1, hidden_size=16, ffn_dim=32, num_attention_heads=2, vocab_size=50,
        word_embed_proj_dim=16, max_position_embeddings=16,
    )  # fmt: skip
    with pytest.raises(UnsupportedModelError, match=r"OPTForCausalLM is not GPT-2 .*OPTConfig.*base_model_pp_plan"):
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


def test_scaling_outside_the_modules_is_refused() -> None:
    model = tiny("llama", layers=1)
    model.config.logits_scaling = 4.0  # Granite-style: divides the logits in the LM class's forward
    with pytest.raises(UnsupportedModelError, match=r"config\.logits_scaling=4\.0"):
        to_sequential(model)
