"""The ranks of ``fastpipe bench --only fsdp``: three 2 x 2 pipelines trained side by side in the same 4 processes.

Every rank builds, on one ``("pp", "dp")`` mesh (2 stages x 2 replicas), three methods over the
same model (:mod:`fastpipe.bench.workload`, seed 0), each with its own Adam:

* ``fastpipe replicate``: ``DistributedPipe(..., mesh=mesh)``, every replica holding whole stages;
* ``fastpipe fsdp``: ``DistributedPipe(..., mesh=mesh, dp_shard="fsdp")``;
* ``pipelining fsdp``: torchtitan's composition, a ``torch.distributed.pipelining``
  ``PipelineStage`` over a stage whose blocks and root are ``fully_shard``-ed over ``mesh["dp"]``
  (``reshard_after_forward=False``, torchtitan's choice under pipelining), run by ``Schedule1F1B``.

Each replica trains on its half of the global batch, under 1F1B with the same micro-batches. A
round runs one step (zero_grad, the schedule, ``optimizer.step()``) of every method, in an order
that rotates from round to round, each timed on rank 0 between two barriers, so a ratio of two
methods' steps of one round sees the same host load. Rank 0 then trains the model in one process
on the whole batch, for as many steps, to compare the losses.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from fastpipe.bench.ranks import init_rank
from fastpipe.bench.steps import LOSS
from fastpipe.bench.workload import BATCH, BLOCKS, CHUNKS, FFN, HIDDEN, make_batch, make_model

__all__ = ["LR", "METHODS", "MIN_ROUNDS", "PHASES", "SIZES", "Method", "rank_main"]

METHODS = ("fastpipe replicate", "fastpipe fsdp", "pipelining fsdp")
PP, DP = 2, 2
LR = 1e-3
_WORKLOAD = {"blocks": BLOCKS, "hidden": HIDDEN, "ffn": FFN, "batch": BATCH, "chunks": CHUNKS}
# tiny: toy sizes for tests (the times mean nothing); quick and full: the reference workload.
# "rounds" is the most; past the time given for rounds no more start once MIN_ROUNDS were timed.
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"blocks": 4, "hidden": 32, "ffn": 64, "batch": 32, "chunks": 4, "warmup": 1, "rounds": 4},
    "quick": {**_WORKLOAD, "warmup": 1, "rounds": 3},
    "full": {**_WORKLOAD, "warmup": 2, "rounds": 15},
}
MIN_ROUNDS = 3


@dataclass
class Method:
    """One method on this rank: a training step that returns this rank's loss (NaN where it has none),
    what the rank holds, the collectives of its last step among the replicas by kind (empty where
    they are not counted), what releases it, and per step the seconds of its phases (:data:`PHASES`;
    those a method cannot see inside are left out)."""

    step: Callable[[], float]
    held: Callable[[], dict[str, int]]
    close: Callable[[], None]
    collectives: Callable[[], dict[str, int]] = dict
    phases: list[dict[str, float]] = field(default_factory=list)


# The step's schedule (gathers and reductions included), then its parts among the replicas:
# fastpipe's ReplicaSync hooks, which the runtime calls at the step's start, after a stage's last
# backward and at the step's end; then the optimizer's step.
PHASES = ("schedule", "gather", "reduce launch", "reduce wait", "optimizer")
_HOOKS = {"begin": "gather", "stage_done": "reduce launch", "finish": "reduce wait"}


def _clock_replicas(sync: Any, spent: dict[str, float]) -> None:
    """Wrap the step hooks of ``sync`` (a ReplicaSync) on this instance so that each adds its seconds to ``spent``."""
    for hook, phase in _HOOKS.items():
        original = getattr(sync, hook)

        def timed(*args: Any, _original: Any = original, _phase: str = phase, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[_phase] += time.perf_counter() - t0

        setattr(sync, hook, timed)


def _fastpipe(dp_shard: str, mesh: Any, w: dict[str, int], x: torch.Tensor, y: torch.Tensor) -> Method:
    from fastpipe.distributed_pipe import DistributedPipe

    half = w["blocks"] // 2
    model = make_model(w["blocks"], hidden=w["hidden"], ffn=w["ffn"])
    pipe = DistributedPipe(
        model,
        [half, w["blocks"] - half],
        chunks=w["chunks"],
        schedule="1f1b",
        checkpoint="never",
        mesh=mesh,
        dp_shard=dp_shard,
        device=x.device,
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=LR)
    spent = dict.fromkeys(_HOOKS.values(), 0.0)
    _clock_replicas(pipe.runtime.replicas, spent)
    phases: list[dict[str, float]] = []

    def step() -> float:
        spent.update(dict.fromkeys(spent, 0.0))
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, LOSS)
        t1 = time.perf_counter()
        opt.step()
        phases.append({"schedule": t1 - t0, **spent, "optimizer": time.perf_counter() - t1})
        return float(loss)  # the global batch's loss, on every rank

    def collectives() -> dict[str, int]:
        return dict(getattr(pipe.runtime.replicas, "collectives", {}))

    return Method(step, lambda: pipe.state_bytes(opt), pipe.close, collectives, phases)


class _Counted:
    """A collective for FSDP2's ``set_custom_all_gather`` / ``set_custom_reduce_scatter``: the default
    allocation and ``torch.distributed`` call, each launch counted in ``counts``."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class _CountedAllGather(_Counted):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, async_op: bool = False
    ) -> Any:
        self.counts["all_gather"] += 1
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return gather(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountedReduceScatter(_Counted):
    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any, async_op: bool = False
    ) -> Any:
        self.counts["reduce_scatter"] += 1
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return scatter(output_tensor, input_tensor, group=group, op=op, async_op=async_op)


