"""The pipeline layers of a HuggingFace causal LM: the model's own modules, run by the model's own forward.

Each layer holds the HF modules themselves (never a copy), so training the pipeline trains
the HF model. What the HF model computes between its modules (embedding scales, the attention
masks, the rotary ``(cos, sin)``, the logits' scale or soft cap) each layer gets by running
the model's own ``forward`` up to the point it needs (:mod:`fastpipe.hf.own_forward`)::

    ids ─▶ Embeddings ─▶ DecoderBlock × n ─▶ FinalNorm ─▶ LMHead ─▶ logits
           base.forward   base.forward up     base.forward  lm.forward with
           up to layer 0  to layer i: its     after layer   the base model
           (its input)    inputs, then the    n-1 (its      answering with
                          layer itself        output)       the hidden states
                          ▲ attention_mask [B, T] (1 = keep), position_ids [B|1, T]
                          └ side inputs: split with the micro-batch, or broadcast

So every block gets the mask its model builds, with that model's options, under every
attention implementation, and the side inputs stay small ([B, T] instead of [B, 1, T, T]).
Each layer has its own copy of the base model's stateful helpers that hold no parameters
(the rotary embedding): a "dynamic" or "longrope" rotary rewrites its ``inv_freq`` on each
call, and a copy per layer keeps those writes inside one stage.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fastpipe.hf.own_forward import Absent, LastHidden, Reached, StandIn, Stub, has_state, hidden_of, own_forward

__all__ = ["SIDE_INPUTS", "PART_NAMES", "Layout", "ModelPart", "Embeddings", "DecoderBlock", "FinalNorm", "LMHead"]

# The side inputs a HF decoder takes from the caller, as the HF model's forward names them.
SIDE_INPUTS = ("attention_mask", "position_ids")

# The attributes HF decoder layers keep their parts under, by part, first match first (Llama's
# self_attn and mlp; GPT-2's attn; Falcon's self_attention; GPT-NeoX's attention; Mixtral's
# block_sparse_moe; Llama 4's feed_forward; DBRX's ffn).
PART_NAMES = {
    "attention": ("self_attn", "attn", "self_attention", "attention"),
    "mlp": ("mlp", "feed_forward", "block_sparse_moe", "ffn"),
}

Calls = list[tuple[int, tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class Layout:
    """Where a causal LM keeps its parts.

    Attributes:
        model: the causal LM (``...ForCausalLM``).
        base_name: the attribute of ``model`` that holds the base model.
        stack_name: the attribute of the base model that holds the decoder layers.
        stack: all the decoder layers, in order.
        blocks: how many of them the base model runs (``config.num_hidden_layers``).
        head_name: the attribute of ``model`` that holds the LM head.
        helpers: the base model's children outside the plan that hold buffers but no parameters.
    """

    model: nn.Module
    base_name: str
    stack_name: str
    stack: tuple[nn.Module, ...]
    blocks: int
    head_name: str
    helpers: tuple[str, ...]

    @property
    def base(self) -> nn.Module:
        """The base model."""
        base = getattr(self.model, self.base_name)
        assert isinstance(base, nn.Module)
        return base


class ModelPart(nn.Module):
    """A pipeline layer that runs a piece of the base model's forward on a :class:`StandIn`.

    Args:
        layout: the model's layout.
        owned: base-model children this layer holds, by their names in the base model.
    """

    def __init__(self, layout: Layout, owned: Mapping[str, nn.Module]) -> None:
        super().__init__()
        self._layout = layout
        base = layout.base
        config = getattr(base, "config", None)
        for name, module in owned.items():
            self.add_module(name, module)
        for name in layout.helpers:  # a copy per layer; the config stays shared (it is read, not written)
            self.add_module(name, copy.deepcopy(getattr(base, name), memo={id(config): config}))
        self._owns = (*owned, *layout.helpers)
        stack = layout.stack_name
        self._foreign = tuple(
            n for n, c in base.named_children() if n not in self._owns and n != stack and has_state(c)
        )
        self._shapes: dict[Any, Any] = {}  # the output shapes of the foreign modules, per input signature

    def _stand_in(self, stubs: list[Stub], training: bool, absent: bool) -> StandIn:
        layout = self._layout
        replaced: dict[str, Any] = {"training": training, layout.stack_name: stubs}
        base = layout.base
        for name in self._owns:
            replaced[name] = getattr(self, name)  # this layer's (a stage's clone reads its own copies)
        if absent:
            replaced.update((name, Absent(getattr(base, name), self._shapes)) for name in self._foreign)
        return StandIn(base, replaced)

    def _base_forward(
        self,
        stubs: list[Stub],
        inputs: dict[str, Any],
        training: bool | None = None,
        absent: bool = True,
    ) -> Any:
        stand_in = self._stand_in(stubs, self.training if training is None else training, absent)
        return own_forward(self._layout.base)(stand_in, use_cache=False, **inputs)

    def _stubs(
        self, target: int | None, last: tuple[int, Tensor] | None = None, seen: Calls | None = None
    ) -> list[Stub]:
        return [Stub(layer, j, target, last, seen) for j, layer in enumerate(self._layout.stack)]

    def inputs_of_layer(
        self,
        index: int,
        given: dict[str, Any],
        *,
        training: bool | None = None,
        absent: bool = True,
        seen: Calls | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments the base model's forward hands decoder layer ``index``, for the inputs ``given``.

        Args:
            index: the decoder layer.
            given: keyword inputs of the base model's forward (``input_ids`` or
                ``inputs_embeds``, ``attention_mask``, ``position_ids``).
            training: the mode the forward runs in (None: this layer's).
            absent: whether modules this layer does not own answer with zeros (see
                :class:`~fastpipe.hf.own_forward.Absent`); False runs the real ones.
            seen: where every layer call up to ``index`` is recorded.

        Raises:
            RuntimeError: the forward returned without calling layer ``index``.
        """
        try:
            self._base_forward(self._stubs(index, seen=seen), given, training, absent)
        except Reached as reached:
            return reached.positional, reached.keywords
        raise RuntimeError(
            f"fastpipe.hf: {type(self._layout.base).__name__}.forward returned without calling decoder layer {index}"
        )


