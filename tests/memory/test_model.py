"""The memory model counts what a split backward keeps until W, and every other part of a device's peak.

Hand-computed timelines pin each rule; the zero-bubble figures are held against the CPU
measurements of ``bench/RESULTS.md`` ("Activation memory per worker, measured against simulated");
hypothesis checks the properties over random schedules.
"""

from __future__ import annotations

import gc

import pytest
import torch
from _memory_utils import install_counter_or_skip
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fastpipe
from fastpipe.memory.model import PARTS, DeviceMemory, StageBytes, optimizer_factor, predict_memory, require_fit
from fastpipe.memory.stage_bytes import measure_stages
from fastpipe.schedule import SCHEDULES, ScheduleError, build, build_multistep, weight_versions
from fastpipe.schedule.builders import build_for
from fastpipe.schedule.fuse import adjacent_pairs
from fastpipe.schedule.greedy import greedy_schedule
from fastpipe.schedule.search import StageCosts, search
from fastpipe.schedule.simulate import peak_memory, simulate_times

MIB = 2**20


def _stage(**parts: int) -> StageBytes:
    return StageBytes(**{"parameters": 0, "activation": 0, **parts})


def _dynamic(devices: list[DeviceMemory]) -> list[int]:
    """Each device's predicted peak less its parameters."""
    return [d.total - d.parameters for d in devices]


def _first_stage_unsplit(schedule):  # as the runtime runs stage 0 when its input needs no gradient
    return {p for p in adjacent_pairs(schedule) if p[0] == 0}


# -- peak_memory: what B keeps until W ---------------------------------------------------------------


def test_w_records_raise_the_zero_bubble_peaks_and_leave_1f1b_alone() -> None:
    one, zb = build("1f1b", 4, 8), build("zb-h1", 4, 8)
    assert peak_memory(one, 1.0, w_records=1.0) == peak_memory(one, 1.0) == [4.0, 3.0, 2.0, 1.0]
    assert peak_memory(zb, 1.0) == [4.0, 3.0, 2.0, 1.0]  # freed at B, as the zero-bubble paper counts
    # Each downstream worker defers W's until its cool-down, holding their records.
    assert peak_memory(zb, 1.0, w_records=1.0) == [4.0, 4.0, 4.0, 4.0]


def test_batched_ws_keep_records_until_their_batch_closes() -> None:
    # One worker: F0 B0 W0 F1 B1 W1 ... With batches of 2, W0 hands its records to W1.
    schedule = build("zb-h1", 1, 4)
    assert peak_memory(schedule, 1.0, w_records=1.0) == [1.0]
    assert peak_memory(schedule, 1.0, w_records=1.0, wgrad_batch=2) == [2.0]
    # A B that the runtime runs as a combined backward leaves nothing for its W.
    unsplit = {(0, m) for m in range(4)}
    assert peak_memory(schedule, 1.0, w_records=1.0, wgrad_batch=2, unsplit=unsplit) == [1.0]
    with pytest.raises(ScheduleError, match="at least 1"):
        peak_memory(schedule, 1.0, w_records=1.0, wgrad_batch=0)


# The bench's table (K = 4, M = 8, 16 rows of hidden 256): measured MiB per worker, batched W's and
# batch 1, and the unit of the simulated count: one 1F1B stage's micro-batch (two blocks), 0.3125 MiB.
MEASURED_BATCHED = {
    "1f1b": (1.25, 0.94, 0.63, 0.31),
    "zb-h1": (1.25, 1.58, 1.58, 1.58),
    "zb-h2": (2.52, 2.52, 2.52, 2.52),
    "zb-v": (1.42, 1.58, 1.58, 1.58),
    "dualpipev": (1.42, 1.42, 1.56, 1.41),
}
MEASURED_BATCH_1 = {"zb-h1": (1.25, 1.27, 1.27, 1.27), "zb-v": (1.27, 1.27, 1.27, 1.27)}
UNIT_MIB = 0.3125


