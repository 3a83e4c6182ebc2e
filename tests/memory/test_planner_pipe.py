"""``Pipe`` under the planner: the combination it chooses is the one that runs, and it keeps to the limit.

One stage under GPipe's order, in one process, so the exact CPU counter counts that device alone
and every micro-batch's activations are alive at once: what recompute saves shows in the peak.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _memory_utils import ProductLoss, install_counter_or_skip
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.accounting import PeakMeter

M, ROWS, D = 4, 256, 64


def blocks() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(D, 8 * D), nn.GELU(), nn.Linear(8 * D, D)) for _ in range(4)])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M * ROWS, D, generator=g), torch.randn(M * ROWS, D, generator=g)


def planned(limit: object, devices: int = 1, schedule: str = "gpipe") -> Pipe:
    x, _ = data()
    return Pipe(blocks(), "auto", devices=["cpu"] * devices, chunks=M, sample=x, memory_limit=limit, schedule=schedule)


def test_a_pipe_under_the_planner_recomputes_to_fit_trains_exactly_and_its_counted_peak_stays_under_the_limit() -> None:
    install_counter_or_skip()  # before the models exist
    # GPipe holds all 4 micro-batches: about 20 MiB of activations without recompute, 1 MiB of parameters.
    limit = 12 << 20
    pipe = planned(limit)
    assert pipe.plan is not None
    chosen = pipe.plan.chosen
    assert any(c.checkpoint == "never" and not c.fits for c in pipe.plan.considered)
    assert chosen.fits and chosen.checkpoint != "never" and pipe.checkpoint == chosen.checkpoint
    assert pipe.balance == list(chosen.balance)
    x, y = data()
    reference = blocks()  # the same weights as the pipe's
    ProductLoss()(reference(x), y).backward()
    opt = torch.optim.Adam(pipe.parameters())
    try:
        pipe.train_step(x, y, ProductLoss())  # the first step makes the gradients and, with opt, Adam's state
        for (name, ours), theirs in zip(pipe.named_parameters(), reference.parameters()):
            assert ours.grad is not None, name
            assert_close_reordered(ours.grad, theirs.grad, k=M * ROWS + 8 * D)
        opt.step()
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cpu", modules=pipe, optimizers=opt) as meter:
            pipe.train_step(x, y, ProductLoss())
    finally:
        pipe.close()
    assert meter.result.static_at_start + meter.result.peak <= limit


def test_the_planned_balance_and_schedule_are_the_ones_the_pipe_runs() -> None:
    pipe = planned("1TiB", devices=2, schedule="auto")
    try:
        assert pipe.plan is not None
        chosen = pipe.plan.chosen
        assert pipe.balance == list(chosen.balance)
        assert (pipe.schedule, pipe.virtual_stages) == (chosen.name, chosen.virtual_stages)
        assert pipe.checkpoint == "never" and all(s.offload is None for s in pipe._stages)
        x, y = data()
        pipe.train_step(x, y, ProductLoss())
        assert pipe.checkpoint_chosen == "never"
    finally:
        pipe.close()


def test_checkpoint_left_to_its_default_is_auto_with_or_without_a_limit() -> None:
    plain = Pipe(blocks(), [2, 2], devices=["cpu"] * 2, chunks=M)
    limited = Pipe(blocks(), [2, 2], devices=["cpu"] * 2, chunks=M, memory_limit="1GiB")
    try:
        assert plain.checkpoint == "auto"
        assert limited.checkpoint == "auto"
        given = Pipe(blocks(), [2, 2], devices=["cpu"] * 2, chunks=M, memory_limit="1GiB", checkpoint="except_last")
        assert given.checkpoint == "except_last"  # a value given is kept, torchgpipe's default too
        given.close()
        x, y = data()
        limited.train_step(x, y, ProductLoss())
        assert limited.checkpoint_chosen == "never"  # it fits without recompute
    finally:
        plain.close()
        limited.close()


def test_one_auto_alone_resolves_on_its_own_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastpipe.memory import planner_pipe

    monkeypatch.setattr(planner_pipe, "resolve_balance", lambda *a, **k: [2, 2])  # today's balance="auto"
    x, _ = data()
    given = {"devices": ["cpu"] * 2, "sample": x, "chunks": M, "virtual_stages": 1, "side_inputs": None}
    alone = planner_pipe.resolve_settings(
        blocks(), "auto", "1f1b", "never", None, memory_limit="1GiB", wgrad_batch=None, **given
    )
    assert alone.plan is None and alone.balance == [2, 2] and alone.checkpoint == "never"
    together = planner_pipe.resolve_settings(
        blocks(), "auto", "1f1b", planner_pipe.DEFAULT_CHECKPOINT, None, memory_limit="1GiB", wgrad_batch=None, **given
    )  # checkpoint defaults to "auto": two "auto"s
    assert together.plan is not None and together.checkpoint == "never"


def test_a_limit_below_every_combination_is_refused_when_the_pipe_is_built() -> None:
    with pytest.raises(ValueError, match=r"stage 0 needs at least .*: parameters"):
        planned("64KiB")


def test_the_planner_and_auto_schedule_count_the_optimizer_state_the_pipe_is_told_of() -> None:
    x, _ = data()
    for state, factor in (("adam", 2), ("host", 0)):
        pipe = Pipe(blocks(), "auto", devices=["cpu"] * 2, chunks=M, sample=x, memory_limit="1GiB",
                    schedule="auto", optimizer_state=state)  # fmt: skip
        try:
            assert pipe.plan is not None and pipe.auto_schedule.optimizer == state
            assert all(d.optimizer == factor * d.parameters > 0 or d.optimizer == factor == 0
                       for d in pipe.plan.chosen.devices)  # fmt: skip
        finally:
            pipe.close()
