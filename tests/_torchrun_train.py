"""The README's torchrun example as a script; rank 0 writes its losses and a one-process reference.

Run: ``torchrun --standalone --nproc-per-node 2 tests/_torchrun_train.py OUT.json``
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import DistributedPipe


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)])


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)) for _ in range(3)]


def main(out: str) -> None:
    dist.init_process_group()  # torchrun's environment; gloo on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    pipe = DistributedPipe(
        model(), balance=[4 // world] * world, chunks=4, schedule="1f1b", process_group=dist.group.WORLD
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    losses = []
    for x, y in batches():
        opt.zero_grad()
        loss = pipe.train_step(x if rank == 0 else None, y if rank == world - 1 else None, nn.MSELoss())
        opt.step()
        losses.append(loss.item())
    if rank == 0:
        plain = model()
        popt = torch.optim.SGD(plain.parameters(), lr=0.1)
        expected = []
        for x, y in batches():
            popt.zero_grad()
            loss = nn.functional.mse_loss(plain(x), y)
            loss.backward()
            popt.step()
            expected.append(loss.item())
        with open(out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "expected": expected,
                    "world": world,
                    "transport": type(pipe.runtime.transport).__name__,
                },
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
