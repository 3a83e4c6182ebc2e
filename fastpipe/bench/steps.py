"""One training step of each method the benchmarks compare, as a callable, and their timing loops.

Shared by ``fastpipe bench`` and the scripts in ``bench/`` (which import it from here).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from fastpipe.bench.workload import CHUNKS, make_batch, make_model

__all__ = [
    "LOSS",
    "plain_step",
    "accumulation_step",
    "pipe_step",
    "train_step",
    "timed_rounds",
    "pippy_worker",
    "pippy_times",
    "free_port",
]

LOSS = nn.MSELoss()


def plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, threads: int) -> Callable[[], None]:
    """Full-batch forward and backward with ``threads`` intra-op threads."""

    def step() -> None:
        torch.set_num_threads(threads)
        model.zero_grad(set_to_none=True)
        LOSS(model(x), y).backward()
        torch.set_num_threads(1)

    return step


def accumulation_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks: int) -> Callable[[], None]:
    """The same micro-batches one after another on one device (gradient accumulation): T_mb."""
    xs, ys = x.chunk(chunks), y.chunk(chunks)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        for xc, yc in zip(xs, ys):
            (LOSS(model(xc), yc) * (xc.size(0) / x.size(0))).backward()

    return step


def pipe_step(pipe: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    """``pipe(x)`` then ``loss.backward()`` (torchgpipe's contract; GPipe for fastpipe)."""

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        LOSS(pipe(x), y).backward()

    return step


def train_step(pipe: nn.Module, x: torch.Tensor, y: torch.Tensor, schedule: str) -> Callable[[], None]:
    """``Pipe.train_step`` under ``schedule``."""

    def step() -> None:
        pipe.zero_grad(set_to_none=True)
        pipe.train_step(x, y, LOSS, schedule=schedule)  # type: ignore[operator]

    return step


def timed_rounds(rank: int, step: Callable[[], None], warmup: int, steps: int, out: str, paired: bool = False) -> None:
    """Time ``step`` between barriers on every rank; rank 0 writes ``{"steps", "t_mb"}`` to ``out``.

    With ``paired``, rank 0 also times T_mb (the 1-thread gradient accumulation) before each
    step while the other ranks wait, so every step has a limit measured moments before it:
    this VM's drift between separately timed phases is larger than the gaps measured.
    """
    import torch.distributed as dist

    if paired:
        # T_mb under the same allocator settings everywhere: fastpipe's ranks have them, and
        # torch.distributed.pipelining's ranks get them too rather than a limit inflated by
        # page faults (see fastpipe.runtime.host_alloc).
        from fastpipe.runtime.host_alloc import tune_host_allocator

        tune_host_allocator()
    t_mb_step = accumulation_step(make_model(), *make_batch(), CHUNKS) if paired and rank == 0 else None
    times, t_mbs = [], []
    t_mb = 0.0
    for i in range(warmup + steps):
        dist.barrier()
        if t_mb_step is not None:
            t0 = time.perf_counter()
            t_mb_step()
            t_mb = time.perf_counter() - t0
            dist.barrier()
        elif paired:
            dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            if t_mb_step is not None:
                t_mbs.append(t_mb)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": times, "t_mb": t_mbs}, f)


def pippy_worker(
    rank: int, schedule_name: str, warmup: int, steps: int, port: int, out: str, paired: bool = False
) -> None:
    """One gloo rank of ``torch.distributed.pipelining`` on the reference workload, split in two halves."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = make_model()
    x, y = make_batch()
    half = len(model) // 2
    part = nn.Sequential(*list(model)[:half]) if rank == 0 else nn.Sequential(*list(model)[half:])
    stage = PipelineStage(part, stage_index=rank, num_stages=2, device=torch.device("cpu"))
    cls = Schedule1F1B if schedule_name == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=CHUNKS, loss_fn=LOSS)

    def step() -> None:
        part.zero_grad(set_to_none=True)
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=[])

    timed_rounds(rank, step, warmup, steps, out, paired)
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free now (released just before the ranks bind it)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    port = int(store.port)
    del store
    return port


def pippy_times(schedule_name: str, warmup: int, steps: int) -> list[float]:
    """Step times of torch.distributed.pipelining with 2 gloo ranks (1 thread each)."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(
            pippy_worker, args=(schedule_name, warmup, steps, free_port(), out), nprocs=2, start_method="spawn"
        )
        with open(out) as f:
            return list(json.load(f)["steps"])
