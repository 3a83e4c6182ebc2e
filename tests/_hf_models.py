"""Tiny HuggingFace causal LMs built from scratch (no download), and batches for them.

Import after ``pytest.importorskip("transformers")``. Dropout is 0 and ``use_cache`` off, so
a model's forward is a plain function of its input: the adapter's layers then do the same
arithmetic as the HF model, op for op, and compare bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import Tensor, nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = [
    "VOCAB", "DIM", "LAYERS", "SEQ", "PLAN_FAMILIES", "family_params", "needs", "tiny", "batch",
    "reference_step", "grads_by_name", "reduction_length",
]  # fmt: skip

VOCAB, DIM, LAYERS, SEQ = 100, 32, 4, 8

# Families tested through their config's base_model_pp_plan, each with what it exercises.
PLAN_FAMILIES: dict[str, dict[str, object]] = {
    "llama": {},
    "mistral": {"sliding_window": 3},  # a sliding window on every layer, no layer_types
    "qwen2": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2},  # full, then sliding
    "qwen3": {},
    "phi3": {},  # fused qkv and gate_up projections
    "gemma": {},  # embeddings scaled inside its embedding module
    "gemma2": {"sliding_window": 3},  # alternating sliding layers, soft-capped attention and logits
    "gemma3_text": {"sliding_window": 3},  # one rotary table per layer type
    "gpt_neox": {},  # parallel attention and MLP, partial rotary
    "gptj": {"rotary_dim": 4},  # interleaved rotary inside each layer, no rotary module in the base
    "phi": {},  # Phi-2: partial rotary, one norm per layer
    "olmo": {},  # norms without weights
    "olmo2": {},  # norms after attention and MLP, q/k norms
    "olmo3": {"sliding_window": 3},  # sliding and full layers
    "cohere": {},  # logits scaled by logit_scale in the causal LM's forward, outside any module
    "granite": {  # embeddings and logits scaled in the forwards, outside any module
        "embedding_multiplier": 2.0,
        "logits_scaling": 4.0,
        "residual_multiplier": 0.5,
    },
    "starcoder2": {"sliding_window": 3},  # a sliding window on every layer, biased projections
    "glm": {},  # partial rotary of interleaved pairs
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},  # top-2 of 4 experts, routed per token
    "qwen2_moe": {  # experts and a gated shared expert
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": DIM,
        "shared_expert_intermediate_size": DIM,
    },
    "doge": {},  # a mask it always materialises (allow_is_causal_skip=False), and adds to
    "beam": {  # NoPE layers with a position-dependent query scale beside rotary ones; grouped top-k experts
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": DIM,
    },
}


def family_params(attns: tuple[str, ...] = ("sdpa", "eager")) -> list[object]:
    """``(family, attn)`` pytest params for every plan family this transformers has, under the ``attns`` it offers."""
    return [
        pytest.param(family, attn, id=f"{family}-{attn}", marks=needs(family, plan=True))
        for family in PLAN_FAMILIES
        for attn in attns
        if attn != "sdpa" or _has_sdpa(family)
    ]


def needs(family: str, plan: bool = False) -> pytest.MarkDecorator:
    """Skip where this transformers lacks ``family`` (or, with ``plan``, its pp plan): the GPU host's is older."""
    config = CONFIG_MAPPING[family] if family in CONFIG_MAPPING else None
    missing = config is None or (plan and not getattr(config, "base_model_pp_plan", None))
    return pytest.mark.skipif(missing, reason=f"this transformers has no {family!r} models{' with a plan' * plan}")


def _has_sdpa(family: str) -> bool:
    """Whether ``family``'s causal LM takes ``attn_implementation="sdpa"`` (Gemma 2 does not; GPT-J only lately)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(family)
    return name is None or bool(getattr(transformers, name)._supports_sdpa)


def tiny(
    family: str = "llama", *, attn: str = "sdpa", tie: bool = True, layers: int = LAYERS, seed: int = 0, **extra: object
) -> PreTrainedModel:
    """A 4-layer, 32-wide causal LM of ``family`` (``"gpt2"`` or a model type with a pp plan), in eval mode."""
    torch.manual_seed(seed)
    common = {
        "vocab_size": VOCAB,
        "tie_word_embeddings": tie,
        "attn_implementation": attn,
        "use_cache": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if family == "gpt2":
        cfg = GPT2Config(
            n_layer=layers, n_embd=DIM, n_head=2, n_positions=2 * SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, **common, **extra,
        )  # fmt: skip
        return GPT2LMHeadModel(cfg).eval()
    settings = {
        "num_hidden_layers": layers, "hidden_size": DIM, "intermediate_size": 2 * DIM, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": DIM // 4, "max_position_embeddings": 2 * SEQ,
        **common, **PLAN_FAMILIES.get(family, {}), **extra,
    }  # fmt: skip
    cfg = AutoConfig.for_model(family, **settings)
    return AutoModelForCausalLM.from_config(cfg).eval()


def batch(seed: int = 0, rows: int = 4, padded: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
    """``ids [rows, SEQ]``, a padding mask (row 1 left-padded, row 2 right-padded; None if not ``padded``)
    and the labels: the ids, ``-100`` where the mask is 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    if not padded:
        return ids, None, ids.clone()
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, SEQ - 2 :] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def reference_step(model: PreTrainedModel, ids: Tensor, mask: Tensor | None, labels: Tensor) -> tuple[Tensor, dict]:
    """HF's own loss and gradients, on a copy of ``model`` (``model`` itself is left untouched)."""
    ref = copy.deepcopy(model)
    loss = ref(ids, attention_mask=mask, labels=labels).loss
    loss.backward()
    return loss.detach(), grads_by_name(ref)


def grads_by_name(model: nn.Module) -> dict[str, Tensor]:
    """Each parameter's gradient by name (a tied parameter once, under its first name)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def reduction_length(kind: str = "logits") -> int:
    """The reductions on the path to the logits (for ``fp_tolerance``), plus the rows a weight gradient sums."""
    per_block = DIM + 2 * DIM + SEQ + DIM // 4  # norms, the MLP (2 x width), attention over T, scores
    k = LAYERS * per_block + DIM
    return k + 4 * SEQ if kind == "grad" else k
