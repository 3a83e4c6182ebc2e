"""The task RNG's cost on the main job's GPT: a train_step with the function mode on every stage, against without.

Since 2026-12-01 fastpipe's kernels and the GPT's layers declare ``fastpipe_may_draw``, so a
model without dropout runs without the mode. This script pairs the two in alternating
rounds in one process (the "before" side forces ``may_draw`` to True) and prints the median
ratio. Run: ``OMP_NUM_THREADS=1 python bench/rng_mode_cost.py``.
"""

from __future__ import annotations

import statistics
import time

import torch

import fastpipe
import fastpipe.runtime.step as step
from fastpipe.train.model import GPTConfig, LMLoss, build_gpt


def main(rounds: int = 15) -> None:
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=96, dim=128, n_head=4, n_layer=8, seq_len=64, dropout=0.0)
    model = build_gpt(cfg, seed=0)
    pipe = fastpipe.Pipe(model, balance=[5, 5], chunks=8, checkpoint="except_last")
    loss = LMLoss(model[-1])
    x, y = torch.randint(0, 96, (16, 64)), torch.randint(0, 96, (16, 64))
    real = step.may_draw

    def timed() -> float:
        start = time.perf_counter()
        pipe.train_step(x, y, loss)
        return time.perf_counter() - start

    for _ in range(3):
        timed()
    ratios = []
    for _ in range(rounds):
        step.may_draw = lambda *args: True  # type: ignore[assignment]
        before = timed()
        step.may_draw = real
        ratios.append(timed() / before)
    print(
        f"step time without / with the mode: median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}, {rounds} paired rounds)"
    )


if __name__ == "__main__":
    main()
