"""The pipeline layers of a HuggingFace causal LM: thin wrappers around the model's own modules.

Each wrapper holds the HF modules themselves (never a copy), so training the pipeline trains
the HF model. What the HF base model computes once per forward between its modules (the
4-D causal mask, the rotary ``(cos, sin)``, the default position ids) each decoder block
computes for itself from the side inputs, with transformers' own functions::

    ids ─▶ Embeddings ─▶ DecoderBlock × n ─▶ FinalNorm ─▶ LMHead ─▶ logits
                          ▲ attention_mask [B, T] (1 = keep), position_ids [B|1, T]
                          │ (side inputs: split with the micro-batch, or broadcast)
                          └─ mask = create_causal_mask(config, hidden, attention_mask, ...)
                             position_embeddings = rotary_emb(hidden, position_ids)

Building the mask from the 2-D padding mask in every block keeps the pipeline's side inputs
small ([B, T] instead of [B, 1, T, T]) and keeps the mask causal under every attention
implementation: eager attention applies only the mask it is given, so a block that got no
mask would attend to the future without a word.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

__all__ = ["SIDE_INPUTS", "Chain", "Embeddings", "GPT2Embeddings", "DecoderBlock", "FinalNorm", "LMHead", "layer_type"]

# The side inputs a HF decoder takes from the caller, as the HF model's forward names them.
SIDE_INPUTS = ("attention_mask", "position_ids")

_MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}


def _positions(hidden: Tensor, position_ids: Tensor | None) -> Tensor:
    """The caller's position ids, or HF's default ``arange(T)[None]`` (no cache: nothing seen before)."""
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.size(1), device=hidden.device).unsqueeze(0)


def layer_type(config: Any, index: int) -> str:
    """The attention kind of decoder layer ``index``: ``"full_attention"`` or ``"sliding_attention"``.

    ``config.layer_types`` when the config lists them (Qwen2, Gemma2/3, ...); else a sliding
    window for every layer when ``config.sliding_window`` is set (Mistral, Phi-3), as those
    base models choose their mask.

    Raises:
        ValueError: a layer type whose mask this adapter does not build.
    """
    types = getattr(config, "layer_types", None)
    if types:
        kind = str(types[index])
    else:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    if kind not in _MASKS:
        raise ValueError(
            f"fastpipe.hf: decoder layer {index} is of type {kind!r}; the adapter builds masks for "
            f"{', '.join(map(repr, _MASKS))} only"
        )
    return kind


class Chain(nn.Module):
    """HF modules applied in order, under their names in the HF base model.

    Args:
        modules: the HF modules.
        names: their names in the HF base model, kept as the submodule names.
    """

    def __init__(self, modules: Sequence[nn.Module], names: Sequence[str]) -> None:
        super().__init__()
        self.names = tuple(names)
        for name, module in zip(self.names, modules):
            self.add_module(name, module)

    def forward(self, x: Tensor) -> Tensor:
        for name in self.names:
            x = self._modules[name](x)  # type: ignore[misc]
        return x


class Embeddings(Chain):
    """The modules before the decoder layers (token embedding, embedding dropout): ids ``[B, T]`` to ``[B, T, D]``."""


class GPT2Embeddings(nn.Module):
    """GPT-2's ``drop(wte(ids) + wpe(position_ids))``; takes the side input ``position_ids``."""

    fastpipe_side_inputs = ("position_ids",)

    def __init__(self, wte: nn.Module, wpe: nn.Module, drop: nn.Module) -> None:
        super().__init__()
        self.wte = wte
        self.wpe = wpe
        self.drop = drop

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        embeds = self.wte(input_ids)
        positions = self.wpe(_positions(embeds, position_ids))
        return self.drop(embeds + positions.to(embeds.device))


class DecoderBlock(nn.Module):
    """One HF decoder layer, with the mask and the rotary embedding its base model would hand it.

    Args:
        layer: the HF decoder layer (``LlamaDecoderLayer``, ``GPT2Block``, ...).
        config: the model's config (read at each call: ``_attn_implementation`` may change).
        kind: ``"full_attention"`` or ``"sliding_attention"`` (see :func:`layer_type`).
        rotary: the base model's rotary embedding, shared by every block (constant buffers
            only), or None for a model without one.
    """

    fastpipe_side_inputs = SIDE_INPUTS

    def __init__(self, layer: nn.Module, config: Any, kind: str, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.layer = layer
        self.config = config
        self.kind = kind
        self.rotary = rotary
        # Gemma 3 keeps one rotary table per layer type: its forward takes the type.
        self._rotary_by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        positions = _positions(hidden_states, position_ids)
        # The mask the base model builds once; a 2-D padding mask (or None) becomes the 4-D
        # causal mask of this attention implementation (None under SDPA without padding).
        mask = _MASKS[self.kind](
            config=self.config,
            inputs_embeds=hidden_states,
            attention_mask=attention_mask,
            cache=None,
            position_ids=positions,
        )
        kwargs: dict[str, Any] = {"attention_mask": mask, "position_ids": positions}
        if self.rotary is not None:
            extra = (self.kind,) if self._rotary_by_type else ()
            kwargs["position_embeddings"] = self.rotary(hidden_states, positions, *extra)
        out = self.layer(hidden_states, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class FinalNorm(Chain):
    """The modules after the decoder layers (the final norm)."""


class LMHead(nn.Module):
    """The output projection to logits, with Gemma-style ``final_logit_softcapping`` when the config sets it.

    Args:
        head: the HF ``lm_head`` (its weight may be the token embedding's: a tied weight).
        softcap: ``config.final_logit_softcapping`` (None: none).
    """

    def __init__(self, head: nn.Module, softcap: float | None = None) -> None:
        super().__init__()
        self.head = head
        self.softcap = softcap

    def forward(self, hidden_states: Tensor) -> Tensor:
        logits = self.head(hidden_states)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
