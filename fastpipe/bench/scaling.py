"""Side by side in one run: plain PyTorch, gradient accumulation, fastpipe, torchgpipe, and
``torch.distributed.pipelining``, on K devices: every visible GPU (one stage each), else 2 CPU
stages with one thread each.

Every method trains the residual-MLP workload (:mod:`fastpipe.bench.workload`). Figures:

* speed-up over one device: T_mb / t, where T_mb is one device doing the same M micro-batches
  one after another (gradient accumulation), the fair single-device baseline;
* fraction of the limit: (T_mb/K × (M+K−1)/M) / t, where 1.0 is a synchronous pipeline with
  no overhead. The GPipe paper's reference is 3.5× on 4 devices for AmoebaNet-D.

Timed steps run round-robin so drift hits every method alike; medians are reported. The
multi-process methods (``torch.distributed.pipelining`` here, fastpipe's ``DistributedPipe`` in
:mod:`fastpipe.bench.ranks`) run in spawned ranks: gloo on CPU, NCCL with one rank per GPU.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fastpipe import Pipe
from fastpipe.bench.charts import ratio_chart
from fastpipe.bench.steps import accumulation_step, pipe_step, plain_step, train_step
from fastpipe.bench.workload import make_batch, make_model

__all__ = ["Workload", "host_workload", "run_e2e", "limit_of"]


@dataclass(frozen=True)
class Workload:
    """One size of the residual-MLP family on this host."""

    blocks: int
    hidden: int
    ffn: int
    batch: int
    chunks: int
    devices: tuple[str, ...]

    @property
    def k(self) -> int:
        return len(self.devices)

    @property
    def cuda(self) -> bool:
        return self.devices[0].startswith("cuda")

    def to_dict(self) -> dict[str, Any]:
        return {
            "blocks": self.blocks,
            "hidden": self.hidden,
            "ffn": self.ffn,
            "batch": self.batch,
            "chunks": self.chunks,
            "devices": list(self.devices),
        }


def host_workload(tiny: bool = False) -> Workload:
    """K = every visible GPU (bf16, 2048/8192, batch 4096, 4 blocks per GPU), else 2 CPU stages (the
    reference workload: 8 blocks 512/2048, batch 256, 8 micro-batches); ``tiny`` for tests."""
    gpus = torch.cuda.device_count()
    if tiny:
        return Workload(4, 64, 128, 32, 4, ("cpu", "cpu"))
    if gpus:
        return Workload(max(8, 4 * gpus), 2048, 8192, 4096, 8, tuple(f"cuda:{i}" for i in range(gpus)))
    return Workload(8, 512, 2048, 256, 8, ("cpu", "cpu"))


def limit_of(t_mb: float, k: int, m: int) -> float:
    """The synchronous pipeline's physical limit T_mb/K × (M+K−1)/M."""
    return t_mb / k * (m + k - 1) / m


