"""What a weight tied across two ranks costs a DistributedPipe step, against the untied model.

A GPT-like model (token embedding 8192 x 256, 4 pre-norm MLP blocks 256/1024, final
LayerNorm, output head 256 -> 8192) is cut [3, 4] over 2 gloo processes with one intra-op
thread each: the embedding and 2 blocks on rank 0, 2 blocks and the head on rank 1. Two
pipelines are built in the same processes:

* ``tied``: the head's weight is the embedding's (GPT-2); each rank holds a copy, and after
  every backward its gradient is all-reduced (summed) over the two ranks;
* ``untied``: the head has a weight of its own (``tie_word_embeddings=False``): no exchange.

Every round runs one step of each, in alternating order (ABBA), each timed between two
barriers on rank 0, then the all-reduce alone: ``dist.all_reduce`` of a gradient of the tied
weight's size over the pipeline group, timed the same way. The report gives the medians, the
median over rounds of tied/untied (the rounds pair the two, which cancels the drift between
them) and the all-reduce's share of the untied step.

Usage::

    OMP_NUM_THREADS=1 python bench/tie_cost.py --rounds 15 --json bench/results/tie_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from fastpipe.bench.report import write_json  # noqa: E402

VOCAB, DIM, HIDDEN, BLOCKS = 8192, 256, 1024, 4
BATCH, TOKENS, CHUNKS = 8, 64, 4
BALANCE = [3, 4]


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids)


class Block(nn.Module):
    """Pre-norm MLP block with a residual (the attention-free half of a GPT block)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TokenCE(nn.Module):
    reduction = "mean"  # a mean over samples of equal length: exact per micro-batch

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_model(tied: bool) -> nn.Sequential:
    torch.manual_seed(0)
    embed = Embed()
    head = nn.Linear(DIM, VOCAB, bias=False)
    if tied:
        head.weight = embed.wte.weight
    return nn.Sequential(embed, *[Block() for _ in range(BLOCKS)], nn.LayerNorm(DIM), head)


def _worker(rank: int, rounds: int, warmup: int, port: int, out: str) -> None:
    from fastpipe.distributed_pipe import DistributedPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    pipes = {
        name: DistributedPipe(make_model(name == "tied"), BALANCE, chunks=CHUNKS, checkpoint="never", timeout=120)
        for name in ("tied", "untied")
    }
    assert pipes["tied"].ties and not pipes["untied"].ties
    g = torch.Generator().manual_seed(1)
    ids, y = (
        torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g),
        torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g),
    )
    grad = torch.randn(VOCAB, DIM)

    def step(name: str) -> None:
        pipe = pipes[name]
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(ids if pipe.is_first else None, y if pipe.is_last else None, TokenCE())

    def all_reduce() -> None:
        dist.all_reduce(grad.clone(), group=pipes["tied"].group)

    def timed(fn: object, *args: str) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn(*args)  # type: ignore[operator]
        dist.barrier()
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {"tied": [], "untied": [], "all_reduce": []}
    for r in range(warmup + rounds):
        order = ["tied", "untied"] if r % 2 == 0 else ["untied", "tied"]
        got = {name: timed(step, name) for name in order}
        got["all_reduce"] = timed(all_reduce)
        if r >= warmup:
            for name, t in got.items():
                times[name].append(t)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    for pipe in pipes.values():
        pipe.close()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        port = store.port  # a free port; released just before the ranks bind it
        del store
        mp.start_processes(_worker, args=(args.rounds, args.warmup, port, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            times = json.load(f)
    ratio = [t / u for t, u in zip(times["tied"], times["untied"])]
    share = [a / u for a, u in zip(times["all_reduce"], times["untied"])]
    result = {
        "model": f"vocab {VOCAB}, dim {DIM}, {BLOCKS} MLP blocks {DIM}/{HIDDEN}, batch {BATCH}x{TOKENS} tokens, "
        f"{CHUNKS} micro-batches, balance {BALANCE}, 1F1B, checkpoint never, 2 gloo ranks x 1 thread",
        "rounds": args.rounds,
        "median_ms": {name: 1e3 * statistics.median(ts) for name, ts in times.items()},
        "tied_over_untied": statistics.median(ratio),
        "tied_over_untied_quartiles": statistics.quantiles(ratio, n=4),
        "all_reduce_over_untied": statistics.median(share),
        "tied_weight_mib": VOCAB * DIM * 4 / 2**20,
    }
    json.dump(result, sys.stdout, indent=2)
    print()
    write_json(result, args.json)


if __name__ == "__main__":
    main()
