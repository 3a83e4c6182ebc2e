"""Deferred Linear work batched over micro-batches.

``weight_batches`` groups each stage's W actions, ``CarriedRecords`` hands records from W to W,
and ``apply_deferred`` runs one GEMM per weight over the stacked rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fp_tolerance import assert_close_reordered
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe.runtime import wgrad
from fastpipe.runtime.options import RuntimeOptions
from fastpipe.runtime.wgrad import CarriedRecords, Deferred, apply_deferred
from fastpipe.schedule import ScheduleError, build
from fastpipe.schedule.fuse import weight_batches
from fastpipe.schedule.ir import Action, Schedule

SPLIT = ("zb-h1", "zb-h2", "zb-v")


def _ws_in_order(schedule: Schedule) -> dict[int, list[tuple[int, int]]]:
    out: dict[int, list[tuple[int, int]]] = {}
    for actions in schedule.workers:
        for a in actions:
            if a.kind == "W":
                out.setdefault(a.stage, []).append((a.stage, a.microbatch))
    return out


def test_pairs_each_stages_ws_in_worker_order() -> None:
    schedule = build("zb-v", 2, 8)
    carry = weight_batches(schedule, 2)
    expected = {ws[i]: ws[i + 1] for ws in _ws_in_order(schedule).values() for i in range(0, len(ws) - 1, 2)}
    assert dict(carry) == expected and len(expected) == 16
    assert weight_batches(schedule, 1) == {}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(SPLIT),
    k=st.integers(1, 4),
    m=st.integers(1, 12),
    width=st.integers(1, 5),
    skip_first=st.booleans(),
)
def test_every_w_hands_its_work_to_a_later_w_of_its_stage(
    name: str, k: int, m: int, width: int, skip_first: bool
) -> None:
    try:
        schedule = build(name, k, m)
    except ScheduleError:
        assume(False)
    ws = _ws_in_order(schedule)
    skip = frozenset((s, 0) for s in ws) if skip_first else frozenset()
    carry = weight_batches(schedule, width, skip)
    position = {
        (a.stage, a.microbatch): (w, i)
        for w, acts in enumerate(schedule.workers)
        for i, a in enumerate(acts)
        if a.kind == "W"
    }
    for src, dst in carry.items():
        assert src not in skip and dst not in skip and dst not in carry  # a batch runs at its own last W
        assert src[0] == dst[0] and position[src][0] == position[dst][0] and position[src][1] < position[dst][1]
    for keys in ws.values():
        kept = [key for key in keys if key not in skip]
        runs = [key for key in kept if key not in carry]
        assert len(runs) == -(-len(kept) // width)  # ceil: full batches, then a short last one
        sizes = [1 + sum(1 for d in carry.values() if d == r) for r in runs]
        assert all(size <= width for size in sizes) and sum(sizes) == len(kept)


def test_an_update_closes_the_batch() -> None:
    w = [Action("W", 0, i) for i in range(5)]
    schedule = Schedule("hand", 1, 5, 1, ((w[0], w[1], w[2], Action("U", 0, 0), w[3], w[4]),))
    assert dict(weight_batches(schedule, 4)) == {(0, 0): (0, 2), (0, 1): (0, 2), (0, 3): (0, 4)}


def test_a_width_below_one_is_refused() -> None:
    with pytest.raises(ScheduleError, match="at least 1"):
        weight_batches(build("zb-v", 2, 4), 0)


@pytest.mark.parametrize("text", ["0", "-1", "two", "1.5"])
def test_a_bad_batch_variable_is_refused(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("FASTPIPE_WGRAD_BATCH", text)
    with pytest.raises(ValueError, match=r"FASTPIPE_WGRAD_BATCH must be a whole number >= 1.*pass wgrad_batch="):
        RuntimeOptions.resolve()


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_a_bad_batch_keyword_is_refused(value: Any) -> None:
    with pytest.raises(ValueError, match=r"wgrad_batch must be a whole number >= 1 \(1: each W runs its own"):
        RuntimeOptions.resolve(wgrad_batch=value)


def test_batching_is_on_for_cpu_stages_only_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    monkeypatch.delenv("FASTPIPE_WGRAD_BATCH", raising=False)
    unset = RuntimeOptions.resolve()
    assert unset.wgrad_batch_on(cpu) == 2 and unset.wgrad_batch_on(gpu) == 1
    asked = RuntimeOptions.resolve(wgrad_batch=3)
    assert asked.wgrad_batch_on(cpu) == 3 and asked.wgrad_batch_on(gpu) == 3
    monkeypatch.setenv("FASTPIPE_WGRAD_BATCH", "3")
    from_env = RuntimeOptions.resolve()
    assert from_env.wgrad_batch_on(cpu) == 3 and from_env.wgrad_batch_on(gpu) == 3
    assert RuntimeOptions.resolve(wgrad_batch=1).wgrad_batch_on(cpu) == 1  # the keyword wins over the variable


def _record(weight: nn.Parameter, bias: nn.Parameter | None, rows: int) -> tuple:
    x = torch.randn(rows, weight.shape[1], dtype=torch.float64)
    return (weight, bias, x, torch.randn(rows, weight.shape[0], dtype=torch.float64))


def test_carried_records_reach_the_batchs_last_w_in_order() -> None:
    weight = nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))
    first, second, third = (_record(weight, None, 4) for _ in range(3))
    carried = CarriedRecords({(0, 0): (0, 2), (0, 1): (0, 2)})
    stores = [Deferred() for _ in range(3)]
    for store, rec in zip(stores, (first, second, third)):
        store.records.append(rec)
    assert carried.take((0, 0), stores[0]) is None and carried.take((0, 1), stores[1]) is None
    out = carried.take((0, 2), stores[2])
    assert out is stores[2] and [r[2] for r in out.records] == [first[2], second[2], third[2]]
    assert carried.take((1, 0), None) is None  # a W whose B deferred nothing
    late, early = CarriedRecords({(0, 0): (0, 1)}), Deferred()
    early.records.append(first)
    assert late.take((0, 0), early) is None and early.records == []
    kept = late.take((0, 1), None)  # the last W of the batch deferred nothing itself
    assert kept is not None and [r[2] for r in kept.records] == [first[2]]


def test_stacked_records_give_the_per_record_sum_biases_apart() -> None:
    torch.manual_seed(0)
    w1 = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    b1 = nn.Parameter(torch.randn(5, dtype=torch.float64))
    w2 = nn.Parameter(torch.randn(2, 5, dtype=torch.float64))
    b3 = nn.Parameter(torch.randn(5, dtype=torch.float64))  # a second Linear on w1, with its own bias
    records = [_record(w1, b1, 4), _record(w2, None, 4), _record(w1, b3, 3), _record(w1, b1, 6), _record(w2, None, 6)]
    store = Deferred()
    store.records.extend(records)
    params = [w1, b1, w2, b3]
    start = [torch.randn_like(p) for p in params]
    sums: list[torch.Tensor | None] = [t.clone() for t in start]
    apply_deferred(store, params, sums)
    assert store.records == []
    want = [t.clone() for t in start]
    for weight, bias, x, dy in records:
        want[0 if weight is w1 else 2] += dy.t() @ x
        if bias is not None:
            want[1 if bias is b1 else 3] += dy.sum(0)
    for got, ref in zip(sums, want):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(6), nn.Linear(6, 10), nn.Linear(10, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _counting_gemm_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every GEMM that adds into a Linear's running weight-gradient sum, from now on."""
    rows: list[int] = []
    plain_summed = wgrad._summed

    def counting(running: torch.Tensor | None, g2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor) -> Any:
        rows.append(g2.shape[0])
        return plain_summed(running, g2, x2, weight)

    monkeypatch.setattr(wgrad, "_summed", counting)
    return rows