def _bench_peaks(name: str, wgrad_batch: int) -> list[float]:
    schedule = build(name, 4, 8)
    per_stage = 4 / schedule.num_stages  # a V stage holds half a 1F1B stage
    # The bench's blocks keep as many bytes in their W records as they save (x and dy per Linear).
    return peak_memory(
        schedule, per_stage, w_records=per_stage, wgrad_batch=wgrad_batch, unsplit=_first_stage_unsplit(schedule)
    )


def test_zb_v_over_1f1b_is_what_the_bench_measured_not_1_00() -> None:
    base = max(_bench_peaks("1f1b", 2))
    assert max(peak_memory(build("zb-v", 4, 8), 0.5)) / max(peak_memory(build("1f1b", 4, 8), 1.0)) == 1.0
    assert max(_bench_peaks("zb-v", 2)) / base == pytest.approx(1.25)
    measured = max(MEASURED_BATCHED["zb-v"]) / max(MEASURED_BATCHED["1f1b"])
    assert measured == pytest.approx(1.26, abs=0.005)
    assert max(_bench_peaks("zb-v", 2)) / base == pytest.approx(measured, rel=0.02)
    assert max(_bench_peaks("zb-v", 1)) / base == pytest.approx(max(MEASURED_BATCH_1["zb-v"]) / 1.25, rel=0.02)


@pytest.mark.parametrize("name", sorted(MEASURED_BATCHED))
def test_every_workers_simulated_peak_is_within_2_percent_of_the_bench(name: str) -> None:
    for wgrad_batch, table in ((2, MEASURED_BATCHED), (1, MEASURED_BATCH_1)):
        if name not in table:
            continue
        simulated = [p * UNIT_MIB for p in _bench_peaks(name, wgrad_batch)]
        # The table rounds to 0.01 MiB; the blocks' LayerNorm statistics add 0.1% that the unit leaves out.
        assert simulated == pytest.approx(table[name], rel=0.02, abs=0.011)


schedules_and_costs = st.fixed_dictionaries(
    {
        "name": st.sampled_from(SCHEDULES),
        "workers": st.integers(1, 4),
        "microbatches": st.integers(1, 8),
        "seed": st.integers(0, 2**16),
        "wgrad_batch": st.integers(1, 3),
    }
)


def _built(case: dict) -> tuple:
    k, m = case["workers"], case["microbatches"]
    for v in (1, 2):
        try:
            schedule = build_for(case["name"], k * v, k, m)
            break
        except ScheduleError:
            continue
    else:
        return None, None, None
    gen = torch.Generator().manual_seed(case["seed"])
    n = schedule.num_stages
    costs = [(torch.rand(n, generator=gen) + 0.1).tolist() for _ in range(4)]
    times = simulate_times(schedule, *costs[:3])
    return schedule, times, costs[3]


@settings(max_examples=60, deadline=None)
@given(schedules_and_costs, st.lists(st.floats(0.0, 3.0), min_size=8, max_size=8))
def test_counting_w_records_never_lowers_a_peak(case: dict, records: list[float]) -> None:
    schedule, times, act = _built(case)
    if schedule is None:
        return
    w = records[: schedule.num_stages]
    without = peak_memory(schedule, act, times=times)
    with_records = peak_memory(schedule, act, times=times, w_records=w, wgrad_batch=case["wgrad_batch"])
    assert all(b >= a - 1e-9 for a, b in zip(without, with_records))
    if not schedule.split_backward:
        assert with_records == without


