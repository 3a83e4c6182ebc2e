"""A HuggingFace GPT-2 and Llama training step: the plain HF model against fastpipe, paired.

Both sides compute the same thing: the HF model's own loss on a padded batch
(``model(ids, attention_mask=mask, labels=labels).loss`` then ``backward()``), against
``Pipe(fastpipe.hf.to_sequential(model), ...).train_step(ids, labels, causal_lm_loss,
attention_mask=mask)``. Rounds alternate in one process and each round's ratio is
fastpipe / plain, so drift between rounds cancels. The pipe's stages share the CPU's cores
(``--threads`` per stage), the plain model gets all of them.

It also measures what the tie costs: the same GPT-2 with ``tie_word_embeddings=False``
(its own head weight) against the tied one, both through the pipe, and the tie's refresh
(owner to reader copy) and gradient fold alone.

Run: ``OMP_NUM_THREADS=1 python bench/hf_step.py [--rounds 11]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import fastpipe
from fastpipe.hf import causal_lm_loss, to_sequential

VOCAB, T, BATCH = 2048, 64, 8


def gpt2(tied: bool = True) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=256, n_layer=4, n_head=4, tie_word_embeddings=tied)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return GPT2LMHeadModel(cfg)


def llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=T,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, T), generator=g)
    mask = torch.ones(BATCH, T, dtype=torch.long)
    for row in range(0, BATCH, 2):
        mask[row, T - 8 * (row // 2 + 1) :] = 0  # right padding of different lengths
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def paired(a: Callable[[], object], b: Callable[[], object], rounds: int) -> list[float]:
    """b's time over a's, per round, alternating which goes first."""
    for _ in range(2):
        a(), b()
    out = []
    for r in range(rounds):
        if r % 2:
            tb, ta = timed(b), timed(a)
        else:
            ta, tb = timed(a), timed(b)
        out.append(tb / ta)
    return out


def show(name: str, ratios: list[float]) -> None:
    print(
        f"{name}: median {statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}, "
        f"{len(ratios)} rounds)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--chunks", type=int, default=4)
    args = parser.parse_args()
    ids, mask, labels = batch()
    for name, build in (("GPT-2", gpt2), ("Llama", llama)):
        model = build()

        def plain(model=model) -> None:
            model.zero_grad(set_to_none=True)
            model(ids, attention_mask=mask, labels=labels).loss.backward()

        seq = to_sequential(model)
        pipe = fastpipe.Pipe(seq, balance=_halves(len(seq)), chunks=args.chunks, checkpoint="never")

        def piped(pipe=pipe) -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)

        show(f"{name} step, fastpipe 2 stages / plain HF model", paired(plain, piped, args.rounds))

    tied, untied = gpt2(True), gpt2(False)
    pipes = [
        fastpipe.Pipe(to_sequential(m), balance=_halves(len(to_sequential(m))), chunks=args.chunks, checkpoint="never")
        for m in (untied, tied)
    ]

    def step(pipe: fastpipe.Pipe) -> Callable[[], None]:
        def run() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(ids, labels, causal_lm_loss, attention_mask=mask)
            with torch.no_grad():  # an optimizer step: the next refresh must copy
                for p in pipe.parameters():
                    p.add_(p.grad, alpha=-1e-6) if p.grad is not None else None

        return run

    show("GPT-2 step, tied / untied (fastpipe, 2 stages)", paired(step(pipes[0]), step(pipes[1]), args.rounds))
    (tie,) = pipes[1].ties
    source = tie.source()
    refresh = []
    for _ in range(args.rounds):
        with torch.no_grad():
            source.add_(0.0)  # bumps the version: the refresh copies
        refresh.append(timed(tie.refresh))
    step_time = statistics.median(timed(step(pipes[1])) for _ in range(3))
    print(
        f"tie refresh alone ({tuple(source.shape)} fp32): median {statistics.median(refresh) * 1e3:.2f} ms, "
        f"{statistics.median(refresh) / step_time:.1%} of a tied step ({step_time * 1e3:.0f} ms)"
    )


def _halves(n: int) -> list[int]:
    return [n // 2, n - n // 2]


if __name__ == "__main__":
    main()
