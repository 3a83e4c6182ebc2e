"""``to_sequential``: a HuggingFace causal LM as a ``fastpipe.Sequential`` that ``Pipe`` can cut.

Two ways in, both reading the model rather than knowing its class:

* a model whose config has a ``base_model_pp_plan`` (Llama, Mistral, Qwen2, Gemma and most
  decoders of transformers 5): the plan lists the base model's children in order, with the
  names of what flows between them::

      base_model_pp_plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                            "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                            "norm": (["hidden_states"], ["hidden_states"])}
      _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}        # on the ...ForCausalLM class

  The entry that is an ``nn.ModuleList`` is the decoder layers; the entries before it make
  the embedding layer, those after it the final norm, and the class's ``_pp_plan`` names the
  head.
* GPT-2 (``model_type == "gpt2"``), whose config has no plan: ``wte``, ``wpe`` and ``drop``
  make the embedding layer, then ``h``, ``ln_f`` and ``lm_head``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fastpipe.hf.layers import DecoderBlock, Embeddings, FinalNorm, GPT2Embeddings, LMHead, layer_type
from fastpipe.side_inputs import Sequential

__all__ = ["UnsupportedModelError", "to_sequential"]

_TESTED = "GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 1-3"


class UnsupportedModelError(ValueError):
    """The model is not one ``to_sequential`` can cut; the message names what is missing."""


def to_sequential(model: nn.Module) -> Sequential:
    """The layers of HF causal LM ``model`` as a :class:`fastpipe.Sequential`, sharing its modules.

    The layers are the embedding, one per decoder block, the final norm and the LM head. They
    hold the model's own modules and parameters, never copies: a pipeline built on them trains
    ``model`` itself, and ``model.save_pretrained()`` saves what it learned. A tied head
    (``tie_word_embeddings``) reads the embedding's weight, so the first and the last layer
    share one parameter (``fastpipe.Pipe`` keeps the tie across stages).

    The result takes the HF model's per-call inputs as side inputs, so it is called like the
    model and returns its logits::

        seq = fastpipe.hf.to_sequential(model)
        seq(ids, attention_mask=mask)          # == model(ids, attention_mask=mask).logits
        pipe = fastpipe.Pipe(seq, balance=[3, 3], chunks=4)
        pipe.train_step(ids, ids, fastpipe.hf.causal_lm_loss, attention_mask=mask)

    ``attention_mask`` is the 2-D padding mask ``[B, T]`` (1 = keep); ``position_ids`` default
    to ``0 .. T-1``. No KV cache is made (``use_cache`` plays no part).

    Args:
        model: a ``...ForCausalLM`` (or ``GPT2LMHeadModel``): GPT-2, or a model whose config
            has a ``base_model_pp_plan`` and whose class has a ``_pp_plan`` for the head.

    Raises:
        UnsupportedModelError: the model is neither, or its plan names modules it lacks.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} has no .config; pass a HuggingFace "
            "PreTrainedModel (a ...ForCausalLM)"
        )
    if getattr(config, "model_type", None) == "gpt2":
        return _gpt2(model)
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} is not GPT-2 and its config "
            f"({type(config).__name__}) has no base_model_pp_plan, which says how its base model divides into "
            f"stages; the adapter knows GPT-2 and models with a plan (tested: {_TESTED}). Build a "
            "fastpipe.Sequential of its layers by hand instead (see docs/hf.md)"
        )
    return _planned(model, config, dict(plan))


def _refuse_unsupported(model: nn.Module, config: Any) -> None:
    """Refuse configs whose base model does more between its modules than the plan says."""
    for name in ("embedding_multiplier", "logits_scaling", "logit_scale", "lm_head_multiplier"):
        if getattr(config, name, None) not in (None, 1, 1.0):
            raise UnsupportedModelError(
                f"fastpipe.hf.to_sequential: {type(model).__name__} scales its embeddings or logits outside its "
                f"modules (config.{name}={getattr(config, name)!r}), which the pipeline plan does not cover"
            )
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} has use_bidirectional_attention=True; the adapter "
            "builds causal masks only"
        )