# -- greedy and search keep to a limit that counts W records -----------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(1, 4),
    m=st.integers(1, 8),
    width=st.integers(1, 3),
    costs=st.lists(st.floats(0.1, 2.0), min_size=20, max_size=20),
    slack=st.floats(1.0, 3.0),
)
def test_the_greedy_schedule_keeps_to_a_limit_that_counts_w_records(
    k: int, m: int, width: int, costs: list[float], slack: float
) -> None:
    f, b, w, act, rec = (costs[i * 4 : i * 4 + k] for i in range(5))
    limit = slack * max(max(a, r) + (width - 1) * r for a, r in zip(act, rec))
    schedule = greedy_schedule(k, m, f, b, w, 0.0, act, limit, None, w_records=rec, wgrad_batch=width)
    peaks = peak_memory(schedule, act, times=simulate_times(schedule, f, b, w), w_records=rec, wgrad_batch=width)
    assert max(peaks) <= limit * (1 + 1e-9)


def test_the_greedy_schedule_refuses_a_limit_an_open_batch_cannot_fit() -> None:
    with pytest.raises(ScheduleError, match="2 micro-batches' W records .* wgrad_batch=3"):
        greedy_schedule(2, 4, memory_limit=2.5, w_records=1.0, wgrad_batch=3)
    greedy_schedule(2, 4, memory_limit=3.0, w_records=1.0, wgrad_batch=3)  # exactly enough


def test_the_search_drops_a_schedule_that_fits_only_while_records_are_left_out() -> None:
    costs = StageCosts.uniform(4, forward=1.0, backward=1.0, weight=1.0)
    free = search(costs, 4, 8, memory_limit=4.0, greedy=False)
    assert {c.name for c in free.candidates if c.fits} >= {"1f1b", "zb-h1"}
    held = search(costs, 4, 8, memory_limit=4.0, greedy=False, w_records=1.0, wgrad_batch=2)
    zb = next(c for c in held.candidates if c.name == "zb-h1")
    assert max(zb.peak_memory) == 5.0 and not zb.fits
    assert max(held.chosen.peak_memory) <= 4.0
    with pytest.raises(ScheduleError, match="wgrad_batch"):
        search(costs, 4, 8, w_records=1.0, wgrad_batch=0)


# -- the device model --------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(schedules_and_costs, st.lists(st.integers(0, 10**6), min_size=16, max_size=16))
def test_the_model_without_static_parts_is_peak_memory_and_its_parts_sum_to_it(case: dict, sizes: list[int]) -> None:
    schedule, times, _ = _built(case)
    if schedule is None:
        return
    n = schedule.num_stages
    act, rec = sizes[:n], sizes[8 : 8 + n]
    stages = [_stage(activation=a, w_records=r, gradients=0) for a, r in zip(act, rec)]
    devices = predict_memory(schedule, stages, times=times, wgrad_batch=case["wgrad_batch"], input_grad=True)
    expected = peak_memory(
        schedule, [float(a) for a in act], times=times, w_records=rec, wgrad_batch=case["wgrad_batch"]
    )
    for device, peak in zip(devices, expected):
        assert device.total == sum(device.parts.values())
        assert abs(device.total - peak) <= 2  # parts are rounded to whole bytes one by one


def test_gradients_join_at_the_end_of_the_first_combined_backward() -> None:
    # F0 F1 BW1 BW0: BW1 frees its own activation as it writes the sums, so they peak at one end of it.
    gpipe = build("gpipe", 1, 2)
    assert _dynamic(predict_memory(gpipe, [_stage(activation=10, gradients=15)])) == [25]  # 10 + 15 after BW1
    assert _dynamic(predict_memory(gpipe, [_stage(activation=10, gradients=5)])) == [20]  # both activations


def test_gradients_join_at_the_start_of_the_first_w_which_frees_its_records_last() -> None:
    # F0 B0 W0: W0 writes the sums while the records it reads stay alive: 20 + 15 before it ends.
    devices = predict_memory(build("zb-h1", 1, 1), [_stage(activation=10, w_records=20, gradients=15)], input_grad=True)
    assert _dynamic(devices) == [35]
    assert devices[0].w_records == 20 and devices[0].gradients == 15


