"""What a skip across stages costs: straight to its consumer (stash/pop) against carried hop by hop.

The same U-Net (3 levels, 64x64 single-channel images or ``--size``, widths 16/32/64, batch 32,
4 micro-batches, 1F1B, ``checkpoint="never"``) is trained two ways, with the same weights:

* ``direct``: the encoder's maps are stashed (``fastpipe.stash``) and popped by the decoder;
  each goes straight from its producer's stage to its consumer's.
* ``carried``: the same layers, each wrapped so that the maps ride along as tuple items,
  through every stage between (what one writes without skips).

Alternating rounds, one step of each per round (which goes first alternates too), so drift
hits both alike; reported: the median step of each and the median of the per-round ratios
carried / direct.

* ``--mode local``: one process, 3 stages on CPU threads. Hand-offs between CPU stages are
  no copies, so ``--copy`` also sends every hand-off through the copy runtime, as between
  devices.
* ``--mode ranks``: 2 gloo ranks, 4 stages interleaved (stage s on rank s % 2), so the
  first level's map crosses ranks once straight, three times hop by hop.

Usage: ``python bench/skips.py --mode local|ranks [--copy] [--size 64] --rounds 15 [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import fastpipe  # noqa: E402
from fastpipe.bench.report import write_json  # noqa: E402
from fastpipe.model.skips import Stash, popped  # noqa: E402

BATCH, CHUNKS = 32, 4
SIZE = int(os.environ.get("SKIPS_BENCH_SIZE", "64"))  # image side; --size sets it (the ranks inherit it)
LOSS = nn.MSELoss()


def convs(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GELU(), nn.Conv2d(cout, cout, 3, padding=1), nn.GELU())


class Up(nn.Module):
    def __init__(self, cin: int, cout: int, skip: str) -> None:
        super().__init__()
        self.skip = skip
        self.fastpipe_pops = (skip,)
        self.up = nn.ConvTranspose2d(cin, cout, 2, stride=2)
        self.convs = convs(2 * cout, cout)

    def forward(self, x: Tensor, **skips: Tensor) -> Tensor:
        return self.convs(torch.cat([self.up(x), skips[self.skip]], dim=1))


def unet() -> fastpipe.Sequential:
    """12 layers: [conv, stash e1, down, stash e2, down, stash e3, down, up e3, up e2, up e1, head, flatten]."""
    torch.manual_seed(0)
    return fastpipe.Sequential(
        convs(1, 16),
        fastpipe.stash("e1"),
        nn.Sequential(nn.MaxPool2d(2), convs(16, 32)),
        fastpipe.stash("e2"),
        nn.Sequential(nn.MaxPool2d(2), convs(32, 64)),
        fastpipe.stash("e3"),
        nn.Sequential(nn.MaxPool2d(2), convs(64, 64)),
        Up(64, 64, "e3"),
        Up(64, 32, "e2"),
        Up(32, 16, "e1"),
        nn.Conv2d(16, 1, 1),
        nn.Flatten(1),
    )


class Carried(nn.Module):
    """One layer of the hop-by-hop variant: its value is ``(x, *maps)``, the maps stashed so far.

    Args:
        layer: the layer (a stash becomes None: this wrapper appends its input).
        before: the names carried into this layer, in order.
        pops: the names the layer takes (a plain layer's own declaration is removed).
    """

    def __init__(self, layer: nn.Module | None, before: list[str], pops: tuple[str, ...]) -> None:
        super().__init__()
        self.layer = layer
        self.before = list(before)
        self.pops = pops

    def forward(self, value: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        value = (value,) if isinstance(value, Tensor) else value  # the model's input
        x, maps = value[0], dict(zip(self.before, value[1:]))
        if self.layer is None:
            return (x, *maps.values(), x)
        if self.pops:
            out = self.layer(x, **{n: maps.pop(n) for n in self.pops})
            return (out, *maps.values())
        return (self.layer(x), *maps.values())


def carried(model: nn.Sequential) -> nn.Sequential:
    """The same layers (the same parameters), with the skips carried as tuple items."""
    stashed: list[str] = []
    layers: list[nn.Module] = []
    for layer in model:
        names = popped(layer)
        if names:
            del layer.fastpipe_pops  # the wrapper hands them over now
        layers.append(Carried(None if isinstance(layer, Stash) else layer, stashed, names))
        if isinstance(layer, Stash):
            stashed.append(layer.name)
        for n in names:
            stashed.remove(n)
    layers.append(_First())
    return nn.Sequential(*layers)


class _First(nn.Module):
    def forward(self, value: tuple[Tensor, ...]) -> Tensor:
        return value[0]


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 1, SIZE, SIZE, generator=g), torch.randn(BATCH, SIZE * SIZE, generator=g)


def _paired(steps: dict[str, Any], rounds: int, sync: Any = None) -> dict[str, Any]:
    times: dict[str, list[float]] = {k: [] for k in steps}
    losses: dict[str, float] = {}
    for i in range(rounds + 2):
        order = list(steps) if i % 2 == 0 else list(reversed(steps))  # neither always goes first
        for name in order:
            step = steps[name]
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            losses[name] = float(step())
            if sync is not None:
                sync()
            if i >= 2:  # warm-up
                times[name].append(time.perf_counter() - t0)
    ratios = [c / d for c, d in zip(times["carried"], times["direct"])]
    return {
        "direct_s": statistics.median(times["direct"]),
        "carried_s": statistics.median(times["carried"]),
        "paired_ratio": statistics.median(ratios),
        "losses": losses,
    }


def local(rounds: int, copy: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    x, y = batch()
    direct = unet()
    # Balance: stage 0 stashes e1, stage 1 e2 and e3, stage 2 decodes: e1 skips over stage 1.
    pipes = {
        "direct": fastpipe.Pipe(direct, [2, 5, 5], devices=["cpu"] * 3, chunks=CHUNKS, checkpoint="never"),
        "carried": fastpipe.Pipe(carried(unet()), [2, 5, 6], devices=["cpu"] * 3, chunks=CHUNKS, checkpoint="never"),
    }
    for pipe in pipes.values():
        pipe.runtime.copy_same_device = copy

    def step(pipe: fastpipe.Pipe) -> Any:
        pipe.zero_grad(set_to_none=True)
        return pipe.train_step(x, y, LOSS)

    return _paired({k: (lambda p=p: step(p)) for k, p in pipes.items()}, rounds)


def _rank(rank: int, rounds: int, port: int, out: str) -> None:
    from fastpipe.runtime.host_alloc import tune_host_allocator

    tune_host_allocator()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x, y = batch()
    kw: dict[str, Any] = {"chunks": CHUNKS, "schedule": "interleaved", "checkpoint": "never"}
    pipes = {
        "direct": fastpipe.DistributedPipe(unet(), [2, 3, 3, 4], **kw),
        "carried": fastpipe.DistributedPipe(carried(unet()), [2, 3, 3, 5], **kw),
    }

    def step(pipe: fastpipe.DistributedPipe) -> Any:
        pipe.zero_grad(set_to_none=True)
        return pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, LOSS)

    result = _paired({k: (lambda p=p: step(p)) for k, p in pipes.items()}, rounds, dist.barrier)
    for pipe in pipes.values():
        pipe.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def ranks(rounds: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        port = store.port  # a free port; released just before the ranks bind it
        del store
        mp.start_processes(_rank, args=(rounds, port, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            result: dict[str, Any] = json.load(f)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["local", "ranks"], default="local")
    parser.add_argument("--copy", action="store_true", help="local: every hand-off through the copy runtime")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--size", type=int, default=64, help="image side (8: per-step overheads dominate)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    global SIZE
    SIZE = args.size
    os.environ["SKIPS_BENCH_SIZE"] = str(args.size)
    result = local(args.rounds, args.copy) if args.mode == "local" else ranks(args.rounds)
    result["mode"] = args.mode + (" (copies)" if args.copy else "")
    result["size"] = SIZE
    print(f"{result['mode']}: median of {args.rounds} alternating rounds, U-Net {SIZE}x{SIZE} batch {BATCH}, ", end="")
    print(f"{CHUNKS} micro-batches")
    print(f"direct {result['direct_s'] * 1e3:.1f} ms, carried {result['carried_s'] * 1e3:.1f} ms, ", end="")
    print(f"carried/direct (paired) {result['paired_ratio']:.3f}; last losses {result['losses']}")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
