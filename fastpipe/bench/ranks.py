"""Multi-process pipelines in spawned ranks: fastpipe's ``DistributedPipe`` and ``torch.distributed.pipelining``.

One rank per stage, as ``torchrun`` would start them: gloo with one thread per rank on CPU,
NCCL with one rank per GPU. Each step is timed between barriers on rank 0.

Starting ranks costs more than a small workload's steps, so two things keep it cheap:

* ranks are forked from a fork server (:func:`start_ranks`) that imported torch,
  ``torch.distributed.pipelining`` and fastpipe once; a fresh interpreter per rank would import
  them again each time, seconds per rank on a 2-core host;
* every run of one :func:`spawn_runs` call goes through the same ranks, one run after the other.

The fork server keeps the environment of the moment it started (the first ranks of the process).
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.bench.steps import LOSS, accumulation_step, free_port
from fastpipe.bench.workload import make_batch, make_model

__all__ = [
    "Run",
    "RankRuns",
    "RanksTimedOut",
    "init_rank",
    "join_within",
    "rank_main",
    "spawn_ranks",
    "spawn_runs",
    "start_ranks",
    "warm_fork_server",
]

Run = tuple[str, str]
"""``(method, schedule)``: method ``"fastpipe"`` or ``"pipelining"``, schedule ``"1f1b"`` or ``"gpipe"``."""


@dataclass
class RankRuns:
    """What one set of spawned ranks measured.

    Attributes:
        times: per finished run, its step times and the T_mb timed on rank 0 just before each step.
        missing: per run without times, why (skipped, not available, or the ranks' error).
    """

    times: dict[Run, tuple[list[float], list[float]]] = field(default_factory=dict)
    missing: dict[Run, str] = field(default_factory=dict)


# What the fork server imports once for every rank it forks (an import that fails is skipped).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.pipelining",
    "fastpipe.bench.ranks",
    "fastpipe.bench.zero_bubble",
]


def warm_fork_server() -> None:
    """Start the fork server now, so that its imports run while this process does other work."""
    import multiprocessing
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(_PRELOAD)
    multiprocessing.forkserver.ensure_running()


def start_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> Any:
    """``fn(rank, *args)`` in ``nprocs`` new processes, forked from a server that preloaded torch and fastpipe.

    The same as ``torch.multiprocessing.start_processes(..., start_method="forkserver", join=False)``;
    the fork server (one per process, started on first use) has not initialised CUDA, so the
    ranks may use it.
    """
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(_PRELOAD)  # read when the server starts, ignored after
    return mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver", join=False)


def init_rank(rank: int, world: int, port: int, *, cuda: bool) -> torch.device:
    """Join this process to the ranks' default process group, as rank ``rank`` of ``world``.

    Args:
        rank: this process's rank.
        world: how many ranks there are.
        port: the port on 127.0.0.1 where rank 0 hosts the group's store.
        cuda: NCCL with ``cuda:rank`` for this rank; else gloo on the CPU.

    Returns:
        The device this rank computes on.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cuda:
        torch.cuda.set_device(rank)
    else:
        # One intra-op thread per rank, as torchrun's ranks get: more would oversubscribe the cores.
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def _sizes(layers: int, world: int) -> list[int]:
    base, extra = divmod(layers, world)
    return [base + (1 if i < extra else 0) for i in range(world)]


Step = Callable[[], None]


def _build(method: str, schedule: str, spec: dict[str, Any], rank: int, device: torch.device) -> tuple[Step, Step]:
    """One training step of ``method`` on this rank's stage of a fresh model, and what releases its threads."""
    world = len(spec["devices"])
    model = make_model(spec["blocks"], hidden=spec["hidden"], ffn=spec["ffn"])
    x, y = make_batch(spec["batch"], hidden=spec["hidden"])
    x, y = x.to(device), y.to(device)
    first, last = rank == 0, rank == world - 1
    balance = _sizes(len(model), world)
    if method == "fastpipe":
        from fastpipe.distributed_pipe import DistributedPipe

        pipe = DistributedPipe(
            model, balance, chunks=spec["chunks"], schedule=schedule, checkpoint="never", device=device
        )

        def fastpipe_step() -> None:
            pipe.zero_grad(set_to_none=True)
            pipe.train_step(x if first else None, y if last else None, LOSS)

        return fastpipe_step, pipe.close

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    start = sum(balance[:rank])
    part = nn.Sequential(*list(model)[start : start + balance[rank]]).to(device)
    stage = PipelineStage(part, stage_index=rank, num_stages=world, device=device)
    sched = (Schedule1F1B if schedule == "1f1b" else ScheduleGPipe)(stage, n_microbatches=spec["chunks"], loss_fn=LOSS)

    def pipelining_step() -> None:
        part.zero_grad(set_to_none=True)
        if first:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=[])
        else:
            sched.step()

    return pipelining_step, lambda: None


