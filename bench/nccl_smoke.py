"""NCCL smoke test for DistributedPipe: the same loss and gradients as the plain Sequential on the GPU.

Runs its cases each in fresh spawned processes with a hard time limit (a hang is a failure):

- ``1 rank``: one NCCL rank holding two interleaved stages (NCCL collectives, the gloo header
  group, the ordered transport's set-up; no payload crosses ranks);
- ``N ranks, one GPU each`` when the host has N >= 2 GPUs: every schedule, payloads over NCCL.

Usage: ``python bench/nccl_smoke.py [--limit 90]``. Prints a table and a ``JSON`` line.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

HIDDEN = 64
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU()) for _ in range(8)])


def _rank_main(rank: int, world: int, port: int, out: str, gpu_of: list[int], schedules: list, cpu: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    result: dict = {}
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=30))
        if cpu:  # a dry run of this script: gloo, with the order-matched transport NCCL would use
            os.environ["FASTPIPE_P2P"] = "ordered"
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            device = torch.device("cpu")
        else:
            torch.cuda.set_device(gpu_of[rank])
            device = torch.device("cuda", gpu_of[rank])
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world, device_id=device)
        from fastpipe.distributed_pipe import DistributedPipe

        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(16, HIDDEN, generator=g).to(device), torch.randn(16, HIDDEN, generator=g).to(device)
        plain = _model().to(device)
        expected = nn.MSELoss()(plain(x), y)
        expected.backward()
        ref = dict(plain.named_parameters())
        checks = {}
        for name, v in schedules:
            balance = [8 // (world * v)] * (world * v)
            pipe = DistributedPipe(_model(), balance, chunks=4, schedule=name, timeout=30)
            transport = type(pipe.runtime.transport).__name__
            start = time.perf_counter()
            for _ in range(2):  # the second step reuses buffers and plans
                for p in pipe.parameters():
                    p.grad = None
                loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
            if not cpu:
                torch.cuda.synchronize()
            worst = max((p.grad - ref[n].grad).abs().max().item() for n, p in pipe.named_parameters())
            checks[name] = {
                "loss_err": abs(loss.item() - expected.item()),
                "grad_err": worst,
                "transport": transport,
                "s": round(time.perf_counter() - start, 3),
            }
            pipe.close()
        result = {"ok": checks}
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        result = {"error": f"{type(exc).__name__}: {str(exc)[:300]}", "traceback": traceback.format_exc()[-1500:]}
    torch.save(result, os.path.join(out, f"{rank}.pt"))
    os._exit(0)


def run_case(world: int, gpu_of: list[int], schedules: list, limit: float, cpu: bool = False) -> dict:
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, store.port, out, gpu_of, schedules, cpu), daemon=True)
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + limit
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(out, f"{r}.pt")
            results.append(torch.load(path) if os.path.exists(path) else {"error": "no result (died or hung)"})
    if hung:
        return {"status": "HANG", "hung_ranks": hung, "results": results}
    errors = [res["error"] for res in results if "error" in res]
    if errors:
        return {"status": "error", "errors": errors, "tracebacks": [res.get("traceback") for res in results]}
    worst = max(c["grad_err"] for res in results for c in res["ok"].values())
    loss = max(c["loss_err"] for res in results for c in res["ok"].values())
    transports = sorted({c["transport"] for res in results for c in res["ok"].values()})
    ok = worst < 1e-4 and loss < 1e-4
    return {
        "status": "ok" if ok else "WRONG",
        "grad_err": worst,
        "loss_err": loss,
        "transports": transports,
        "schedules": [n for n, _ in schedules],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=float, default=90.0, help="seconds per case before it counts as a hang")
    parser.add_argument(
        "--cpu", action="store_true", help="dry run on CPU: gloo with the order-matched transport, 2 and 4 ranks"
    )
    args = parser.parse_args()
    if args.cpu:
        cases = {f"{w} ranks, gloo (dry run)": run_case(w, [0] * w, SCHEDULES, args.limit, cpu=True) for w in (2, 4)}
        return _report(cases)
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("no CUDA/NCCL here: nothing to check")
        print("JSON " + json.dumps({"skipped": "no CUDA"}))
        return 0
    n = torch.cuda.device_count()
    cases = {"1 rank": run_case(1, [0], [("interleaved", 2), ("1f1b", 1)], args.limit)}
    # No case of two ranks on one GPU: NCCL refuses it (docs/gpu.md), so it would only spend the time.
    if n >= 2:
        world = min(n, 4)
        cases[f"{world} ranks, {world} GPUs"] = run_case(world, list(range(world)), SCHEDULES, args.limit)
    return _report(cases)


def _report(cases: dict[str, dict]) -> int:
    print(f"{'case':<20} {'status':<40} details")
    for name, res in cases.items():
        details = {k: v for k, v in res.items() if k not in ("status", "tracebacks")}
        print(f"{name:<20} {res['status']:<40} {json.dumps(details)[:200]}")
        for tb in res.get("tracebacks") or []:
            if tb:
                print(tb)
    print("JSON " + json.dumps({k: v["status"] for k, v in cases.items()}))
    bad = [k for k, v in cases.items() if v["status"] in ("HANG", "WRONG", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
