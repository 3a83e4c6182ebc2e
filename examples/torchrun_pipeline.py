"""One pipeline stage per process, launched by ``torchrun``.

After ``pip install .``, from the clone's root: two processes on this host, each on a GPU of its own
if the host has one per process (NCCL), otherwise both on the CPU (gloo)::

    torchrun --nproc-per-node 2 examples/torchrun_pipeline.py

torchrun starts one copy of this script per process and tells each its place through the
environment: ``RANK`` (0 .. ``WORLD_SIZE`` - 1 over all hosts) and ``LOCAL_RANK`` (its index on
this host, which picks its GPU). Rank r holds stage r of the model and releases the other
layers, so every rank builds the same full model from the same seed first.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import DistributedPipe


def build_model() -> nn.Sequential:
    """Eight blocks of a small MLP: two per stage with four ranks, four with two."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])


def main(steps: int = 5) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        # A GPU for every process on this host. First, before any NCCL call: each rank on its own GPU.
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(1)  # the ranks share the host's cores
    dist.init_process_group(backend)  # reads MASTER_ADDR/PORT, RANK and WORLD_SIZE from torchrun

    torch.manual_seed(0)  # the same full model on every rank; each keeps only its stage
    model = build_model()
    balance = [len(model) // world] * world  # layers per stage, one stage per rank
    pipe = DistributedPipe(model, balance, chunks=4, schedule="1f1b", device=device)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)  # this rank's parameters only
    loss_fn = nn.MSELoss()

    data = torch.Generator().manual_seed(1)  # the same batch on every rank
    x, y = torch.randn(16, 32, generator=data).to(device), torch.randn(16, 32, generator=data).to(device)
    for step in range(steps):
        opt.zero_grad()
        # Every rank calls train_step: the first stage reads x, the last reads y (others may pass None).
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, loss_fn)
        opt.step()
        if rank == 0:  # the loss is the same on every rank
            print(f"step {step}: loss {loss.item():.6f}", flush=True)

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
