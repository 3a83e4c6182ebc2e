"""The plans ``balance="auto"`` picks for a model of identical layers, run after run.

The model is 8 identical Linear(512)+ReLU pairs (16 layers), K = 4 CPU stages, M = 8 micro-batches,
1F1B, a mini-batch of 256 rows (micro-batches of 32), 1 intra-op thread. Each run calls
:func:`fastpipe.balance.auto_balance` afresh (a new profile each time) and prints the plan, the bubble
the planner predicts for it from that run's profile, and the bubble of the even split ``[4, 4, 4, 4]``
on the same profile. The ideal is the even split on every run (its bubble is (K-1)/(M+K-1) = 27.3%
with equal stages and no link cost).

Usage::

    OMP_NUM_THREADS=1 python bench/balance_stability.py --runs 7
"""

from __future__ import annotations

import argparse
import collections
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fastpipe.balance.auto as auto  # noqa: E402
from fastpipe.balance import LayerProfile, auto_balance, predict  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--batch", type=int, default=256, help="mini-batch rows (micro-batch: batch / 8)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(512, 512), nn.ReLU())])
    sample = torch.randn(args.batch, 512)
    profiles: list[LayerProfile] = []
    real = auto.profile_layers

    def keep(*a: object, **k: object) -> LayerProfile:
        profiles.append(real(*a, **k))  # type: ignore[arg-type]
        return profiles[-1]

    auto.profile_layers = keep  # type: ignore[assignment]  # what auto_balance profiled, to predict from
    plans: collections.Counter[tuple[int, ...]] = collections.Counter()
    for run in range(args.runs):
        t0 = time.perf_counter()
        balance = auto_balance(model, ["cpu"] * 4, sample, chunks=8, schedule="1f1b")
        took = time.perf_counter() - t0
        p = profiles[-1]

        def bubble(b: list[int], p: LayerProfile = p) -> float:
            return predict(b, p.forward, p.backward, microbatches=8, schedule="1f1b").bubble_fraction

        plans[tuple(balance)] += 1
        print(
            f"run {run}: balance={balance} predicted bubble {bubble(balance):.1%} "
            f"(even split on this profile {bubble([4] * 4):.1%}), {took:.2f} s"
        )
    print("plans:", ", ".join(f"{list(k)} x{v}" for k, v in plans.most_common()))


if __name__ == "__main__":
    main()
