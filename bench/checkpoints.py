"""Checkpoint cost on 2 gloo ranks: the one-file ``fastpipe.save`` against sharded ``fastpipe.checkpoint.dcp``.

Two spawned ranks (one intra-op thread each) hold a ``DistributedPipe`` of 8 ``Linear(W, W)``
layers, split [4, 4], with Adam's state filled by one step (3 tensors per parameter). For
each width it measures, on rank 0, between barriers:

* save and load time of ``fastpipe.save``/``load`` (every share gathered to rank 0, one
  file) and of ``fastpipe.checkpoint.dcp.save``/``load`` (each rank its shard, then the CRC-32s and the
  commit record; the load checks the CRC-32s first);
* the peak resident memory that rank 0 (the gathering rank of ``fastpipe.save``) adds
  during the save (``VmHWM`` after resetting it through ``/proc/self/clear_refs``);
* the pause of ``fastpipe.checkpoint.dcp.async_save``: the time until the call returns, against the
  whole synchronous save;
* the CRC-32 and SHA-256 throughput over the checkpoint's files.

Each figure is the median over ``--repeats``; ratios are within one run.

Usage::

    python bench/checkpoints.py --widths 512 1024 2048 --repeats 3 --json bench/results/checkpoints.json
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fastpipe  # noqa: E402
from fastpipe.bench.steps import free_port  # noqa: E402
from fastpipe.checkpoint import dcp  # noqa: E402
from fastpipe.checkpoint.commit import checksum  # noqa: E402
from fastpipe.distributed_pipe import DistributedPipe  # noqa: E402

MIB = 1 << 20


def _kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measure(fn: Callable[[], Any]) -> tuple[float, float]:
    """(seconds between barriers, MiB of resident memory added at the peak) of ``fn`` on this rank."""
    gc.collect()
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base = _kib("VmRSS:")
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start, (_kib("VmHWM:") - base) / 1024


def _hash_rate(folder: str) -> tuple[float, float]:
    """GB/s of CRC-32 and of SHA-256 over the files of ``folder``."""
    names = [os.path.join(folder, n) for n in os.listdir(folder)]
    size = sum(os.path.getsize(n) for n in names)
    start = time.perf_counter()
    for n in names:
        checksum(n)
    crc = time.perf_counter() - start
    start = time.perf_counter()
    for n in names:
        with open(n, "rb") as f:
            h = hashlib.sha256()
            while piece := f.read(8 * MIB):
                h.update(piece)
    sha = time.perf_counter() - start
    return size / crc / 1e9, size / sha / 1e9


def _width(rank: int, width: int, repeats: int, root: str) -> dict[str, Any] | None:
    """The figures of one model size (rank 0; None elsewhere)."""
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(*[nn.Linear(width, width) for _ in range(8)]), [4, 4], timeout=600)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    x, y = torch.randn(16, width), torch.randn(16, width)
    pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
    opt.step()
    one, folder = os.path.join(root, f"one-{width}.pt"), os.path.join(root, f"dcp-{width}")
    figures: dict[str, list[float]] = {}
    pauses: list[float] = []

    def async_save() -> None:
        start = time.perf_counter()
        pending = dcp.async_save(pipe, folder, opt, timeout=600)
        pauses.append(time.perf_counter() - start)
        pending.wait()

    runs: list[tuple[str, Callable[[], Any]]] = [
        ("one_save", lambda: fastpipe.save(pipe, one, opt)),
        ("one_load", lambda: fastpipe.load(one, pipe, opt)),
        ("dcp_save", lambda: dcp.save(pipe, folder, opt, timeout=600)),
        ("dcp_load", lambda: dcp.load(folder, pipe, opt, timeout=600)),
        ("async_total", async_save),
    ]
    for _ in range(repeats):
        for name, fn in runs:
            seconds, peak = _measure(fn)
            figures.setdefault(f"{name}_s", []).append(seconds)
            figures.setdefault(f"{name}_peak_mib", []).append(peak)
        if rank == 0:
            crc, sha = _hash_rate(folder)
            figures.setdefault("crc32_gb_s", []).append(crc)
            figures.setdefault("sha256_gb_s", []).append(sha)
        dist.barrier()
    row: dict[str, Any] | None = None
    if rank == 0:
        row = {k: statistics.median(v) for k, v in figures.items()}
        row["async_pause_s"] = statistics.median(pauses)
        row["width"] = width
        row["params_mib"] = sum(p.numel() * 4 for p in pipe.parameters()) * 2 / MIB  # both ranks' halves
        row["one_file_mib"] = os.path.getsize(one) / MIB
        row["dcp_mib"] = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)) / MIB
    pipe.close()
    dist.barrier()
    if rank == 0:
        os.unlink(one)
        shutil.rmtree(folder)
    return row


def _rank(rank: int, port: int, widths: list[int], repeats: int, root: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    rows = [_width(rank, width, repeats, root) for width in widths]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model (params, MiB) | files (one / DCP, MiB) | save: DCP / one-file | load: DCP / one-file "
        "| rank 0's peak during save (one / DCP, MiB) | async pause / DCP save | CRC-32, SHA-256 (GB/s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| W={r['width']} ({r['params_mib']:.0f}) | {r['one_file_mib']:.0f} / {r['dcp_mib']:.0f} "
            f"| {r['dcp_save_s'] / r['one_save_s']:.2f} ({r['dcp_save_s']:.2f} / {r['one_save_s']:.2f} s) "
            f"| {r['dcp_load_s'] / r['one_load_s']:.2f} ({r['dcp_load_s']:.2f} / {r['one_load_s']:.2f} s) "
            f"| {r['one_save_peak_mib']:.0f} / {r['dcp_save_peak_mib']:.0f} "
            f"| {r['async_pause_s'] / r['dcp_save_s']:.2f} ({r['async_pause_s'] * 1e3:.0f} ms) "
            f"| {r['crc32_gb_s']:.2f}, {r['sha256_gb_s']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--widths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    root = tempfile.mkdtemp(dir=args.dir)
    out = os.path.join(root, "rows.json")
    try:
        mp.spawn(_rank, args=(free_port(), args.widths, args.repeats, root, out), nprocs=2, join=True)
        with open(out) as f:
            rows = json.load(f)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
