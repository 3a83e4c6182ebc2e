"""Multi-process pipelines in spawned ranks: fastpipe's ``DistributedPipe`` and ``torch.distributed.pipelining``.

One rank per stage, as ``torchrun`` would start them: gloo with one thread per rank on CPU,
NCCL with one rank per GPU. Each step is timed between barriers on rank 0.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.bench.steps import LOSS, accumulation_step, free_port
from fastpipe.bench.workload import make_batch, make_model

__all__ = ["join_within", "spawn_ranks", "rank_main"]


def _split(model: nn.Sequential, rank: int, world: int) -> nn.Sequential:
    layers = list(model)
    base, extra = divmod(len(layers), world)
    sizes = [base + (1 if i < extra else 0) for i in range(world)]
    start = sum(sizes[:rank])
    return nn.Sequential(*layers[start : start + sizes[rank]])


def rank_main(
    rank: int, method: str, spec: dict[str, Any], schedule: str, warmup: int, steps: int, port: int, out: str
) -> None:
    """One rank: builds its stage, runs ``warmup + steps`` steps; rank 0 writes the step times."""
    import time

    world = len(spec["devices"])
    cuda = spec["devices"][0].startswith("cuda")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    model = make_model(spec["blocks"], hidden=spec["hidden"], ffn=spec["ffn"])
    x, y = make_batch(spec["batch"], hidden=spec["hidden"])
    x, y = x.to(device), y.to(device)
    first, last = rank == 0, rank == world - 1
    if method == "fastpipe":
        from fastpipe.distributed_pipe import DistributedPipe

        base, extra = divmod(len(model), world)
        balance = [base + (1 if i < extra else 0) for i in range(world)]
        pipe = DistributedPipe(
            model, balance, chunks=spec["chunks"], schedule=schedule, checkpoint="never", device=device
        )

        def step() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x if first else None, y if last else None, LOSS)
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        part = _split(model, rank, world).to(device)
        stage = PipelineStage(part, stage_index=rank, num_stages=world, device=device)
        sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(
            stage, n_microbatches=spec["chunks"], loss_fn=LOSS
        )

        def step() -> None:
            part.zero_grad(set_to_none=True)
            if first:
                sched.step(x)
            elif last:
                sched.step(target=y, losses=[])
            else:
                sched.step()

    # Paired limit: before every step rank 0 also times T_mb (one device, the same micro-batches
    # in sequence) while the other ranks wait, so each step has a baseline measured moments
    # before it, under the same load.
    acc_model = make_model(spec["blocks"], hidden=spec["hidden"], ffn=spec["ffn"]).to(device) if first else None
    times, t_mbs = [], []
    for i in range(warmup + steps):
        dist.barrier()
        if acc_model is not None:
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                accumulation_step(acc_model, x, y, spec["chunks"])()
            if cuda:
                torch.cuda.synchronize()
            t_mb = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
            step()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            if acc_model is not None:
                t_mbs.append(t_mb)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"steps": times, "t_mb": t_mbs}, f)
    if method == "fastpipe":
        pipe.close()
    dist.destroy_process_group()


def spawn_ranks(
    method: str, workload: Any, *, schedule: str, warmup: int, steps: int, timeout: float
) -> tuple[list[float], list[float]]:
    """Step times of ``method`` (``"fastpipe"`` or ``"pipelining"``) with one rank per device, and
    T_mb timed on rank 0 just before each step.

    Raises:
        RuntimeError: one GPU only (NCCL refuses two ranks on one GPU), a rank failed, or
            the ranks ran past ``timeout`` seconds.
    """
    import torch.multiprocessing as mp

    spec = workload.to_dict()
    if spec["devices"][0].startswith("cuda") and len(spec["devices"]) < 2:
        raise RuntimeError("skipped: one rank per GPU needs 2 or more GPUs (NCCL refuses two ranks on one GPU)")
    if method == "pipelining":
        try:
            import torch.distributed.pipelining  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"skipped: torch.distributed.pipelining is not available ({exc})") from exc
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        ctx = mp.start_processes(
            rank_main,
            args=(method, spec, schedule, warmup, steps, free_port(), out),
            nprocs=len(spec["devices"]),
            start_method="spawn",
            join=False,
        )
        join_within(ctx, timeout, f"{method} ranks")
        with open(out) as f:
            result = json.load(f)
        return [float(t) for t in result["steps"]], [float(t) for t in result["t_mb"]]


def join_within(ctx: Any, timeout: float, what: str) -> None:
    """Waits for the processes of a ``torch.multiprocessing`` context; stops them past ``timeout`` seconds.

    Raises:
        RuntimeError: they ran past ``timeout`` (or, from ``join``, one of them failed).
    """
    import time

    end = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise RuntimeError(f"{what} ran past {timeout:.0f} s and were stopped")