def _timed(step: Step, spec: dict[str, Any], rank: int, warmup: int, steps: int) -> dict[str, Any]:
    """Step times and, on rank 0, T_mb timed before each step while the other ranks wait.

    Pairing every step with a baseline measured moments before it, under the same load, keeps
    the host's drift between phases out of the ratio.
    """
    cuda = spec["devices"][0].startswith("cuda")
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    acc = None
    if rank == 0:
        model = make_model(spec["blocks"], hidden=spec["hidden"], ffn=spec["ffn"]).to(device)
        x, y = make_batch(spec["batch"], hidden=spec["hidden"])
        acc = accumulation_step(model, x.to(device), y.to(device), spec["chunks"])
    times, t_mbs = [], []
    t_mb = 0.0
    for i in range(warmup + steps):
        dist.barrier()
        if acc is not None:
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                acc()
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
            if acc is not None:
                t_mbs.append(t_mb)
    return {"steps": times, "t_mb": t_mbs}


def rank_main(
    rank: int,
    runs: list[Run],
    spec: dict[str, Any],
    warmup: int,
    steps: int,
    port: int,
    out: str,
    start_by: float,
) -> None:
    """One rank: each run in turn, ``warmup + steps`` steps; rank 0 writes the times after every run.

    No run starts after the wall-clock time ``start_by`` (``time.time()``); rank 0's clock decides
    for all, so the ranks always agree on which runs they take part in.
    """
    world = len(spec["devices"])
    cuda = spec["devices"][0].startswith("cuda")
    device = init_rank(rank, world, port, cuda=cuda)
    done: dict[str, Any] = {}
    for method, schedule in runs:
        go = [time.time() < start_by]
        dist.broadcast_object_list(go, src=0)
        if not go[0]:
            break
        step, close = _build(method, schedule, spec, rank, device)
        result = _timed(step, spec, rank, warmup, steps)
        close()
        if rank == 0:
            done[f"{method} {schedule}"] = result
            with open(out + ".tmp", "w") as f:
                json.dump(done, f)
            os.replace(out + ".tmp", out)  # a rank that dies later leaves the finished runs readable
    dist.destroy_process_group()


def spawn_runs(
    runs: Sequence[Run], workload: Any, *, warmup: int, steps: int, timeout: float, reserve: float = 0.0
) -> RankRuns:
    """Step times of each ``(method, schedule)`` in ``runs``, one set of spawned ranks for them all.

    Args:
        runs: what to time, in order.
        workload: a :class:`fastpipe.bench.scaling.Workload` (one rank per device).
        warmup, steps: untimed and timed steps per run.
        timeout: seconds before the ranks are stopped; the runs finished by then are kept.
        reserve: no run starts later than ``timeout - reserve`` seconds from now.
    """
    spec = workload.to_dict()
    result = RankRuns()
    if spec["devices"][0].startswith("cuda") and len(spec["devices"]) < 2:
        result.missing = {
            r: "skipped: one rank per GPU needs 2 or more GPUs (NCCL refuses two ranks on one GPU)" for r in runs
        }
        return result
    todo = list(runs)
    # find_spec, not an import: importing pipelining takes seconds, and only the ranks need it.
    if (
        any(method == "pipelining" for method, _ in todo)
        and importlib.util.find_spec("torch.distributed.pipelining") is None
    ):
        for r in [r for r in todo if r[0] == "pipelining"]:
            result.missing[r] = "skipped: torch.distributed.pipelining is not available in this torch"
            todo.remove(r)
    if not todo:
        return result
    error = "skipped, time budget spent"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        start_by = time.time() + timeout - reserve
        ctx = start_ranks(rank_main, (todo, spec, warmup, steps, free_port(), out, start_by), len(spec["devices"]))
        try:
            join_within(ctx, timeout, "the ranks")
        except RanksTimedOut as exc:
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - the runs that finished still count
            # A rank's error arrives with its whole traceback; its last line names the cause.
            lines = [line for line in str(exc).splitlines() if line.strip()]
            error = f"the ranks failed: {lines[-1] if lines else type(exc).__name__}"
        finished: dict[str, Any] = {}
        if os.path.exists(out):
            with open(out) as f:
                finished = json.load(f)
    for method, schedule in todo:
        times = finished.get(f"{method} {schedule}")
        if times is None:
            result.missing[(method, schedule)] = error
        else:
            result.times[(method, schedule)] = ([float(t) for t in times["steps"]], [float(t) for t in times["t_mb"]])
    return result


def spawn_ranks(
    method: str, workload: Any, *, schedule: str, warmup: int, steps: int, timeout: float
) -> tuple[list[float], list[float]]:
    """Step times of one ``(method, schedule)`` with one rank per device, and T_mb timed on rank 0
    just before each step.

    Raises:
        RuntimeError: one GPU only (NCCL refuses two ranks on one GPU), a rank failed, or
            the ranks ran past ``timeout`` seconds.
    """
    result = spawn_runs([(method, schedule)], workload, warmup=warmup, steps=steps, timeout=timeout)
    if (method, schedule) not in result.times:
        raise RuntimeError(result.missing[(method, schedule)])
    return result.times[(method, schedule)]


class RanksTimedOut(RuntimeError):
    """Spawned ranks ran past their time and were stopped."""


def join_within(ctx: Any, timeout: float, what: str) -> None:
    """Waits for the processes of a ``torch.multiprocessing`` context; stops them past ``timeout`` seconds.

    Raises:
        RanksTimedOut: they ran past ``timeout``.
        torch.multiprocessing.ProcessRaisedException: one of them failed (from ``join``).
    """
    end = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > end:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            raise RanksTimedOut(f"{what} ran past {timeout:.0f} s and were stopped")
