"""Zero-bubble schedules: simulated bubble, and activation memory per worker simulated and measured.

Part 1 (simulated, F = B = W = 1 per stage): bubble of one step (``Timeline.bubble_fraction``), the
idle share inside the workers' spans (``span_bubble_fraction``) and the peak activations per worker
in units of one 1F1B stage's micro-batch (a V stage holds half), at K = 8 workers, M = 32.

Part 2 (measured, CPU): the reference workload's blocks (``fastpipe.bench.workload``, scaled down by
``--hidden``) on K = 4 worker threads, M = 8 micro-batches, ``checkpoint="never"``. Every block runs
under ``torch.autograd.graph.saved_tensors_hooks`` in its worker's thread, counting the bytes autograd
keeps for backward (parameters left out, one tensor counted once) from the pack until the graph
frees them; the peak per worker is against ``schedule.simulate.peak_memory`` with the same bytes per
stage. A split backward keeps what its ``W`` needs until the ``W`` runs: the weight side of the graph,
and each deferred Linear's input and output gradient (``fastpipe.runtime.wgrad.DeferringLinear``),
counted from ``B`` until ``W`` consumes them. The simulated count (alive until ``B``) leaves that out,
as the zero-bubble paper does.

Usage::

    python bench/zero_bubble.py [--hidden 256] [--json bench/results/zero_bubble.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fastpipe import Pipe  # noqa: E402
from fastpipe.bench.workload import ResidualMLP  # noqa: E402
from fastpipe.runtime.wgrad import DeferringLinear  # noqa: E402
from fastpipe.schedule import build, simulate, span_bubble_fraction  # noqa: E402
from fastpipe.schedule.builders import placement_for  # noqa: E402
from fastpipe.schedule.simulate import peak_memory  # noqa: E402

NAMES = ("1f1b", "zb-h1", "zb-h2", "zb-v", "dualpipev")
V = {"zb-v": 2, "dualpipev": 2}


class _Alive:
    """Saved bytes alive per worker, and their peak; a tensor saved twice counts once."""

    def __init__(self, workers: int) -> None:
        self.lock = threading.Lock()
        self.alive = [0] * workers
        self.peak = [0] * workers
        self.refs: dict[tuple[int, int], int] = {}

    def add(self, worker: int, key: int, nbytes: int) -> None:
        with self.lock:
            n = self.refs.get((worker, key), 0)
            self.refs[(worker, key)] = n + 1
            if n == 0:
                self.alive[worker] += nbytes
                self.peak[worker] = max(self.peak[worker], self.alive[worker])

    def drop(self, worker: int, key: int, nbytes: int) -> None:
        with self.lock:
            n = self.refs.pop((worker, key)) - 1
            if n:
                self.refs[(worker, key)] = n
            else:
                self.alive[worker] -= nbytes


class _Held:
    """What a pack hook returns: the tensor, and a release of its bytes when autograd frees it."""

    def __init__(self, tensor: torch.Tensor, alive: _Alive, worker: int) -> None:
        self.tensor, self.alive, self.worker = tensor, alive, worker
        # A micro-batch is a view of the caller's batch: count the view's bytes, not the storage's.
        self.key = hash((tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.numel()))
        self.nbytes = tensor.numel() * tensor.element_size()
        alive.add(worker, self.key, self.nbytes)

    def __del__(self) -> None:
        self.alive.drop(self.worker, self.key, self.nbytes)


_worker = threading.local()  # the worker whose thread runs the current block (forward and backward)


class _Record(tuple):  # type: ignore[type-arg]
    """A deferred Linear record that counts its input and output gradient until W drops it."""

    held: list[_Held]


@contextlib.contextmanager
def _counting_deferred(alive: _Alive) -> Iterator[None]:
    """Count what each B defers for its W (input and output gradient of every deferred Linear)."""
    plain = DeferringLinear.backward
    attribute = DeferringLinear.__dict__["backward"]

    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        records = ctx.store.records
        before = len(records)
        out = plain(ctx, grad)
        if len(records) > before:
            record = _Record(records[-1])
            record.held = [_Held(t, alive, _worker.index) for t in record[2:]]
            records[-1] = record
        return out

    DeferringLinear.backward = staticmethod(backward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeferringLinear.backward = attribute  # type: ignore[method-assign]


class _Counted(nn.Module):
    """A block whose saved tensors count towards ``worker``."""

    def __init__(self, block: nn.Module, alive: _Alive, worker: int) -> None:
        super().__init__()
        self.block, self.alive, self.worker = block, alive, worker
        self.params = {p.untyped_storage().data_ptr() for p in block.parameters()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() in self.params:
                return t  # a parameter (or a view of one): not an activation
            return _Held(t, self.alive, self.worker)

        def unpack(h: Any) -> torch.Tensor:
            return h.tensor if isinstance(h, _Held) else h

        _worker.index = self.worker
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            return self.block(x)


def simulated(k: int = 8, m: int = 32) -> list[dict[str, Any]]:
    rows = []
    for name in NAMES:
        s = build(name, k, m)
        t = simulate(s)
        v = s.num_stages // k
        peaks = peak_memory(s, 1.0 / v)
        rows.append(
            {
                "schedule": name,
                "bubble": t.bubble_fraction,
                "span_bubble": span_bubble_fraction(t),
                "peak_max": max(peaks),
                "peak_min": min(peaks),
            }
        )
    return rows


def measured(hidden: int, k: int = 4, m: int = 8, rows_per_mb: int = 16, blocks: int = 8) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    x = torch.randn(m * rows_per_mb, hidden)
    y = torch.randn(m * rows_per_mb, hidden)
    out = []
    for name in NAMES:
        v = V.get(name, 1)
        stages = k * v
        per_stage = blocks // stages
        placement = placement_for(name, stages, k)
        alive = _Alive(k)
        torch.manual_seed(0)
        layers = [_Counted(ResidualMLP(hidden, 4 * hidden), alive, placement[i // per_stage]) for i in range(blocks)]
        pipe = Pipe(
            nn.Sequential(*layers), [per_stage] * stages, chunks=m, checkpoint="never", schedule=name, virtual_stages=v
        )
        with _counting_deferred(alive):
            pipe.train_step(x, y, nn.MSELoss())  # warm-up (allocator, threads)
            alive.peak = [0] * k
            pipe.zero_grad()
            pipe.train_step(x, y, nn.MSELoss())
        pipe.close()
        # One block's saved bytes for one micro-batch, measured the same way.
        probe = _Alive(1)
        block = _Counted(ResidualMLP(hidden, 4 * hidden), probe, 0)
        held = block(torch.randn(rows_per_mb, hidden, requires_grad=True)).sum()
        per_block = probe.peak[0]
        del held
        sim = peak_memory(build(name, k, m), per_block * per_stage)
        out.append(
            {
                "schedule": name,
                "stages": stages,
                "measured_mib": [p / 2**20 for p in alive.peak],
                "simulated_mib": [p / 2**20 for p in sim],
                "block_mib": per_block / 2**20,
            }
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sim = simulated()
    print("simulated, F=B=W=1, K=8, M=32 (peak: 1F1B stage activations per worker)")
    print(f"{'schedule':<10} {'bubble':>7} {'in-span':>8} {'peak max':>9} {'peak min':>9}")
    for r in sim:
        bubbles = f"{r['bubble']:>7.1%} {r['span_bubble']:>8.1%}"
        print(f"{r['schedule']:<10} {bubbles} {r['peak_max']:>9.1f} {r['peak_min']:>9.1f}")
    meas = measured(args.hidden)
    base = max(meas[0]["measured_mib"])
    print(f"\nmeasured on CPU, K=4, M=8, hidden {args.hidden} (MiB saved for backward, per worker)")
    print(f"{'schedule':<10} {'stages':>6}  {'measured per worker':<34} {'simulated per worker':<34} {'max/1F1B':>8}")
    for r in meas:
        m_ = " ".join(f"{v:6.2f}" for v in r["measured_mib"])
        s_ = " ".join(f"{v:6.2f}" for v in r["simulated_mib"])
        print(f"{r['schedule']:<10} {r['stages']:>6}  {m_:<34} {s_:<34} {max(r['measured_mib']) / base:>8.2f}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"simulated": sim, "measured": meas, "hidden": args.hidden}, f, indent=1)


if __name__ == "__main__":
    main()