def _balance(blocks: int, k: int) -> list[int]:
    base, extra = divmod(blocks, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def _synced(step: Callable[[], None], w: Workload) -> Callable[[], None]:
    if not w.cuda:
        return step

    def run() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            step()
        for d in dict.fromkeys(w.devices):
            torch.cuda.synchronize(d)

    return run


def _methods(w: Workload, notes: list[str]) -> dict[str, Callable[[], None]]:
    x, y = make_batch(w.batch, hidden=w.hidden)
    first, last = torch.device(w.devices[0]), torch.device(w.devices[-1])
    model = lambda: make_model(w.blocks, hidden=w.hidden, ffn=w.ffn)  # noqa: E731
    plain = model().to(first)
    xd, yd = x.to(first), y.to(first)
    methods = {
        "plain, 1 device, full batch": plain_step(plain, xd, yd, 1),
        "gradient accumulation, 1 device (T_mb)": accumulation_step(plain, xd, yd, w.chunks),
    }
    if not w.cuda:
        methods["plain, 2 threads, full batch"] = plain_step(plain, xd, yd, 2)
    balance = _balance(w.blocks, w.k)
    devices = list(w.devices)
    yl = y.to(last)
    gp = Pipe(model(), balance=balance, devices=devices, chunks=w.chunks, checkpoint="never")
    methods["fastpipe GPipe, pipe(x) + backward"] = pipe_step(gp, x.to(first), yl)
    for sched in ("1f1b", "zb-h1"):
        p = Pipe(model(), balance=balance, devices=devices, chunks=w.chunks, checkpoint="never")
        methods[f"fastpipe train_step {sched}"] = train_step(p, x.to(first), yl, sched)
    try:
        from torchgpipe import GPipe

        tg = GPipe(model(), balance=balance, devices=devices, chunks=w.chunks, checkpoint="never")
        methods["torchgpipe"] = pipe_step(tg, x.to(first), yl)
    except ImportError:
        notes.append("torchgpipe: not installed (pip install torchgpipe), skipped")
    except Exception as exc:  # noqa: BLE001 - a peer that fails to build is reported, not fatal
        notes.append(f"torchgpipe: failed to build ({type(exc).__name__}: {exc}), skipped")
    return {name: _synced(step, w) for name, step in methods.items()}


def run_e2e(deadline: float, rounds: int = 5, tiny: bool = False) -> dict[str, Any]:
    """Times every method; stops adding rounds at ``deadline`` (``time.monotonic()``)."""
    w = host_workload(tiny)
    notes: list[str] = []
    if not w.cuda:
        torch.set_num_threads(1)
    methods = _methods(w, notes)
    for name, step in list(methods.items()):  # warm-up (allocations, kernel selection)
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - a peer that fails on this host is reported, not fatal
            if not name.startswith("torchgpipe"):
                raise
            notes.append(f"{name}: failed on this host ({type(exc).__name__}: {exc}), skipped")
            del methods[name]
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        if r >= 2 and time.monotonic() > deadline:
            notes.append(f"time limit reached: {r} rounds instead of {rounds}")
            break
        for name, step in methods.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    with contextlib.suppress(Exception):
        torch.set_num_threads(1)
    if tiny:
        notes.append("torch.distributed.pipelining: skipped at --tiny sizes (spawns ranks)")
    else:
        from fastpipe.bench.ranks import spawn_ranks

        try:
            # Its own paired T_mb is not mixed in: the in-process methods share one baseline.
            steps, _ = spawn_ranks(
                "pipelining",
                w,
                schedule="1f1b",
                warmup=1,
                steps=max(2, rounds),
                timeout=max(60.0, deadline - time.monotonic()),
            )
            times[f"torch.distributed.pipelining 1F1B ({w.k} ranks)"] = steps
        except Exception as exc:  # noqa: BLE001
            notes.append(f"torch.distributed.pipelining: {exc}")
    return summarise(times, w, notes)


def summarise(times: dict[str, list[float]], w: Workload, notes: list[str]) -> dict[str, Any]:
    """Medians, speed-up over one device and fraction of the limit, per method."""
    med = {name: statistics.median(ts) for name, ts in times.items() if ts}
    t_mb = med["gradient accumulation, 1 device (T_mb)"]
    limit = limit_of(t_mb, w.k, w.chunks)
    rows = [
        {"method": name, "median_s": t, "speedup_over_1_device": t_mb / t, "fraction_of_limit": limit / t}
        for name, t in med.items()
    ]
    return {
        "workload": w.to_dict(),
        "k": w.k,
        "m": w.chunks,
        "t_mb_s": t_mb,
        "limit_s": limit,
        "ideal_speedup": t_mb / limit,
        "rows": rows,
        "notes": notes,
        "reference": "GPipe (Huang et al. 2019): 3.5x on 4 devices for AmoebaNet-D",
    }


def plot_e2e(result: dict[str, Any], path: str) -> None:
    """Bars of the speed-up over one device, each labelled, with the limit as a dashed line."""
    rows = result["rows"]
    ratio_chart(
        path,
        [r["method"] for r in rows],
        [r["speedup_over_1_device"] for r in rows],
        reference=result["ideal_speedup"],
        reference_label=f"limit ({result['ideal_speedup']:.2f}x)",
        xlabel=f"speed-up over 1 device (T_mb), K = {result['k']}, M = {result['m']}; higher is better",
    )
