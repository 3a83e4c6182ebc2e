"""Tiny HuggingFace causal LMs built from scratch (no download), and batches for them.

Import after ``pytest.importorskip("transformers")``. Dropout is 0 and ``use_cache`` off, so
a model's forward is a plain function of its input: the adapter's layers then do the same
arithmetic as the HF model, op for op, and compare bit for bit.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, PreTrainedModel

__all__ = ["VOCAB", "DIM", "LAYERS", "SEQ", "tiny", "batch", "reference_step", "grads_by_name", "reduction_length"]

VOCAB, DIM, LAYERS, SEQ = 100, 32, 4, 8

# Families tested through their config's base_model_pp_plan, each with what it exercises.
PLAN_FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 3},  # a sliding window on every layer, no layer_types
    "qwen2": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2},  # full, then sliding
    "qwen3": {},
    "phi3": {},  # fused qkv and gate_up projections
    "gemma": {},  # embeddings scaled inside its embedding module
    "gemma3_text": {"sliding_window": 3},  # one rotary table per layer type
}


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
    cfg = AutoConfig.for_model(
        family, num_hidden_layers=layers, hidden_size=DIM, intermediate_size=2 * DIM, num_attention_heads=4,
        num_key_value_heads=2, head_dim=DIM // 4, max_position_embeddings=2 * SEQ,
        **common, **PLAN_FAMILIES.get(family, {}), **extra,
    )  # fmt: skip
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