def _pipelining(mesh: Any, w: dict[str, int], x: torch.Tensor, y: torch.Tensor) -> Method:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from fastpipe.distributed.fsdp import state_bytes

    pp = mesh.get_local_rank("pp")
    half = w["blocks"] // 2
    blocks = list(make_model(w["blocks"], hidden=w["hidden"], ffn=w["ffn"]))
    part = nn.Sequential(*(blocks[:half] if pp == 0 else blocks[half:])).to(x.device)
    for block in part:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
    fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
    counts = {"all_gather": 0, "reduce_scatter": 0}
    for unit in [*part, part]:
        cast(FSDPModule, unit).set_custom_all_gather(cast(Any, _CountedAllGather(counts)))
        cast(FSDPModule, unit).set_custom_reduce_scatter(cast(Any, _CountedReduceScatter(counts)))
    stage = PipelineStage(part, stage_index=pp, num_stages=PP, device=x.device, group=mesh["pp"].get_group())
    sched = Schedule1F1B(stage, n_microbatches=w["chunks"], loss_fn=LOSS)
    opt = torch.optim.Adam(part.parameters(), lr=LR)
    phases: list[dict[str, float]] = []

    def step() -> float:
        counts.update(dict.fromkeys(counts, 0))
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        t0 = time.perf_counter()
        if pp == 0:
            sched.step(x)
        else:
            sched.step(target=y, losses=losses)
        t1 = time.perf_counter()
        opt.step()
        phases.append({"schedule": t1 - t0, "optimizer": time.perf_counter() - t1})
        # Equal micro-batches: the mean of theirs is this replica's loss (averaged over replicas on rank 0).
        return torch.stack(losses).mean().item() if losses else math.nan

    return Method(step, lambda: state_bytes(part.parameters(), opt), lambda: None, lambda: dict(counts), phases)


def _one_process(w: dict[str, int], x: torch.Tensor, y: torch.Tensor, steps: int) -> list[float]:
    """The losses of the model trained in one process on the whole batch, with the same Adam."""
    model = make_model(w["blocks"], hidden=w["hidden"], ffn=w["ffn"]).to(x.device)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = LOSS(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _build(name: str, mesh: Any, w: dict[str, int], x: torch.Tensor, y: torch.Tensor) -> Method:
    if name == "pipelining fsdp":
        return _pipelining(mesh, w, x, y)
    return _fastpipe(name.split()[1], mesh, w, x, y)


def _rounds(
    methods: dict[str, Method], w: dict[str, int], sync: Callable[[], None], rounds_by: float
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Step times on rank 0 (timed rounds only) and this rank's losses (every step), per method.

    No round past the first :data:`MIN_ROUNDS` timed ones starts after the wall-clock time
    ``rounds_by``; rank 0's clock decides for all, so the ranks agree.
    """
    names = list(methods)
    times: dict[str, list[float]] = {n: [] for n in names}
    losses: dict[str, list[float]] = {n: [] for n in names}
    for r in range(w["warmup"] + w["rounds"]):
        if r >= w["warmup"] + MIN_ROUNDS:
            go = [time.time() < rounds_by]
            dist.broadcast_object_list(go, src=0)
            if not go[0]:
                break
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(methods[name].step())
            sync()
            dist.barrier()
            if r >= w["warmup"]:
                times[name].append(time.perf_counter() - t0)
    return times, losses


def rank_main(rank: int, port: int, w: dict[str, int], out: str, rounds_by: float) -> None:
    """One of the 4 ranks (see the module doc); rank 0 writes the figures to ``out`` as JSON.

    Rounds stop starting at ``rounds_by`` (``time.time()``) once :data:`MIN_ROUNDS` were timed.

    With 4 or more GPUs each rank drives ``cuda:rank`` over NCCL, else the CPU over gloo with one
    intra-op thread. A method that fails to build on every rank alike (the same error) is left out
    with its error; one that fails during its steps fails the run.
    """
    from torch.distributed.device_mesh import init_device_mesh

    world = PP * DP
    cuda = torch.cuda.device_count() >= world
    device = init_rank(rank, world, port, cuda=cuda)
    mesh = init_device_mesh(device.type, (PP, DP), mesh_dim_names=("pp", "dp"))
    x, y = make_batch(w["batch"], hidden=w["hidden"])
    x, y = x.to(device), y.to(device)
    replica = mesh.get_local_rank("dp")
    share = w["batch"] // DP
    mine = slice(share * replica, share * (replica + 1))
    methods: dict[str, Method] = {}
    errors: dict[str, str] = {}
    for name in METHODS:
        try:
            methods[name] = _build(name, mesh, w, x[mine], y[mine])
        except Exception as exc:  # noqa: BLE001 - reported in the table instead of a number
            errors[name] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        dist.barrier()  # a rank whose build failed still takes part in the others'
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times, losses = _rounds(methods, w, sync, rounds_by)
    steps = len(next(iter(losses.values()), []))
    held = {n: m.held() for n, m in methods.items()}
    counted = {n: m.collectives() for n, m in methods.items()}
    phases = {n: m.phases[w["warmup"] :] for n, m in methods.items()}
    for m in methods.values():
        m.close()
    everyone: list[Any] = [None] * world
    dist.all_gather_object(
        everyone,
        {
            "losses": losses,
            "held": held,
            "collectives": counted,
            "phases": phases,
            "pp": mesh.get_local_rank("pp"),
            "dp": replica,
        },
    )
    if rank == 0:
        result = {
            "backend": "NCCL" if cuda else "gloo",
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "times": times,
            "ranks": everyone,
            "errors": errors,
            "rounds": steps - w["warmup"],
            "one_process": _one_process(w, x, y, steps),
        }
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
