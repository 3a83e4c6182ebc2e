"""The order-matched transport (NCCL's) keeps no payload memory between steps."""

from __future__ import annotations

import torch
from _dist_utils import check_ok, run_ranks
from torch import Tensor, nn

HIDDEN = 16


def _held_bytes(obj: object) -> int:
    """Bytes of the tensors ``obj``'s attributes hold (through dicts, lists and tuples), headers aside."""
    total, seen = 0, set()
    todo = [v for k, v in vars(obj).items() if k != "_headers"]
    while todo:
        v = todo.pop()
        if isinstance(v, Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            todo += list(v.values())
        elif isinstance(v, (list, tuple)):
            todo += list(v)
    return total


def _steps(rank: int, world: int) -> list[int]:
    from fastpipe.distributed_pipe import DistributedPipe

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(4)])
    # p2p="ordered": the transport NCCL groups use, here on gloo.
    pipe = DistributedPipe(model, [2, 2], chunks=4, schedule="1f1b", timeout=20, p2p="ordered")
    held = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
        pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        held.append(_held_bytes(pipe.runtime.transport))  # type: ignore[attr-defined]
    pipe.close()
    return held


def test_no_receive_buffer_outlives_its_step() -> None:
    # Each rank receives 4 micro-batches' activations or gradients per step (2 x 16 fp32
    # each); kept per micro-batch, they would stay on the GPU for good.
    for rank, held in enumerate(check_ok(run_ranks(_steps, 2, timeout=60))):
        assert held == [0, 0], f"rank {rank} keeps {held} bytes of payload after each step"
