"""The models ``fastpipe train --model`` trains, each with its loss, its targets and its logits.

* ``gpt`` (the default): fastpipe's own character GPT (:mod:`.model`), whose loss applies
  the head's projection in chunks so the ``[tokens, vocab]`` logits never exist.
* ``hf-gpt2`` and ``hf-llama``: a HuggingFace ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` of
  the same size, built from scratch (no download) and cut by :func:`fastpipe.hf.to_sequential`.
  The input and output embeddings are tied, so the first and the last stage share one weight.
  The loss is :data:`fastpipe.hf.causal_lm_loss` with the input ids as labels, as HF trains a
  causal LM: the labels shift inside the loss, so each sequence has ``seq_len - 1`` targets.

All read the same text: the vocabulary is :data:`~.textdata.VOCAB` character ids, so every
id is a row of the embedding.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from fastpipe.pipe import Pipe
from fastpipe.train.model import GPTConfig, LMHead, LMLoss, build_gpt
from fastpipe.train.textdata import VOCAB

__all__ = ["MODELS", "HF_MODELS", "TrainModel", "build_model", "check_model"]

MODELS = ("gpt", "hf-gpt2", "hf-llama")
HF_MODELS = MODELS[1:]


def _next_characters(x: Tensor, y: Tensor) -> Tensor:
    return y


def _input_ids(x: Tensor, y: Tensor) -> Tensor:
    return x


def _are_logits(h: Tensor) -> Tensor:
    return h


@dataclass
class TrainModel:
    """A model for ``fastpipe train`` and how the run treats it.

    Attributes:
        layers: the Sequential to pipeline.
        tail: layers after the last block (they join the last stage with it).
        settings: the model's shape, saved with a checkpoint (a resumed run must keep it).
        targets: ``targets(x, y)``, what the loss takes as its target from a batch of inputs
            ``x`` and next characters ``y``.
        make_loss: ``make_loss(pipe)``, the ``loss_fn(output, target)`` of ``train_step``
            (``pipe``: the Pipe, or the Sequential whose last layer a DistributedPipe holds).
        make_logits: ``make_logits(pipe)``, the logits of the last position's output (sampling).
    """

    layers: nn.Sequential
    tail: int
    settings: dict[str, Any]
    targets: Callable[[Tensor, Tensor], Tensor]
    make_loss: Callable[[Pipe | nn.Sequential], Any]
    make_logits: Callable[[Pipe | nn.Sequential], Callable[[Tensor], Tensor]]


def check_model(name: str) -> str | None:
    """Why ``--model name`` cannot run here (transformers missing), or None."""
    if name not in HF_MODELS:
        return None
    try:
        import fastpipe.hf  # noqa: F401 - transformers and the adapter
    except ImportError:
        return (
            f'--model {name} needs transformers: run pip install ".[hf]" in your fastpipe checkout (the package '
            "named fastpipe on the public index is another project)"
        )
    return None


def build_model(args: argparse.Namespace) -> TrainModel:
    """The model ``args.model`` names, of ``args``' size, initialised from ``args.seed``."""
    if args.model in HF_MODELS:
        return _hf_model(args)
    cfg = GPTConfig(VOCAB, args.seq_len, args.layers, args.dim, args.heads, args.dropout)
    return TrainModel(
        build_gpt(cfg, args.seed),
        tail=1,
        settings=cfg.to_dict(),
        targets=_next_characters,
        make_loss=lambda pipe: LMLoss(_head(pipe)),
        make_logits=lambda pipe: _head(pipe).logits,
    )


def _head(pipe: Pipe | nn.Sequential) -> LMHead:
    head = pipe[len(pipe) - 1]
    assert isinstance(head, LMHead)
    return head


def _hf_model(args: argparse.Namespace) -> TrainModel:
    import torch

    from fastpipe.hf import causal_lm_loss, to_sequential

    torch.manual_seed(args.seed)
    model = _hf_config_model(args)
    settings = {
        "family": args.model,
        "vocab": VOCAB,
        "seq_len": args.seq_len,
        "n_layer": args.layers,
        "dim": args.dim,
        "n_head": args.heads,
        "dropout": args.dropout,
        "tied": True,
    }
    return TrainModel(
        to_sequential(model),
        tail=2,  # the final norm and the LM head
        settings=settings,
        targets=_input_ids,
        make_loss=lambda pipe: causal_lm_loss,
        make_logits=lambda pipe: _are_logits,
    )


def _hf_config_model(args: argparse.Namespace) -> nn.Module:
    """A HF causal LM of ``args``' size with tied embeddings, no cache and no special tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "tie_word_embeddings": True,
        "use_cache": False,
        "attn_implementation": "sdpa",
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    if args.model == "hf-gpt2":
        gpt2 = GPT2Config(
            n_positions=args.seq_len, n_embd=args.dim, n_layer=args.layers, n_head=args.heads,
            resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout, **common,
        )  # fmt: skip
        return GPT2LMHeadModel(gpt2)
    llama = LlamaConfig(
        hidden_size=args.dim, intermediate_size=4 * args.dim, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
        attention_dropout=args.dropout, **common,
    )  # fmt: skip
    return LlamaForCausalLM(llama)
