"""``Pipe(x)`` + ``backward()`` on one GPU as two stages, against plain gradient accumulation.

A compute-bound bf16 MLP (blocks of Linear(D, H) · GELU · Linear(H, D)) is trained one step
at a time:

* **plain**: the ``nn.Sequential`` on ``cuda:0``, the same M micro-batches one after the
  other, each ``backward()``-ed (gradient accumulation): the work the pipeline does,
  without the pipeline;
* **pipe**: ``Pipe(model, balance=[L/2, L/2], devices=["cuda:0", "cuda:0"], chunks=M)``,
  ``loss(pipe(x)).backward()``, for checkpoint ``never`` and ``except_last``;
* **train_step** (1F1B) for reference.

Timed steps are interleaved round-robin; the median is reported. Then the peak memory of
one step (``torch.cuda.max_memory_allocated`` above what parameters and gradients hold)
for every checkpoint mode and for the plain model on the full batch. Prints one line
``JSON {...}``.

Usage::

    python bench/pipe_gpu.py --json out.json            # on a GPU host
    python bench/pipe_gpu.py --device cpu --small       # a smoke run on CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from fastpipe import Pipe


def build(blocks: int, dim: int, hidden: int, dtype: torch.dtype, device: str) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)]
    return nn.Sequential(*layers).to(device=device, dtype=dtype)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], None], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def peak_bytes(fn: Callable[[], None], device: str) -> int | None:
    """Peak allocation of ``fn`` above what was allocated before it (None off CUDA)."""
    if not device.startswith("cuda"):
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    sync(device)
    return torch.cuda.max_memory_allocated() - base


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = args.device
    blocks, dim, hidden, batch = (2, 64, 128, 64) if args.small else (8, 2048, 8192, 8192)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    half = blocks * 3 // 2
    x = torch.randn(batch, dim, device=device, dtype=dtype)
    plain = build(blocks, dim, hidden, dtype, device)
    pipes = {
        mode: Pipe(
            build(blocks, dim, hidden, dtype, device),
            balance=[half, blocks * 3 - half],
            devices=[device, device],
            chunks=args.chunks,
            checkpoint=mode,
        )
        for mode in ("never", "except_last", "always")
    }
    micro = x.chunk(args.chunks)

    def plain_accumulate() -> None:
        for mb in micro:  # each micro-batch's share of the mean, as in the pipe's one loss
            (loss_of(plain(mb)) * (mb.size(0) / batch)).backward()

    def plain_full() -> None:
        loss_of(plain(x)).backward()

    def pipe_step(mode: str) -> Callable[[], None]:
        return lambda: loss_of(pipes[mode](x)).backward()

    def train_step() -> None:
        pipes["never"].train_step(x, torch.zeros_like(x), lambda out, _: loss_of(out), schedule="1f1b")

    runs = {
        "plain_accumulate": plain_accumulate,
        "pipe_never": pipe_step("never"),
        "pipe_except_last": pipe_step("except_last"),
        "train_step_1f1b": train_step,
    }
    first = {name: timed(fn, device) for name, fn in runs.items()}  # includes CUDA/cuBLAS start-up
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            times[name].append(timed(fn, device))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    base = median["plain_accumulate"]
    pipe_step("always")()  # its gradients exist before its peak is taken, like the others'
    memory = {"plain_full_batch": peak_bytes(plain_full, device)}
    for mode in pipes:
        memory[f"pipe_{mode}"] = peak_bytes(pipe_step(mode), device)
    full = memory["plain_full_batch"]
    result = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "model": {
            "blocks": blocks,
            "dim": dim,
            "hidden": hidden,
            "batch": batch,
            "chunks": args.chunks,
            "dtype": str(dtype),
        },
        "rounds": args.rounds,
        "median_s": median,
        "ratio_to_plain_accumulate": {name: t / base for name, t in median.items()},
        "first_step_s": first,
        "peak_mib": {k: None if v is None else round(v / 2**20, 1) for k, v in memory.items()},
        "peak_ratio_to_full_batch": {
            k: None if v is None or not full else round(v / full, 3) for k, v in memory.items()
        },
    }
    line = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(line + "\n")
    print("JSON " + line)


if __name__ == "__main__":
    main()
