"""Regions recomputed inside stage recompute: ``Recompute(..., stage="always")``.

A stage keeps only its input per micro-batch (as ``"always"``), and its replay in the backward
recomputes each region again while its backward runs (as a per-layer policy): the forward runs
three times, and a stage holds the least of all the forms. Gradients stay bit for bit those of
the pipe that keeps everything; the model predicts the counted peak; ``"auto"`` takes it last.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _memory_utils import install_counter_or_skip
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import predict_memory
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.schedule.builders import build
from fastpipe.step.recompute_policy import Recompute, auto_candidates, every_layer, stage_mode

W, LAYERS, ROWS, M = 64, 8, 32, 4
EVERY = Recompute(layers=every_layer, name="every layer")
NESTED = Recompute(layers=every_layer, stage="always", name="always, then every layer")


class Block(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(W, 4 * W), nn.Linear(4 * W, W)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(x))))


def blocks(dropout: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(dropout) for _ in range(LAYERS)])


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(M * ROWS, W, generator=g), torch.randn(M * ROWS, W, generator=g)


def trained(checkpoint: Any, schedule: str, balance: list[int], **kw: Any) -> tuple[Pipe, list[torch.Tensor]]:
    pipe = Pipe(blocks(0.2), balance, chunks=M, checkpoint=checkpoint, schedule=schedule, **kw)
    try:
        torch.manual_seed(7)  # the step's seed: the same dropout masks for every policy
        loss = pipe.train_step(*data(), nn.MSELoss())
        return pipe, [loss.detach(), *(p.grad for p in pipe.parameters())]  # type: ignore[misc]
    finally:
        pipe.close()


@pytest.mark.parametrize(("schedule", "balance"), [("gpipe", [4, 4]), ("1f1b", [4, 4]), ("zb-h1", [4, 4])])
def test_gradients_equal_the_pipe_that_keeps_everything_bit_for_bit(schedule: str, balance: list[int]) -> None:
    _, kept = trained("never", schedule, balance)
    _, nested = trained(NESTED, schedule, balance)
    assert all(torch.equal(a, b) for a, b in zip(kept, nested))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_each_layer_runs_three_times_per_micro_batch(schedule: str) -> None:
    model, calls = blocks(), [0]

    def count(*_: Any) -> None:
        calls[0] += 1

    for layer in model:
        layer.up.register_forward_pre_hook(count)  # inside the region: its recompute calls it again
    pipe = Pipe(model, [4, 4], chunks=M, checkpoint=NESTED, schedule=schedule)
    try:
        pipe.train_step(*data(), nn.MSELoss())
    finally:
        pipe.close()
    assert calls[0] == 3 * M * LAYERS  # the forward, the stage's replay, the layer's own recompute


def counted_peak(checkpoint: object, x: torch.Tensor, y: torch.Tensor) -> int:
    """What one GPipe step of one stage holds at its peak above the parameters, counted."""
    from fastpipe.memory.accounting import PeakMeter

    pipe = Pipe(blocks(), [LAYERS], chunks=M, checkpoint=checkpoint, schedule="gpipe")  # type: ignore[arg-type]
    try:
        pipe.train_step(x, y, nn.MSELoss())  # the first step builds what later steps reuse
        pipe.zero_grad(set_to_none=True)
        gc.collect()
        with PeakMeter("cpu") as meter:
            pipe.train_step(x, y, nn.MSELoss())
    finally:
        pipe.close()
    return meter.result.peak


def predicted_peak(checkpoint: str | Recompute) -> int:
    policy = checkpoint if isinstance(checkpoint, Recompute) else None
    sample, target = (t[:ROWS] for t in data())
    stages = measure_stages(blocks(), [LAYERS], sample, loss_fn=nn.MSELoss(), target=target, recompute=policy)
    (device,) = predict_memory(build("gpipe", 1, M), stages, checkpoint=stage_mode(checkpoint), wgrad_batch=2)
    return device.total - device.parameters


def test_it_holds_the_least_and_the_model_predicts_its_counted_peak() -> None:
    x, y = data()
    install_counter_or_skip()  # before the models exist
    forms: list[str | Recompute] = ["never", EVERY, "always", NESTED]
    counted = {str(f): counted_peak(f, x, y) for f in forms}
    assert counted[str(NESTED)] < min(counted["always"], counted["every layer"]) < counted["never"], counted
    assert predicted_peak(NESTED) == pytest.approx(counted[str(NESTED)], rel=0.05), counted


def guarded(checkpoint: Any, limit: int | str) -> tuple[Pipe, list[torch.Tensor]]:
    """One step under ``memory_limit``: the pipe (its guard's prediction) and the loss and gradients.

    Without dropout: measuring the candidates draws from torch's generator, which seeds the step.
    """
    pipe = Pipe(blocks(), [LAYERS], chunks=M, checkpoint=checkpoint, schedule="gpipe", memory_limit=limit)
    try:
        torch.manual_seed(7)
        loss = pipe.train_step(*data(), nn.MSELoss())
        return pipe, [loss.detach(), *(p.grad for p in pipe.parameters())]  # type: ignore[misc]
    finally:
        pipe.close()


def test_auto_takes_it_last_and_only_where_nothing_else_fits() -> None:
    found = auto_candidates([blocks()])
    assert found[-3:] == [EVERY, "always", NESTED]
    assert auto_candidates([nn.Sequential(Block(0.0))])[-1] == "always"  # one layer: nothing to nest
    need = {str(f): guarded(f, "1TiB")[0].memory_guard.last[0].total for f in (EVERY, "always", NESTED)}  # type: ignore[union-attr]
    limit = int(need[str(NESTED)] * (1 + MARGIN) * 1.005)
    assert limit < min(need["always"], need["every layer"]) * (1 + MARGIN), need
    pipe, got = guarded("auto", limit)
    assert pipe.checkpoint_chosen == NESTED
    _, kept = guarded("never", "1TiB")
    assert all(torch.equal(a, b) for a, b in zip(kept, got))


def test_a_stage_mode_other_than_never_or_always_is_refused() -> None:
    with pytest.raises(ValueError, match=r"stage=\) takes 'never' or 'always'"):
        Recompute(layers=every_layer, stage="except_last")  # type: ignore[arg-type]
    assert str(Recompute(layers=every_layer, stage="always")) == "layers every_layer inside stage recompute"
