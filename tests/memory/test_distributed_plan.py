"""``DistributedPipe(model, balance="auto", sample=...)``: one rank plans, every rank builds the plan.

Two gloo ranks, each counted by the exact CPU counter (as in test_limit_distributed_auto.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import ProductLoss, install_counter_or_skip
from fp_tolerance import assert_close_reordered
from torch import nn

H, ROWS, M, BLOCKS = 32, 128, 4, 6


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)) for _ in range(BLOCKS)])


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M * ROWS, H, generator=g), torch.randn(M * ROWS, H, generator=g)


def planned_on_ranks(rank: int, world: int) -> dict[str, Any]:
    import fastpipe
    from fastpipe.balance import BalanceError
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.accounting import PeakMeter

    install()
    x, y = _batch()

    def pipe(limit: int | None, sample: Any = x) -> fastpipe.DistributedPipe:
        return fastpipe.DistributedPipe(
            model(), "auto", chunks=M, schedule="auto", checkpoint="auto", memory_limit=limit, sample=sample
        )

    out: dict[str, Any] = {}
    free = pipe(None)
    assert free.plan is not None
    out["free"] = (free.balance, free.schedule, free.checkpoint, free.plan.chosen.fits)
    free.train_step(x, y, ProductLoss())
    mine = {n: p.grad.clone() for n, p in free.named_parameters()}
    need = max(d.total for d in free.plan.chosen.devices)
    free.close()

    plain = model()
    for xs, ys in zip(x.chunk(M), y.chunk(M)):
        (ProductLoss()(plain(xs), ys) / M).backward()
    out["grads_match"] = sorted(mine)
    for name, g in mine.items():
        assert_close_reordered(g, dict(plain.named_parameters())[name].grad, k=4 * H + ROWS * M)

    limit = int(need * 0.8)  # the fastest plan does not fit: another balance, schedule or recompute must
    tight = pipe(limit)
    assert tight.plan is not None
    opt = torch.optim.SGD(tight.parameters(), lr=0.0)
    tight.train_step(x, y, ProductLoss())  # the guard measures and checks the step too
    opt.zero_grad(set_to_none=True)
    with PeakMeter("cpu") as meter:
        tight.train_step(x, y, ProductLoss())
    held = sum(p.numel() * p.element_size() for p in tight.parameters())
    out["tight"] = {
        "limit": limit,
        "settings": (tight.balance, tight.schedule, tight.checkpoint),
        "counted": held + meter.result.peak,
        "table": tight.plan.table(),
    }
    tight.close()

    for name, args in (("tiny", (4096,)), ("no_sample", (None, None))):
        try:
            pipe(*args).close()
            out[name] = ""
        except (ValueError, TypeError, BalanceError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def test_one_rank_plans_and_every_rank_builds_it_within_the_limit() -> None:
    install_counter_or_skip()
    ranks = check_ok(run_ranks(planned_on_ranks, 2, timeout=300))
    for r in ranks:
        assert r["free"] == ranks[0]["free"] and r["tight"]["settings"] == ranks[0]["tight"]["settings"]
        balance, schedule, checkpoint, fits = r["free"]
        assert sum(balance) == BLOCKS and len(balance) in (2, 4) and fits
        assert checkpoint == "never"  # no limit: nothing recomputed
        assert r["grads_match"]
        tight = r["tight"]
        assert tight["settings"] != ranks[0]["free"][:3], tight["table"]
        assert tight["counted"] <= tight["limit"], (tight["counted"], tight["limit"], tight["table"])
        assert "memory_limit=4.00 KiB" in r["tiny"] and "needs at least" in r["tiny"], r["tiny"]
        planning = ranks[0]["tiny"].split(": ", 1)[1]
        assert planning in r["tiny"]  # raised on every rank, with the planning rank's message
        assert "sample=" in r["no_sample"], r["no_sample"]


def test_balance_auto_needs_the_whole_model() -> None:
    from fastpipe.distributed.plan import check_balance_given

    with pytest.raises(TypeError, match="from_stage_builder does not have"):
        check_balance_given("auto", None)
    with pytest.raises(TypeError, match="or 'auto' with sample="):
        check_balance_given("even", model())
    with pytest.raises(TypeError, match="needs balance="):
        check_balance_given(None, model())