@pytest.mark.parametrize("width", [1, 2, 3, 100])
@pytest.mark.parametrize("schedule", ["zb-h1", "zb-v"])
def test_the_step_runs_each_batch_as_one_gemm_per_linear(
    monkeypatch: pytest.MonkeyPatch, width: int, schedule: str
) -> None:
    from fastpipe import Pipe

    rows = _counting_gemm_rows(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(*[_Block() for _ in range(4)])
    ref = nn.Sequential(*[_Block() for _ in range(4)])
    ref.load_state_dict(model.state_dict())
    x, y = torch.randn(12, 6, requires_grad=True), torch.randn(12, 6)
    pipe = Pipe(model, balance=[1, 1, 1, 1], chunks=6, checkpoint="never", wgrad_batch=width)
    virtual = 2 if schedule == "zb-v" else 1
    pipe.train_step(x, y, nn.functional.mse_loss, schedule=schedule, virtual_stages=virtual)
    per_stage = -(-6 // width)  # W batches per stage: full ones, then a short last one
    assert len(rows) == 4 * 2 * per_stage  # 4 stages x 2 Linears, one GEMM per batch
    assert sorted(set(rows)) == sorted({2 * min(width, 6), 2 * (6 % width or min(width, 6))})  # 2 rows a micro-batch
    x_ref = x.detach().requires_grad_()
    nn.functional.mse_loss(ref(x_ref), y).backward()
    for p, q in zip(pipe.parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=12 + 4 * (6 + 10))


def test_the_batch_variable_is_read_once_when_the_pipe_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastpipe import Pipe

    torch.manual_seed(0)
    x, y = torch.randn(12, 6, requires_grad=True), torch.randn(12, 6)
    monkeypatch.setenv("FASTPIPE_WGRAD_BATCH", "3")
    pipe = Pipe(nn.Sequential(_Block(), _Block()), balance=[1, 1], chunks=6, checkpoint="never")
    assert [st.wgrad_batch for st in pipe.runtime.stages] == [3, 3]
    rows = _counting_gemm_rows(monkeypatch)
    for later in ("1", "none"):  # neither a new width nor a bad value reaches the built pipe
        monkeypatch.setenv("FASTPIPE_WGRAD_BATCH", later)
        rows.clear()
        pipe.train_step(x, y, nn.functional.mse_loss, schedule="zb-h1")
        assert rows == [3 * 2] * (2 * 2 * 2)  # 2 stages x 2 Linears x 2 batches of 3 two-row micro-batches
    with pytest.raises(ValueError, match="FASTPIPE_WGRAD_BATCH must be a whole number"):
        Pipe(nn.Sequential(_Block(), _Block()), balance=[1, 1], chunks=6)  # a new pipe reads "none"


@pytest.mark.parametrize("asked", [None, 3])
def test_the_runner_batches_the_cpu_stages_and_leaves_the_others(asked: int | None) -> None:
    from fastpipe.runtime.stage import Stage
    from fastpipe.runtime.step import StepRunner, StepState
    from fastpipe.runtime.worker import CallerState

    schedule = build("zb-h1", 2, 6)
    options = RuntimeOptions(wgrad_batch=asked)
    devices = (torch.device("cpu"), torch.device("cuda", 0))
    stages = {s: Stage(nn.Linear(2, 2), d, options=options) for s, d in enumerate(devices)}
    state = StepState(schedule, CallerState.capture(), 0)
    runner = StepRunner(stages, 2, None, state, grad=True, checkpoint=lambda m: False, loss=None)  # type: ignore[arg-type]
    runner._batch_weights()
    assert state.carried is not None
    if asked is None:  # the devices' defaults: 2 on the CPU, none on the GPU
        want = {k: v for k, v in weight_batches(schedule, 2).items() if k[0] == 0}
    else:
        want = dict(weight_batches(schedule, asked))
    assert dict(state.carried.carry) == want != {}
