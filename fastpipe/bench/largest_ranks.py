"""The rank side of the largest-model benchmark: the GPT family, each system's step, and its measured peak.

Every rank is one device. On CPU a rank is one process with one intra-op thread, and the
process's CPU bytes are that device's bytes, counted exactly by
:mod:`fastpipe.memory._cpu_counter` (every thread: fastpipe's stage workers, autograd's engine,
gloo's transport). A rank measures a candidate size as::

    base = bytes alive before the model is built
    build the stage(s) this rank holds, their Adam, the batch
    step 1 (forward, backward, Adam) under a PeakMeter  ──▶  peak 1 = peak_total - base
    every rank's peak 1 gathered: any over the budget ──▶ stop (the size does not fit)
    step 2 likewise, timed between barriers       ──▶  peak 2, the step time
    peak = max(peak 1, peak 2)                        (step 2 holds Adam's moments throughout)

A system with ``optimizer="host"`` steps Adam under :class:`~fastpipe.memory.host_optimizer.HostOptimizer`:
the counter books its host copies, their gradients and Adam's moments to the host, not the rank's device.

Everything a rank decides comes from gathered values, so all ranks take the same path.
"""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fastpipe.bench.largest_model import TokenLoss, build_layer, layer_count, stage_layers
from fastpipe.bench.largest_search import Point, best_of
from fastpipe.memory import _cpu_counter
from fastpipe.memory.accounting import PeakMeter
from fastpipe.memory.host_optimizer import HostOptimizer

__all__ = ["measure", "rank_main", "shape_at", "stage_layers"]


