"""``to_sequential``: a HuggingFace causal LM as a ``fastpipe.Sequential`` that ``Pipe`` can cut.

Two ways in, both reading the model rather than knowing its class:

* a model whose config has a ``base_model_pp_plan`` (Llama, Mistral, Qwen2, Gemma and most
  decoders of transformers 5): the plan lists the base model's children in order, with the
  names of what flows between them::

      base_model_pp_plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
                            "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
                            "norm": (["hidden_states"], ["hidden_states"])}
      _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}        # on the ...ForCausalLM class

  The entry that is an ``nn.ModuleList`` is the decoder layers; the entries before it go to
  the embedding layer, those after it to the final norm, and the class's ``_pp_plan`` names
  the head.
* GPT-2 (``model_type == "gpt2"``), whose config has no plan: ``wte``, ``wpe`` and ``drop``,
  then ``h``, ``ln_f`` and ``lm_head``.

The plan says which modules each pipeline layer owns; what the model computes between them,
each layer takes from the model's own forward (:mod:`fastpipe.hf.layers`). A model is
refused, before anything runs, where state would travel between its layers outside the
pipeline: modules with parameters outside the plan (Gemma 3n's AltUp and per-layer inputs),
layer arguments that are neither tensors nor plain values (Gemma 4's shared KV states), layer
arguments computed from the hidden states, or hidden states changed between layers
(:mod:`fastpipe.hf.probe`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from fastpipe.hf.errors import UnsupportedModelError
from fastpipe.hf.layers import DecoderBlock, Embeddings, FinalNorm, Layout, LMHead
from fastpipe.hf.own_forward import has_state
from fastpipe.hf.probe import check_layer_inputs
from fastpipe.model.side_inputs import Sequential

__all__ = ["UnsupportedModelError", "to_sequential"]

_TESTED = (
    "GPT-2, GPT-NeoX, GPT-J, Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Phi-2, Phi-3, Gemma 1-3, OLMo 1-3, "
    "Cohere, Granite, Starcoder2, GLM, Doge and Beam"
)
# The attention kinds of `config.layer_types` the adapter is tested with; linear, indexed and
# compressed attention keep state the tests do not cover.
_KINDS = ("full_attention", "sliding_attention")
_GPT2 = ("wte", "wpe", "drop", "h", "ln_f")  # GPT-2's base model, in order: it has no plan


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
        UnsupportedModelError: the model is neither, its plan names modules it lacks, or
            it passes state between its layers that the pipeline would not carry (the
            message names it).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} has no .config; pass a HuggingFace "
            "PreTrainedModel (a ...ForCausalLM)"
        )
    if getattr(config, "model_type", None) == "gpt2":
        if getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError(
                "fastpipe.hf.to_sequential: this GPT-2 has cross-attention (add_cross_attention=True); the adapter "
                "pipelines decoder-only models"
            )
        plan, where, head_name = list(_GPT2), "GPT-2's layout (transformer.wte, wpe, drop, h, ln_f)", "lm_head"
        _child(model, head_name, "GPT-2's layout (lm_head)", model)
    else:
        plan = list(getattr(config, "base_model_pp_plan", None) or ())
        if not plan:
            raise UnsupportedModelError(
                f"fastpipe.hf.to_sequential: {type(model).__name__} is not GPT-2 and its config "
                f"({type(config).__name__}) has no base_model_pp_plan, which says how its base model divides into "
                f"stages; the adapter knows GPT-2 and models with a plan (tested: {_TESTED}). Build a "
                "fastpipe.Sequential of its layers by hand instead (see docs/hf.md, section 'Building a "
                "Sequential by hand')"
            )
        _base_name(model)  # a base model passed for the causal LM: say so before anything else
        where, head_name = f"{type(config).__name__}.base_model_pp_plan", _head_name(model)
    _refuse_config(model, config)
    layout, before, after = _layout(model, config, plan, where, head_name)
    base = layout.base
    seq = Sequential(
        Embeddings(layout, {name: getattr(base, name) for name in before}),
        *(DecoderBlock(layout, i) for i in range(layout.blocks)),
        FinalNorm(layout, {name: getattr(base, name) for name in after}),
        LMHead(layout, getattr(model, head_name)),
    )
    check_layer_inputs(seq, type(model).__name__)
    return seq


def _refuse_config(model: nn.Module, config: Any) -> None:
    """Refuse configs whose training the pipeline cannot reproduce."""
    name = type(model).__name__
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {name} has use_bidirectional_attention=True: every token sees the one it "
            "is trained to predict, so causal_lm_loss does not apply; pipeline it as a causal model "
            "(use_bidirectional_attention=False)"
        )
    coef = getattr(config, "router_aux_loss_coef", None)
    if getattr(config, "output_router_logits", False) and coef != 0:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {name} has output_router_logits=True, so its loss adds "
            f"router_aux_loss_coef ({coef}) x a load-balancing loss. That loss multiplies the expert loads of the "
            "whole mini-batch by its router probabilities, so no micro-batch knows its share until every forward "
            "has run, and a pipeline's backward starts before that. Set config.output_router_logits=False (HF's "
            "loss is then the plain cross-entropy that causal_lm_loss computes)"
        )
    for index, kind in enumerate(getattr(config, "layer_types", None) or ()):
        if kind not in _KINDS:
            raise UnsupportedModelError(
                f"fastpipe.hf.to_sequential: {name}'s decoder layer {index} is of type {kind!r}; the adapter "
                f"pipelines layers of types {', '.join(map(repr, _KINDS))} only (tested: {_TESTED})"
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


def _head_name(model: nn.Module) -> str:
    """The LM head's attribute, as the class's ``_pp_plan`` names it."""
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
    _child(model, names[0], f"{type(model).__name__}._pp_plan", model)
    return str(names[0])


def _base_name(model: nn.Module) -> str:
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module) or base is model:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(model).__name__} has no base model under "
            f"base_model_prefix={prefix!r}; pass the causal LM (the ...ForCausalLM class)"
        )
    return str(prefix)


def _layout(
    model: nn.Module, config: Any, names: list[str], where: str, head_name: str
) -> tuple[Layout, list[str], list[str]]:
    """The model's :class:`Layout`, with the plan's modules before and after the decoder layers."""
    base_name = _base_name(model)
    base = getattr(model, base_name)
    modules = {name: _child(base, name, where, model) for name in names}
    stacks = [name for name, module in modules.items() if isinstance(module, nn.ModuleList)]
    if len(stacks) != 1:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {where} should name one nn.ModuleList of decoder layers, found "
            f"{stacks or 'none'} among {names}"
        )
    cut = names.index(stacks[0])
    if cut == 0:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {where} has no module before {stacks[0]!r} to embed the input ids"
        )
    stack = modules[stacks[0]]
    assert isinstance(stack, nn.ModuleList)
    blocks = min(len(stack), getattr(config, "num_hidden_layers", None) or len(stack))
    if blocks == 0:
        raise UnsupportedModelError(f"fastpipe.hf.to_sequential: {type(model).__name__} has no decoder layers")
    outside = [(name, child) for name, child in base.named_children() if name not in modules]
    weighted = [name for name, child in outside if any(True for _ in child.parameters())]
    if weighted:
        raise UnsupportedModelError(
            f"fastpipe.hf.to_sequential: {type(base).__name__} has modules with parameters that {where} does not "
            f"place: {', '.join(weighted)}. Its forward feeds their results to the decoder layers beside the hidden "
            "states (per-layer inputs, extra residual streams), which a pipeline stage does not receive"
        )
    helpers = tuple(name for name, child in outside if has_state(child))
    layout = Layout(model, base_name, stacks[0], tuple(stack), blocks, head_name, helpers)
    return layout, names[:cut], names[cut + 1 :]