@pytest.mark.parametrize(("checkpoint", "peak"), [("never", 44), ("always", 14), ("except_last", 14)])
def test_recompute_keeps_only_the_input_until_the_backward(checkpoint: str, peak: int) -> None:
    # GPipe, 4 micro-batches: input 1 and activation 10 each. Recompute holds 4 inputs, then one
    # micro-batch's activation again during its backward; except_last keeps the last one's activation.
    stage = _stage(activation=10, input=1, gradients=0)
    devices = predict_memory(build("gpipe", 1, 4), [stage], checkpoint=checkpoint, first_input=True)
    assert _dynamic(devices) == [peak]


def test_a_skip_counts_on_its_producer_and_consumer_only() -> None:
    schedule = build("1f1b", 3, 6)
    in_flight = [3, 2, 1]  # 1F1B's micro-batches in flight per worker
    devices = predict_memory(schedule, [_stage()] * 3, skips=[(0, 2, 100)])
    # Handed over (Pipe's threads): at t=8 of unit costs the producer holds micro-batches 0-2's
    # stashes and the gradients of 0 and 1, which wait for its backward; the consumer its copies.
    assert [d.skips for d in devices] == [in_flight[0] * 100 + 200, 0, in_flight[2] * 100]
    buffered = predict_memory(schedule, [_stage()] * 3, skips=[(0, 2, 100)], skip_buffers=True)
    assert [d.skips for d in buffered] == [in_flight[0] * 100, 0, 0]  # gloo: the rest in receive buffers


def test_a_split_consumer_keeps_its_skip_until_its_w() -> None:
    schedule = build("zb-h1", 2, 2)
    skips = [(0, 1, 100)]
    split = predict_memory(schedule, [_stage()] * 2, skips=skips, input_grad=True)
    combined = predict_memory(build("1f1b", 2, 2), [_stage()] * 2, skips=skips, input_grad=True)
    assert split[1].skips > combined[1].skips == 100


def test_a_skip_within_one_device_is_one_tensor_held_until_both_stages_let_go() -> None:
    # zb-v on one worker, 2 micro-batches: F0s0 F0s1 B0s1 W0s1 F1s0 B0s0 ... The stash is one tensor
    # from F(0) to the later of B(0) and W(1), not a copy on each stage; its gradient waits from
    # B(1) to B(0). While B0s0 runs: both stashes and micro-batch 0's gradient.
    (device,) = predict_memory(build("zb-v", 1, 2), [_stage()] * 2, skips=[(0, 1, 100)], input_grad=True)
    assert device.skips == 300
    apart = predict_memory(build("zb-v", 2, 1), [_stage()] * 4, skips=[(0, 1, 100)], input_grad=True)
    assert [d.skips for d in apart] == [200, 100]  # across devices each holds its own; the producer its gradient


@pytest.mark.parametrize(
    ("spec", "factor"),
    [(None, 0.0), ("none", 0.0), ("sgd", 0.0), ("momentum", 1.0), ("Adam", 2.0), ("adamw", 2.0), (1.5, 1.5)],
)
def test_optimizer_state_per_parameter_byte_by_name(spec: object, factor: float) -> None:
    assert optimizer_factor(spec) == factor  # type: ignore[arg-type]


def test_optimizer_state_of_torch_optimizers() -> None:
    p = [nn.Parameter(torch.zeros(4, 4)), nn.Parameter(torch.zeros(12))]
    assert optimizer_factor(torch.optim.Adam(p)) == 2.0
    assert optimizer_factor(torch.optim.AdamW(p, amsgrad=True)) == 3.0
    assert optimizer_factor(torch.optim.SGD(p, lr=0.1)) == 0.0
    assert optimizer_factor(torch.optim.SGD(p, lr=0.1, momentum=0.9)) == 1.0
    rms = torch.optim.RMSprop(p)  # a kind the model has no rule for: counted from the state it holds
    with pytest.raises(ValueError, match="holds no state yet.*optimizer="):
        optimizer_factor(rms)
    for q in p:
        q.grad = torch.ones_like(q)
    rms.step()
    held = sum(t.numel() * t.element_size() for s in rms.state.values() for t in s.values())
    assert optimizer_factor(rms) == held / (28 * 4)
    for bad in ("lion", -1.0, float("inf"), True):
        with pytest.raises(ValueError):
            optimizer_factor(bad)  # type: ignore[arg-type]