class Embeddings(ModelPart):
    """The base model's forward up to its first decoder layer: ids ``[B, T]`` to that layer's hidden states.

    It owns the modules before the decoder layers (token embedding, position embedding,
    dropout) and applies what the forward does with them (GPT-2's sum, Granite's multiplier).
    """

    fastpipe_side_inputs = SIDE_INPUTS

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Any:
        args, kwargs = self.inputs_of_layer(
            0, {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        )
        return hidden_of(args, kwargs)


class DecoderBlock(ModelPart):
    """HF decoder layer ``index``, called with the arguments its base model's forward would give it.

    Args:
        layout: the model's layout.
        index: the layer's position in the stack.
    """

    fastpipe_side_inputs = SIDE_INPUTS

    def __init__(self, layout: Layout, index: int) -> None:
        super().__init__(layout, {})
        self.index = index
        self.layer = layout.stack[index]

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        given = {"inputs_embeds": hidden_states, "attention_mask": attention_mask, "position_ids": position_ids}
        args, kwargs = self.inputs_of_layer(self.index, given)
        if args:
            out = self.layer(hidden_states, *args[1:], **kwargs)
        else:
            out = self.layer(**{**kwargs, "hidden_states": hidden_states})
        return out[0] if isinstance(out, tuple) else out

    def fastpipe_parts(self) -> dict[str, nn.Module]:
        """The HF layer's submodules by part (see ``PART_NAMES``), which ``Pipe(checkpoint="mlp")`` recomputes."""
        found = {}
        for part, names in PART_NAMES.items():
            module = next((m for n in names if isinstance(m := getattr(self.layer, n, None), nn.Module)), None)
            if module is not None:
                found[part] = module
        return found


class FinalNorm(ModelPart):
    """The base model's forward after its last decoder layer (the final norm): hidden states in, hidden states out."""

    def forward(self, hidden_states: Tensor) -> Any:
        return self.after_layers(hidden_states, {"inputs_embeds": hidden_states})

    def after_layers(
        self, hidden: Tensor, given: dict[str, Any], *, training: bool | None = None, absent: bool = True
    ) -> Any:
        """The base model's output when its last decoder layer returns ``hidden``, for the inputs ``given``.

        Args:
            hidden: what the last decoder layer returns.
            given: keyword inputs of the base model's forward (see :meth:`ModelPart.inputs_of_layer`).
            training: the mode the forward runs in (None: this layer's).
            absent: whether modules this layer does not own answer with zeros.
        """
        stubs = self._stubs(None, last=(self._layout.blocks - 1, hidden))
        out = self._base_forward(stubs, given, training, absent)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


class LMHead(nn.Module):
    """The causal LM's forward after its base model: the LM head and whatever the model does to the logits.

    That covers Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale`` and Granite's
    ``logits_scaling``, as each model's own forward applies them.

    Args:
        layout: the model's layout.
        head: the HF head (its weight may be the token embedding's: a tied weight).
    """

    def __init__(self, layout: Layout, head: nn.Module) -> None:
        super().__init__()
        self._layout = layout
        self.head = head

    def forward(self, hidden_states: Tensor) -> Tensor:
        layout = self._layout
        replaced = {
            "training": self.training,
            layout.head_name: self.head,
            layout.base_name: lambda *args, **kwargs: LastHidden(hidden_states),
        }
        out = own_forward(layout.model)(StandIn(layout.model, replaced), inputs_embeds=hidden_states)
        logits = out.logits if hasattr(out, "logits") else out[0]
        assert isinstance(logits, Tensor)
        return logits
