"""``DistributedPipe(checkpoint="auto", memory_limit=...)``: the least recompute that fits, chosen alike on every rank.

Each rank is a gloo process counted by the exact CPU counter, as in test_limit_distributed.py.
"""

from __future__ import annotations

from typing import Any

import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

H, ROWS, M = 64, 64, 4


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)) for _ in range(4)])


def auto_on_ranks(rank: int, world: int) -> dict[str, Any]:
    import fastpipe
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.accounting import PeakMeter
    from fastpipe.memory.limit import MARGIN

    x, y = torch.randn(M * ROWS, H), torch.randn(M * ROWS, H)
    install()

    def pipe(checkpoint: str, limit: int | str) -> fastpipe.DistributedPipe:
        return fastpipe.DistributedPipe(
            model(), [3, 1], chunks=M, schedule="gpipe", checkpoint=checkpoint, memory_limit=limit
        )

    needs, grads = {}, {}
    for mode in ("never", "except_last", "always"):
        free = pipe(mode, "1TiB")
        free.train_step(x, y, ProductLoss())
        assert free.memory_guard is not None
        needs[mode] = max(d.total for d in free.memory_guard.last)
        grads[mode] = [p.grad.clone() for p in free.parameters()]
        free.close()
    assert needs["never"] > needs["always"], needs
    out: dict[str, Any] = {"needs": needs}
    for want in ("never", "except_last", "always"):
        limit = int(needs[want] * (1 + MARGIN)) + 1
        auto = pipe("auto", limit)
        opt = torch.optim.Adam(auto.parameters())
        auto.train_step(x, y, ProductLoss())  # measures, chooses, runs
        same = all(torch.equal(p.grad, g) for p, g in zip(auto.parameters(), grads["never"]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        with PeakMeter("cpu") as meter:
            auto.train_step(x, y, ProductLoss())
        assert auto.memory_guard is not None
        state = [*auto.parameters()] + [t for s in opt.state.values() for t in s.values() if t.dim()]
        held = sum(t.numel() * t.element_size() for t in state)
        out[want] = {
            "chosen": list(auto.memory_guard.chosen.values()),
            "same_grads": same,
            "counted": held + meter.result.peak,
            "limit": limit,
        }
        auto.close()
    tight = pipe("auto", needs["always"])  # below the least with its margin: refused
    try:
        tight.train_step(x, y, ProductLoss())
        out["refused"] = ""
    except ValueError as exc:
        out["refused"] = str(exc)
    out["untouched"] = all(p.grad is None for p in tight.parameters())
    tight.close()
    return out


def test_auto_runs_the_least_recompute_that_fits_on_every_rank_with_the_same_gradients() -> None:
    install_counter_or_skip()
    ranks = check_ok(run_ranks(auto_on_ranks, 2, timeout=240))
    assert ranks[0]["needs"] == ranks[1]["needs"]
    needs = ranks[0]["needs"]
    for want in ("never", "except_last", "always"):
        least = next(m for m in ("never", "except_last", "always") if needs[m] <= needs[want])
        for got in ranks:
            assert got[want]["chosen"] == [least], (want, needs, got[want])
            assert got[want]["same_grads"], "recompute replays the forward bit for bit"
            assert got[want]["counted"] <= got[want]["limit"], (want, got[want])
    for got in ranks:
        assert got["refused"] == ranks[0]["refused"] != ""
        assert "checkpoint='auto' tried never, except_last, always" in got["refused"]
        assert got["untouched"], "no action ran before the refusal"