def test_static_parts_fill_each_device() -> None:
    stages = [_stage(parameters=1000, gradients=800, optimized=600), _stage(parameters=500)]
    devices = predict_memory(build("1f1b", 2, 4), stages, optimizer="adam", receive_buffers=[7, 9])
    assert [d.optimizer for d in devices] == [1200, 1000]
    assert [d.receive_buffers for d in devices] == [7, 9]
    assert [d.parameters for d in devices] == [1000, 500]
    assert [d.gradients for d in devices] == [800, 500]


def test_an_asynchronous_stream_holds_the_stashed_weight_versions() -> None:
    stream = build_multistep(2, 2, 4, flush=False)
    copies = weight_versions(stream)["stash"]
    assert copies[0] >= 1
    devices = predict_memory(stream, [_stage(parameters=1000), _stage(parameters=300)], weight_policy="stash")
    assert [d.weight_versions for d in devices] == [copies[0] * 1000, copies[1] * 300]
    synced = predict_memory(stream, [_stage(parameters=1000), _stage(parameters=300)], weight_policy="sync")
    assert [d.weight_versions for d in synced] == [0, 0]


def test_bad_inputs_are_refused_by_name() -> None:
    schedule = build("1f1b", 2, 4)
    with pytest.raises(ValueError, match="one per stage"):
        predict_memory(schedule, [_stage()])
    with pytest.raises(ValueError, match="checkpoint"):
        predict_memory(schedule, [_stage()] * 2, checkpoint="sometimes")
    with pytest.raises(ValueError, match="weight_policy"):
        predict_memory(schedule, [_stage()] * 2, weight_policy="guess")
    with pytest.raises(ValueError, match="StageBytes.activation"):
        _stage(activation=-1)


def test_a_device_prints_its_parts_with_units_and_a_limit_names_the_one_over_it() -> None:
    d = DeviceMemory(2, (2, 5), 3 * 2**30, 0, 3 * 2**29, 5 * MIB, 0, 0, 0, 0, 0)
    assert str(d) == "device 2 (stages 2, 5): 4.50 GiB (parameters 3.00 GiB, optimizer 1.50 GiB, activations 5.00 MiB)"
    assert PARTS[0] == "parameters" and len(PARTS) == 11
    require_fit([d], d.total)
    with pytest.raises(ValueError, match=r"device 2 \(stages 2, 5\) needs at least 4.50 GiB.*parameters 3.00 GiB"):
        require_fit([d], 4 * 2**30)


# -- measured stage bytes ----------------------------------------------------------------------------


def _issue_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))


def test_the_split_backward_of_the_issues_mlp_keeps_5_mib_until_w() -> None:
    # 512 fp32 tokens: saved 0.5 (input) + 2 (GELU's input) + 2 (second Linear's input) = 4.5 MiB;
    # after B the records hold per Linear x and dy: 0.5 + 2 and 2 + 0.5 = 5.0 MiB, the input among them.
    (stage,) = measure_stages(_issue_mlp(), [3], torch.randn(512, 256), transients=False)
    output = 512 * 256 * 4
    assert stage.input + stage.activation - output == 4.5 * MIB
    assert stage.input + stage.w_records == 5.0 * MIB
    assert stage.w_kept == output  # the outputs W keeps; the graph itself was freed by B
    assert stage.w_stacked == 2.5 * MIB  # one Linear's x and dy


def test_a_layer_left_for_w_keeps_the_graph_until_w() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv1d(8, 8, 3, padding=1), nn.GELU(), nn.Conv1d(8, 8, 3, padding=1))
    (stage,) = measure_stages(conv, [3], torch.randn(16, 8, 64), transients=False)
    # No Linear defers: B retains the graph for the weights' W, so what it saved lives until W.
    assert stage.w_records == 0
    assert stage.w_kept >= stage.activation


