"""One pipeline stage per process, launched by ``torchrun``.

After ``pip install .``, from the clone's root: two processes on this host, each on a GPU of its own
if the host has one per process (NCCL), otherwise both on the CPU (gloo)::

    torchrun --nproc-per-node 2 examples/torchrun_pipeline.py

torchrun starts one copy of this script per process and tells each its place through the
environment: ``RANK`` (0 .. ``WORLD_SIZE`` - 1 over all hosts) and ``LOCAL_RANK`` (its index on
this host, which picks its GPU); ``fastpipe.init_distributed()`` reads them. Rank r holds stage
r of the model and releases the other layers, so every rank builds the same full model from the
same seed first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fastpipe import DistributedPipe, init_distributed


def build_model() -> nn.Sequential:
    """Eight blocks of a small MLP: two per stage with four ranks, four with two."""
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(8)])


def main(steps: int = 5) -> None:
    # The default process group from torchrun's environment: NCCL (with gloo beside it) when
    # this host has a GPU for every process, each rank on its own; otherwise gloo on the CPU.
    device = init_distributed()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the ranks share the host's cores
    rank, world = dist.get_rank(), dist.get_world_size()

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
