"""What recompute costs on a HF GPT-2 step: ``checkpoint=`` never, except_last, "mlp", "attention", and "auto".

The model: GPT-2 with 8 layers, d=256, a 4096-token vocabulary, a
mini-batch of 16 x 128 tokens in 4 micro-batches, 2 CPU stages (one thread each), 1F1B,
``train_step(ids, ids, causal_lm_loss)``. ``"auto"`` runs under a ``memory_limit`` that every
candidate fits, so it should run as ``"never"`` does.

Every pipe is built once; rounds alternate their order and each round's times are divided by
that round's ``never`` time, so drift between rounds cancels. Two times per step: the wall
clock, and the CPU time of the whole process (every stage worker's thread), which is the work
recompute adds and moves far less than the wall clock when other processes share the cores.
Each mode's predicted peak per device (``MemoryGuard.predict``, Adam's state counted) is printed
beside its times.

Run: ``OMP_NUM_THREADS=1 python bench/selective_recompute.py [--rounds 9] [--layers 8]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import fastpipe
from fastpipe.hf import causal_lm_loss, to_sequential
from fastpipe.memory.limit import MemoryGuard
from fastpipe.memory.sizes import format_bytes
from fastpipe.schedule.builders import build
from fastpipe.step.recompute_policy import checkpoint_setting

MODES = ("never", "except_last", "mlp", "attention", "auto")


def gpt2(layers: int, width: int, vocab: int, tokens: int) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=tokens, n_embd=width, n_layer=layers, n_head=4, use_cache=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, args.vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(1))
    first = (args.layers + 3 + 1) // 2  # embeddings, blocks, final norm, head: the head's stage one layer lighter
    balance = [first, args.layers + 3 - first]
    pipes = {}
    for mode in MODES:
        seq = to_sequential(gpt2(args.layers, args.width, args.vocab, args.tokens))
        limit = "1TiB" if mode == "auto" else None
        pipes[mode] = fastpipe.Pipe(seq, balance, chunks=args.chunks, checkpoint=mode, memory_limit=limit)

    def run(mode: str) -> tuple[float, float]:
        pipe = pipes[mode]
        pipe.zero_grad(set_to_none=True)
        start, cpu = time.perf_counter(), time.process_time()
        pipe.train_step(ids, ids, causal_lm_loss)
        return time.perf_counter() - start, time.process_time() - cpu

    for _ in range(2):
        for mode in MODES:
            run(mode)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    ratios: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_ratios: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES[r % len(MODES) :] + MODES[: r % len(MODES)]
        got = {mode: run(mode) for mode in order}
        for mode in MODES:
            times[mode].append(got[mode][0])
            ratios[mode].append(got[mode][0] / got["never"][0])
            cpu_ratios[mode].append(got[mode][1] / got["never"][1])

    guard = MemoryGuard("1TiB")
    layers = [m for part in pipes["never"].partitions for m in part]
    schedule = build("1f1b", 2, args.chunks)
    sample = ids[: args.rows // args.chunks]
    peaks: dict[str, list[int]] = {}
    for mode in MODES[:-1]:
        devices = guard.predict(layers, balance, schedule, checkpoint_setting(mode), 2, sample, sample, causal_lm_loss)
        peaks[mode] = [d.total for d in devices]
    chosen = str(pipes["auto"].checkpoint_chosen)
    peaks["auto"] = peaks.get(chosen, [])
    for pipe in pipes.values():
        pipe.close()

    shape = f"{args.rows}x{args.tokens} tokens in {args.chunks} micro-batches"
    print(f"GPT-2 {args.layers} layers, d={args.width}, vocab {args.vocab}, {shape}, balance {balance}, 1f1b")
    print(f"{args.rounds} rounds; auto chose {chosen}")
    print("| checkpoint | wall / never, median (min-max) | CPU time / never, median (min-max) | predicted peaks |")
    print("|---|---|---|---|")
    for mode in MODES:
        r, c = ratios[mode], cpu_ratios[mode]
        print(
            f"| {mode} | {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f}) | {statistics.median(c):.3f} "
            f"({min(c):.3f}-{max(c):.3f}) | {' / '.join(format_bytes(b) for b in peaks[mode])} |"
        )
    print(f"never's median wall time: {statistics.median(times['never']):.3f} s")
    if args.json:
        figures = {"times": times, "ratios": ratios, "cpu_ratios": cpu_ratios, "peaks": peaks, "auto": chosen}
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **figures}, f)


if __name__ == "__main__":
    main()