class _Head(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def _tied() -> nn.Sequential:
    torch.manual_seed(0)
    embedding = nn.Embedding(100, 16)
    return nn.Sequential(embedding, nn.Linear(16, 16), _Head(embedding))


def test_a_tied_weight_is_counted_once_per_stage_and_stepped_once() -> None:
    tokens = torch.randint(0, 100, (4, 8))
    weight = 100 * 16 * 4
    linear = (16 * 16 + 16) * 4
    (one,) = measure_stages(_tied(), [3], tokens, transients=False)
    assert one.parameters == weight + linear and one.stepped == weight + linear
    first, second = measure_stages(_tied(), [2, 1], tokens, transients=False)
    assert second.parameters == second.trainable == weight  # the reader's copy, and its gradient
    assert second.stepped == 0  # the optimizer steps the owner's tensor only
    devices = predict_memory(build("1f1b", 2, 2), [first, second], optimizer="adam")
    assert sum(d.optimizer for d in devices) == 2 * (weight + linear)


def test_predicted_peaks_are_within_3_percent_of_the_counted_ones() -> None:
    pytest.importorskip("fastpipe.memory._cpu_counter")
    from fastpipe import Pipe
    from fastpipe.memory.accounting import PeakMeter

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out * target).mean()

    install_counter_or_skip()  # counts from here on, before any tensor of the runs below exists
    h, m, rows = 64, 4, 32
    for name, checkpoint, batch, input_grad in [
        ("1f1b", "never", 1, False),
        ("gpipe", "never", 1, True),
        ("gpipe", "always", 1, False),
        ("zb-h1", "never", 2, True),
    ]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h), nn.LayerNorm(h), nn.Linear(h, h))
        x, y = torch.randn(m * rows, h).requires_grad_(input_grad), torch.randn(m * rows, h)
        pipe = Pipe(model, [5], chunks=m, checkpoint=checkpoint, schedule=name, wgrad_batch=batch)
        try:
            pipe.train_step(x, y, loss)  # the first step builds what later steps reuse
            pipe.zero_grad(set_to_none=True)
            x.grad = None
            gc.collect()
            with PeakMeter("cpu") as meter:
                pipe.train_step(x, y, loss)
        finally:
            pipe.close()
        sample = x[:rows].detach().requires_grad_(input_grad)
        stages = measure_stages(model, [5], sample, loss_fn=loss, target=y[:rows])
        (device,) = predict_memory(
            build(name, 1, m), stages, checkpoint=checkpoint, wgrad_batch=batch, input_grad=input_grad
        )
        predicted = device.total - device.parameters
        assert predicted == pytest.approx(meter.result.peak, rel=0.03), (name, checkpoint, batch, str(device))


class _Add(nn.Module):
    def forward(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        return x + a


def test_a_skip_is_measured_apart_from_the_stages_it_crosses() -> None:
    torch.manual_seed(0)
    model = fastpipe.Sequential(
        nn.Linear(16, 16), fastpipe.stash("a"), nn.Linear(16, 16), nn.Identity(), fastpipe.pops(_Add(), "a")
    )
    x = torch.randn(8, 16)
    whole = measure_stages(model, [5], x, transients=False)
    first, middle, last = measure_stages(model, [2, 2, 1], x, transients=False)
    skip = 8 * 16 * 4
    # Across stages the stash is a skip, counted on its own (fastpipe.model.skip_memory): the first
    # stage's output is that very tensor, so the stage counts no activation of its own; the last
    # stage's popped skip is not in its activation either, only its output is.
    assert first.activation == 0 and first.w_records == skip  # the Linear's dy; its x is the input
    assert middle.activation == skip and middle.input == skip  # its output; the Linear saved its input
    assert last.activation == skip and last.input == skip
    # Within one stage the stash is a local value: the tensor counts once, as an activation.
    assert whole[0].activation == 2 * skip
