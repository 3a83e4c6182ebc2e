"""Run a function on N gloo ranks (spawned processes) and collect what each rank returned.

The parent hosts the TCPStore, so the store outlives any rank that dies. Each rank writes
its outcome to a file: ``{"ok": value}``, ``{"error": type name, "message": text}``; a rank
that died or hung shows as ``{"died": exitcode}``.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks"]


def _entry(rank: int, world: int, port: int, outdir: str, fn: Callable[..., Any], args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    start = time.monotonic()
    try:
        outcome: dict[str, Any] = {"ok": fn(rank, world, *args)}
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        outcome = {
            "error": type(exc).__name__,
            "message": str(exc),
            "elapsed": time.monotonic() - start,
            "traceback": traceback.format_exc(),
        }
    torch.save(outcome, os.path.join(outdir, f"{rank}.tmp"))
    os.replace(os.path.join(outdir, f"{rank}.tmp"), os.path.join(outdir, f"{rank}.pt"))
    if "ok" in outcome:
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter teardown: gloo threads of a broken group may linger


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 60.0) -> list[dict[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; one outcome dict per rank."""
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as outdir:
        procs = [
            ctx.Process(target=_entry, args=(r, world, store.port, outdir, fn, args), daemon=True) for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        outcomes = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            path = os.path.join(outdir, f"{r}.pt")
            outcome = torch.load(path, weights_only=False) if os.path.exists(path) else {"died": p.exitcode}
            outcomes.append({**outcome, "exitcode": p.exitcode})
    del store
    return outcomes


def check_ok(outcomes: list[dict[str, Any]]) -> list[Any]:
    """The values of ranks that all succeeded; otherwise an AssertionError with the details."""
    bad = [(r, o) for r, o in enumerate(outcomes) if "ok" not in o]
    assert not bad, "\n".join(f"rank {r}: {o.get('traceback', o)}" for r, o in bad)
    return [o["ok"] for o in outcomes]
