"""What ``fastpipe train`` measures and shows after training: the validation loss and a text sample.

:func:`evaluate` runs fixed validation batches through the ``Pipe`` (the same batches for
every run, so runs compare); :func:`sample_text` draws characters from the model one at a
time, through each stage in this thread.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fastpipe.pipe import Pipe
from fastpipe.train.textdata import Corpus, decode, encode

__all__ = ["evaluate", "sample_text"]


def _forward_layers(pipe: Pipe, x: Tensor) -> Tensor:
    """The model's output through each stage in turn, in this thread (sampling, one sequence)."""
    for stage, device in zip(pipe.partitions, pipe.devices):
        x = stage(x.to(device))
    return x


@torch.no_grad()
def sample_text(
    pipe: Pipe, logits_of: Callable[[Tensor], Tensor], prompt: str, chars: int, seq_len: int, seed: int
) -> str:
    """``chars`` characters after ``prompt``, drawn at temperature 0.8 from the model.

    ``logits_of`` turns the model's output at the last position into logits (the identity
    for a model whose last layer makes them).
    """
    g = torch.Generator().manual_seed(seed)
    ids = encode(prompt)[None]
    was_training = pipe.training
    pipe.eval()  # no dropout while sampling
    try:
        for _ in range(chars):
            h = _forward_layers(pipe, ids[:, -seq_len:])
            logits = logits_of(h[:, -1].float()).float().cpu()
            nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g)
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        pipe.train(was_training)
    return prompt + decode(ids[0, len(prompt) :])


@torch.no_grad()
def evaluate(
    pipe: Pipe,
    loss_fn: Any,
    corpus: Corpus,
    args: argparse.Namespace,
    autocast: Any,
    first: torch.device,
    last: torch.device,
    targets: Callable[[Tensor, Tensor], Tensor] = lambda x, y: y,
) -> float:
    """Mean validation loss over ``--eval-batches`` fixed batches (the same for every run).

    ``targets(x, y)`` is what the loss takes from inputs ``x`` and next characters ``y``.
    """
    pipe.eval()
    total = 0.0
    for i in range(args.eval_batches):
        x, y = corpus.batch("val", args.batch, args.seq_len, args.seed, i)
        with autocast():
            h = pipe(x.to(first))
            total += float(loss_fn(h, targets(x, y).to(last)))
    pipe.train()
    return total / args.eval_batches
