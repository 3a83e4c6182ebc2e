"""What activation offload costs a 4-stage 1F1B step: simulated from measured stage costs and copy bandwidth.

    python bench/offload_cost.py [--blocks 8] [--width 512] [--batch 256] [--chunks 8]

The reference workload (residual MLP blocks: LayerNorm, Linear d->4d, GELU, Linear 4d->d), cut in 4
stages. Each stage's forward and backward of one micro-batch are profiled on one thread
(:func:`fastpipe.balance.profile_layers`); the bytes offload moves per micro-batch are measured with
the runtime's own choice (:class:`fastpipe.memory.offload_bytes.OffloadBytes`); the copy bandwidth is
offload's own copies (:func:`fastpipe.memory.offload_bytes.copy_bandwidth`: on a CPU, ``_C``'s host
backend into aligned pooled blocks, a memcpy). The simulator then runs 1F1B with the prefetch pass's
``P`` actions and their copies on their own lanes (:mod:`fastpipe.schedule.simulate`), against the
same step without offload. On a CPU offload saves nothing (host memory is the device's), so this is
the cost a GPU step would pay at this bandwidth, not a CPU measurement.
"""

from __future__ import annotations

import argparse
import platform

import torch
from torch import nn

from fastpipe.balance.profile import profile_layers
from fastpipe.memory.offload_bytes import OffloadBytes, copy_bandwidth, copy_costs
from fastpipe.runtime.host_alloc import tune_host_allocator
from fastpipe.runtime.offload import OffloadPolicy, chosen_prefix
from fastpipe.runtime.stage import Stage
from fastpipe.schedule import build, simulate
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.up, self.act, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--stages", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    k, m = args.stages, args.chunks
    model = nn.Sequential(*[Block(args.width) for _ in range(args.blocks)])
    sample = torch.randn(args.batch // m, args.width)
    profile = profile_layers(model, sample, repeats=5)
    per = args.blocks // k
    forward = [sum(profile.forward[s * per : (s + 1) * per]) for s in range(k)]
    backward = [sum(profile.backward[s * per : (s + 1) * per]) for s in range(k)]
    stages = [Stage(nn.Sequential(*model[s * per : (s + 1) * per]), torch.device("cpu")) for s in range(k)]
    for stage in stages:
        stage.offload = OffloadPolicy(1.0, force=True)
    sizes = OffloadBytes(stages).sizes(sample, None, None, (None,) * k)
    tune_host_allocator()  # as a pipe does for CPU stages: freed blocks are reused, not faulted in again
    bandwidth = copy_bandwidth("cpu", nbytes=16 << 20, repeats=10)
    base = build("1f1b", k, m)
    pairs = worth_prefetching(base, [(s, i) for s in range(k) for i in range(m)])
    sched = with_prefetch(base, pairs)
    plain = simulate(base, forward, backward, 0.0).makespan
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread")
    print(f"workload: {args.blocks} blocks d={args.width}, batch {args.batch}, {m} micro-batches, {k} stages")
    print(f"stage F (ms): {', '.join(f'{f * 1e3:.2f}' for f in forward)}")
    print(f"stage BW (ms): {', '.join(f'{b * 1e3:.2f}' for b in backward)}")
    print(f"copy bandwidth: {bandwidth}")
    print(f"1F1B step without offload: {plain * 1e3:.2f} ms (simulated)")
    saved = [sum(s) for s in sizes]  # all of a micro-batch's saved activations that only autograd holds
    total = sum(saved[s] for s in range(k)) * m
    print("| fraction | offloaded per micro-batch (MiB, stages 0-3) | share of the step's activations | step | cost |")
    print("|---|---|---|---|---|")
    for fraction in (0.5, 0.75, 1.0):
        taken = [sum(sz[: chosen_prefix(sz, fraction)]) for sz in sizes]
        moved = sum(taken[s] for s, _ in pairs)
        prefetch, offload = copy_costs(taken, bandwidth)
        step = simulate(sched, forward, backward, 0.0, prefetch=prefetch, offload=offload).makespan
        shown = ", ".join(f"{t / 2**20:.2f}" for t in taken)
        print(f"| {fraction:g} | {shown} | {moved / total:.0%} | {step * 1e3:.2f} ms | {step / plain - 1:+.1%} |")
    # How slow the copies may get before offloading everything costs 10%: bisect a bandwidth factor.
    taken = [sum(sz) for sz in sizes]
    low, high = 1e-6, 1.0
    for _ in range(40):
        mid = (low * high) ** 0.5
        prefetch, offload = copy_costs(taken, bandwidth)
        slowed = {"prefetch": [p / mid for p in prefetch], "offload": [o / mid for o in offload]}
        cost = simulate(sched, forward, backward, 0.0, **slowed)
        low, high = (low, mid) if cost.makespan / plain - 1 <= 0.10 else (mid, high)
    slowest = high * bandwidth.to_device / 2**30
    print(f"fraction 1 costs 10% at {high:.3f} x the measured bandwidth ({slowest:.3f} GiB/s into the device)")


if __name__ == "__main__":
    main()
