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
        "tried": sorted({str(c.checkpoint) for c in tight.plan.considered}),
    }
    tight.close()

    # Told of a HostOptimizer, the planner and the guard count no optimizer state on the devices.
    host = fastpipe.DistributedPipe(model(), "auto", chunks=M, schedule=free.schedule, sample=x, optimizer_state="host")
    assert host.plan is not None
    out["host_plan"] = [(d.optimizer, d.parameters) for d in host.plan.chosen.devices]
    balance, schedule = host.balance, host.schedule
    host.close()
    verdicts = {}
    for state in ("adam", "host"):
        told = fastpipe.DistributedPipe(model(), balance, chunks=M, schedule=schedule, memory_limit="1GiB",
                                        optimizer_state=state, checkpoint="except_last")  # fmt: skip
        told.train_step(x, y, ProductLoss())
        assert told.memory_guard is not None
        verdicts[state] = [(d.total, d.optimizer) for d in told.memory_guard.last]
        told.close()
    between = (max(t for t, _ in verdicts["adam"]) + max(t for t, _ in verdicts["host"]) * 1.05) / 2
    for state in ("adam", "host"):
        told = fastpipe.DistributedPipe(model(), balance, chunks=M, schedule=schedule, memory_limit=int(between),
                                        optimizer_state=state, checkpoint="except_last")  # fmt: skip
        try:
            told.train_step(x, y, ProductLoss())
            out[f"between_{state}"] = ""
        except ValueError as exc:
            out[f"between_{state}"] = str(exc)
        told.close()
    out["verdicts"] = verdicts

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
        # Per-layer recompute is on offer, unless a balance and schedule fit without any (the faster).
        assert "every other layer" in tight["tried"] or tight["settings"][2] == "never", tight["table"]
        assert "memory_limit=4.00 KiB" in r["tiny"] and "needs at least" in r["tiny"], r["tiny"]
        planning = ranks[0]["tiny"].split(": ", 1)[1]
        assert planning in r["tiny"]  # raised on every rank, with the planning rank's message
        assert "sample=" in r["no_sample"], r["no_sample"]
        assert all(o == 0 < p for o, p in r["host_plan"]), r["host_plan"]
        adam, host = r["verdicts"]["adam"], r["verdicts"]["host"]
        assert all(o > 0 for _, o in adam) and all(o == 0 for _, o in host)
        assert [t - o for t, o in adam] == [t for t, _ in host]
        assert "optimizer" in r["between_adam"] and r["between_host"] == "", r


def test_balance_auto_needs_the_whole_model() -> None:
    from fastpipe.distributed.plan import check_balance_given

    with pytest.raises(TypeError, match="from_stage_builder does not have"):
        check_balance_given("auto", None)
    with pytest.raises(TypeError, match="or 'auto' with sample="):
        check_balance_given("even", model())
    with pytest.raises(TypeError, match="needs balance="):
        check_balance_given(None, model())


def offload_planned_on_ranks(rank: int, world: int) -> dict[str, Any]:
    import warnings

    import fastpipe
    from fastpipe.distributed import plan
    from fastpipe.memory.offload_bytes import CopyBandwidth

    measure = plan.measure_plan_profile

    def priced(*args: Any, **kw: Any) -> Any:  # a CPU prices no offload: a test gives it a fast copy link
        kw["bandwidth"] = CopyBandwidth(torch.device("cpu"), 1e12, 1e12, 1 << 20) if kw["offload"] else None
        return measure(*args, **kw)

    plan.measure_plan_profile = priced  # type: ignore[assignment]
    x, y = _batch()

    def pipe(limit: int | None, offload: Any) -> fastpipe.DistributedPipe:
        return fastpipe.DistributedPipe(model(), "auto", chunks=M, schedule="gpipe", checkpoint="auto",
                                        memory_limit=limit, sample=x, offload=offload)  # fmt: skip

    free = pipe(None, None)
    assert free.plan is not None
    need = max(d.total for d in free.plan.chosen.devices)
    free.close()
    out: dict[str, Any] = {}
    for offload in (None, "auto"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tight = pipe(int(need * 0.9), offload)  # within reach of offload, not of "never" alone
        assert tight.plan is not None
        c = tight.plan.chosen
        out[str(offload)] = (c.checkpoint, c.offload, [str(w.message) for w in caught])
        tight.close()
    return out


def test_under_offload_auto_the_planner_offers_offload_and_the_ranks_take_its_shares() -> None:
    ranks = check_ok(run_ranks(offload_planned_on_ranks, 2, timeout=300))
    for r in ranks:
        assert all(r[k][:2] == ranks[0][k][:2] for k in r)  # one plan, built on every rank
        checkpoint, shares, _ = r["None"]
        assert checkpoint != "never" and not any(shares)  # without offload on offer, only recompute fits
        checkpoint, shares, messages = r["auto"]
        assert checkpoint == "never" and any(shares), r["auto"]  # a fast link: offload beats recompute
        assert any("does nothing on CPU stages" in m for m in messages)  # the shares reach the ranks' stages