def _batch(shape: dict[str, Any]) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(shape["vocab"], (shape["batch"], shape["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _sequential(indices: range, shape: dict[str, Any], per_block: bool) -> nn.Sequential:
    return nn.Sequential(*[build_layer(i, shape, per_block) for i in indices])


_NO_LIMIT = 1 << 60
Step = Callable[[], None]
Built = tuple[Step, Step, Callable[[], int | None]]  # the step, its close, this rank's predicted peak


def _unpredicted() -> int | None:
    return None


def _adam(params: Any, system: dict[str, Any]) -> torch.optim.Optimizer:
    # foreach=False: the same per-parameter temporaries on every system and device.
    if system.get("optimizer", "device") == "host":
        return HostOptimizer(torch.optim.Adam, params, lr=1e-4, foreach=False)
    return torch.optim.Adam(params, lr=1e-4, foreach=False)


def _plain(system: dict[str, Any], shape: dict[str, Any]) -> Built:
    model = _sequential(range(layer_count(shape["layers"])), shape, system["checkpoint"] == "blocks")
    opt = _adam(model.parameters(), system)
    ids, target = _batch(shape)
    loss = TokenLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(ids), target).backward()
        opt.step()

    return step, lambda: None, _unpredicted


def _v_stages(rank: int, world: int) -> tuple[int, int]:
    return rank, 2 * world - 1 - rank


def _pipelining(system: dict[str, Any], shape: dict[str, Any], rank: int, world: int) -> Built:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    v = system["schedule"] == "ZBVZeroBubble"
    count = 2 * world if v else world
    balance = stage_layers(shape["layers"], count)
    held = _v_stages(rank, world) if v else (rank,)
    per_block = system["checkpoint"] == "blocks"
    parts = [_sequential(range(sum(balance[:s]), sum(balance[: s + 1])), shape, per_block) for s in held]
    stages: list[Any] = [
        PipelineStage(p, stage_index=s, num_stages=count, device=torch.device("cpu")) for p, s in zip(parts, held)
    ]
    loss = TokenLoss()
    chunks = shape["chunks"]
    sched = ScheduleZBVZeroBubble(stages, chunks, loss_fn=loss) if v else Schedule1F1B(stages[0], chunks, loss_fn=loss)
    opt = _adam([p for part in parts for p in part.parameters()], system)
    ids, target = _batch(shape)
    first, last = 0 in held, count - 1 in held

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if first and last:
            sched.step(ids, target=target, losses=[])
        elif first:
            sched.step(ids)
        elif last:
            sched.step(target=target, losses=[])
        else:
            sched.step()
        opt.step()

    return step, lambda: None, _unpredicted


class Refused(Exception):
    """A system refused a size before any step: it predicted that nothing fits the budget."""


def _planned(system: dict[str, Any], shape: dict[str, Any], budget: int) -> Any:
    """fastpipe's planner on the whole model (every rank builds it; each keeps its stages).

    Raises:
        Refused: the planner found nothing whose prediction fits the budget (on every rank alike).
    """
    from fastpipe.balance.planner import BalanceError
    from fastpipe.distributed_pipe import DistributedPipe

    model = _sequential(range(layer_count(shape["layers"])), shape, False)
    ids, _ = _batch(shape)
    state = "host" if system.get("optimizer", "device") == "host" else "adam"
    try:
        return DistributedPipe(model, "auto", chunks=shape["chunks"], schedule=system["schedule"], checkpoint="auto",
                               memory_limit=budget, sample=ids, optimizer_state=state, device="cpu")  # fmt: skip
    except (ValueError, BalanceError) as exc:
        raise Refused(str(exc).splitlines()[0]) from exc


def _fastpipe(system: dict[str, Any], shape: dict[str, Any], rank: int, world: int, budget: int) -> Built:
    from fastpipe.distributed_pipe import DistributedPipe

    if system["checkpoint"] == "auto":
        return _stepped(_planned(system, shape, budget), system, shape)
    v = system["schedule"] in ("zb-v", "dualpipev")
    balance = stage_layers(shape["layers"], 2 * world if v else world)
    # "blocks": each block under torch.utils.checkpoint; "always+blocks": fastpipe's stage recompute over them.
    mode, _, blocks = system["checkpoint"].partition("+")
    per_block = mode == "blocks" or blocks == "blocks"
    mode = "never" if mode == "blocks" else mode

    def builder(s: int) -> nn.Sequential:
        return _sequential(range(sum(balance[:s]), sum(balance[: s + 1])), shape, per_block)

    # A limit no step reaches: the pipe predicts every device's peak at its first step and refuses nothing.
    pipe = DistributedPipe.from_stage_builder(
        builder,
        balance,
        chunks=shape["chunks"],
        schedule=system["schedule"],
        checkpoint=mode,
        device="cpu",
        memory_limit=_NO_LIMIT,
    )
    return _stepped(pipe, system, shape)


def _stepped(pipe: Any, system: dict[str, Any], shape: dict[str, Any]) -> Built:
    """A DistributedPipe's training step with Adam, its close, and this rank's predicted peak."""
    opt = _adam(pipe.parameters(), system)
    cast(Any, pipe.memory_guard).optimizer = opt  # the model counts the state where it is
    ids, target = _batch(shape)
    loss = TokenLoss()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        pipe.train_step(ids if pipe.is_first else None, target if pipe.is_last else None, loss)
        opt.step()

    def predicted() -> int | None:
        guard = pipe.memory_guard
        mine = [d.total for d in (guard.last if guard is not None else []) if d.worker == pipe.runtime.rank]
        return mine[0] if mine else None

    return step, pipe.close, predicted


def _build(system: dict[str, Any], shape: dict[str, Any], rank: int, world: int, budget: int = _NO_LIMIT) -> Built:
    if system["kind"] == "plain":
        return _plain(system, shape)
    if system["kind"] == "pipelining":
        return _pipelining(system, shape, rank, world)
    if system["kind"] == "fastpipe":
        return _fastpipe(system, shape, rank, world, budget)
    raise ValueError(f"unknown system kind {system['kind']!r}: plain, pipelining or fastpipe")


def _gathered(value: float, world: int) -> list[float]:
    if world == 1:
        return [value]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, value)
    return [float(v) for v in out]


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def shape_at(job: dict[str, Any], n: int) -> dict[str, Any]:
    """The model shape of size ``n`` along the job's searched dimension (blocks, or width in units)."""
    shape = dict(job["shape"])
    if job["dim"] == "layers":
        shape["layers"] = n
    else:
        shape["width"] = n * job["width_unit"]
    return shape


def measure(job: dict[str, Any], system: dict[str, Any], n: int, rank: int, world: int) -> Point:
    """Every rank's peak bytes of a training step at size ``n``, and the step's time (see the module doc)."""
    gc.collect()
    base = _cpu_counter.allocated()
    budget = job["budget"]
    try:
        step, close, predicted = _build(system, shape_at(job, n), rank, world, budget)
    except Refused as exc:  # raised on every rank alike
        gc.collect()
        return Point(n, [], None, None, refused=str(exc))
    peaks = [0] * world
    seconds = None
    forecast: list[int] | None = None
    try:
        for i in range(2):
            _barrier(world)
            t0 = time.perf_counter()
            with PeakMeter("cpu") as meter:
                step()
            _barrier(world)
            took = time.perf_counter() - t0
            here = _gathered(meter.result.peak_total - base, world)
            peaks = [max(a, int(b)) for a, b in zip(peaks, here)]
            if max(peaks) > budget:
                break
            if i == 1:
                seconds = _gathered(took, world)[0]  # rank 0's clock, between the same barriers
        mine = predicted()  # the first step predicted it
        forecast = [int(p) for p in _gathered(-1.0 if mine is None else float(mine), world)]
    finally:
        close()
        del step, close
        gc.collect()
    return Point(n, peaks, seconds, None if forecast is None or min(forecast) < 0 else forecast)


def _write(out: str, record: dict[str, Any]) -> None:
    with open(out + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(out + ".tmp", out)  # a rank stopped later leaves the points measured so far


def rank_main(rank: int, world: int, port: int, job: dict[str, Any], out: str) -> None:
    """One rank of a job; rank 0 writes every point measured to ``out`` (JSON) as it goes.

    ``job`` holds ``shape``, ``dim`` (``"layers"`` or ``"width"``), ``width_unit``, ``budget``
    (bytes), ``start_by`` (no size starts after this ``time.time()``, as rank 0 sees it) and:

    * ``search``: ``groups`` (lists of systems), ``start``, ``floor``, ``cap``: per group, the
      largest size of the best of its systems (:func:`~fastpipe.bench.largest_search.best_of`;
      a group of one: that system's largest);
    * ``at``: ``n`` and ``groups`` of systems: each group measured at ``n`` in order until one fits.

    The record is ``{"runs": [{"system", "group", "points"}], "at": [{"system", "point"}],
    "stopped": {"phase": "search" or "at", "why": ...} or None}``.
    """
    torch.set_num_threads(1)
    _cpu_counter.install()  # before the job's allocations; c10 swaps its allocator without a lock
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
        dist.init_process_group("gloo", rank=rank, world_size=world)
    budget = job["budget"]
    record: dict[str, Any] = {"runs": [], "at": [], "stopped": None}

    def measured(system: dict[str, Any], n: int) -> Point:
        go = [time.time() < job["start_by"]]
        if world > 1:
            dist.broadcast_object_list(go, src=0)
        if not go[0]:
            raise TimeoutError(f"time budget spent before size {n}")
        return measure(job, system, n, rank, world)

    def searched(system: dict[str, Any], group: int) -> Callable[[int], Point]:
        run: dict[str, Any] = {"system": system, "group": group, "points": []}
        record["runs"].append(run)

        def measure_and_keep(n: int) -> Point:
            point = measured(system, n)
            run["points"].append(point.to_dict(budget))
            if rank == 0:
                _write(out, record)
            return point

        return measure_and_keep

    phase = "search"
    try:
        search: dict[str, Any] = job.get("search") or {"groups": []}
        for g, group in enumerate(search["groups"]):
            fns = [searched(s, g) for s in group]
            best_of(fns, budget, start=search["start"], floor=search["floor"], cap=search["cap"])
        phase = "at"
        probe: dict[str, Any] = job.get("at") or {"groups": [], "n": 0}
        for group in probe["groups"]:
            for system in group:
                # A size the search measured already is not run again.
                n = probe["n"]
                seen = [q for r in record["runs"] if r["system"] == system for q in r["points"] if q["n"] == n]
                point = seen[0] if seen else measured(system, n).to_dict(budget)
                record["at"].append({"system": system, "point": point})
                if point["fits"]:
                    break
    except TimeoutError as exc:
        record["stopped"] = {"phase": phase, "why": str(exc)}
    if rank == 0:
        _write(out, record)
    if world > 1:
        dist.destroy_process_group()