def _child(parent: nn.Module, name: str, where: str, model: nn.Module) -> nn.Module:
    module = getattr(parent, name, None)
    if not isinstance(module, nn.Module):
        children = ", ".join(n for n, _ in parent.named_children()) or "none"
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {where} names the module {name!r}, but {type(parent).__name__} "
            f"(in {type(model).__name__}) has no module {name!r} (its modules: {children})"
        )
    return module


def _head(model: nn.Module) -> nn.Module:
    """The LM head named by the class's ``_pp_plan``."""
    plan = getattr(type(model), "_pp_plan", None) or getattr(model, "_pp_plan", None)
    if not plan:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} has no _pp_plan naming its LM head; pass the "
            "causal LM (the ...ForCausalLM class), not the base model"
        )
    names = list(plan)
    if len(names) != 1:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__}._pp_plan names {names}; the adapter expects one "
            "head module (a causal LM's lm_head)"
        )
    return _child(model, names[0], f"{type(model).__name__}._pp_plan", model)


def _base(model: nn.Module) -> nn.Module:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} has no base model under "
            f"base_model_prefix={prefix!r}; pass the causal LM (the ...ForCausalLM class)"
        )
    return base


def _planned(model: nn.Module, config: Any, plan: dict[str, Any]) -> Sequential:
    _refuse_unsupported(model, config)
    base = _base(model)
    where = f"{type(config).__name__}.base_model_pp_plan"
    modules = {name: _child(base, name, where, model) for name in plan}
    stacks = [name for name, module in modules.items() if isinstance(module, nn.ModuleList)]
    if len(stacks) != 1:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {where} should name one nn.ModuleList of decoder layers, found "
            f"{stacks or 'none'} among {list(plan)}"
        )
    names = list(plan)
    cut = names.index(stacks[0])
    before, after = names[:cut], names[cut + 1 :]
    if not before:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {where} has no module before {stacks[0]!r} to embed the input ids"
        )
    rotary = getattr(base, "rotary_emb", None)
    if rotary is not None and any(True for _ in rotary.parameters()):
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(base).__name__}.rotary_emb has parameters; the adapter shares it "
            "between the blocks as a module of constant buffers only"
        )
    stack = modules[stacks[0]]
    assert isinstance(stack, nn.ModuleList)
    layers = list(stack)[: getattr(config, "num_hidden_layers", None)]
    blocks = [DecoderBlock(layer, config, layer_type(config, i), rotary) for i, layer in enumerate(layers)]
    return Sequential(
        Embeddings([modules[n] for n in before], before),
        *blocks,
        FinalNorm([modules[n] for n in after], after),
        LMHead(_head(model), getattr(config, "final_logit_softcapping", None)),
    )


def _gpt2(model: nn.Module) -> Sequential:
    where = "GPT-2's layout (transformer.wte, wpe, drop, h, ln_f; lm_head)"
    base = _child(model, "transformer", where, model)
    wte, wpe, drop, h, ln_f = (_child(base, name, where, model) for name in ("wte", "wpe", "drop", "h", "ln_f"))
    config: Any = model.config
    if getattr(config, "add_cross_attention", False):
        raise UnsupportedModelError(
            "fastpipe.hf.to_sequential: this GPT-2 has cross-attention (add_cross_attention=True); the adapter "
            "pipelines decoder-only models"
        )
    if not isinstance(h, nn.ModuleList):
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: GPT-2's transformer.h is a {type(h).__name__}, "
            "not the nn.ModuleList of its blocks"
        )
    blocks = [DecoderBlock(block, config, "full_attention") for block in h]
    return Sequential(
        GPT2Embeddings(wte, wpe, drop),
        *blocks,
        FinalNorm([ln_f], ["ln_f"]),
        LMHead(_child(model, "lm_head", where, model)),
    )
