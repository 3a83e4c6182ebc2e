"""Offload in the memory model: host bytes apart from the device's, the guard's prediction, ``"auto"``."""

import pytest
import torch
from _memory_utils import ProductLoss, install_counter_or_skip
from torch import nn

from fastpipe import Pipe
from fastpipe.memory.limit import MARGIN
from fastpipe.memory.model import PARTS, DeviceMemory, StageBytes, predict_memory
from fastpipe.memory.offload import PipeOffload
from fastpipe.memory.offload_bytes import copy_bandwidth, copy_costs
from fastpipe.runtime.host_copies import CopyPath
from fastpipe.runtime.offload import OffloadPolicy
from fastpipe.runtime.stage import Stage
from fastpipe.schedule import build, simulate
from fastpipe.schedule.prefetch import with_prefetch, worth_prefetching


def every_pair(s):
    return [(st, m) for st in range(s.num_stages) for m in range(s.num_microbatches)]


def test_offloaded_bytes_leave_the_device_from_forward_end_to_prefetch_start_and_count_as_host():
    # One stage, gpipe, 4 micro-batches: F0 F1 F2 F3 [P2] BW3 [P1] BW2 [P0] BW1 BW0, unit costs.
    base = build("gpipe", 1, 4)
    sched = with_prefetch(base, worth_prefetching(base, every_pair(base)))
    assert sched.prefetched == {(0, 0), (0, 1), (0, 2)}
    plain = StageBytes(parameters=0, activation=100)
    (without,) = predict_memory(sched, [plain])
    (offloaded,) = predict_memory(sched, [StageBytes(parameters=0, activation=100, offloaded=60)])
    assert without.activations == 400 and without.offloaded == 0
    # At the end of F3: its 100, three micro-batches at 40, and micro-batch 2 coming back (60).
    assert offloaded.activations == 100 + 3 * 40 + 60
    assert offloaded.offloaded == 3 * 60  # host bytes, apart from the device's total
    assert offloaded.total == offloaded.activations and len(PARTS) == 11 and "offloaded" not in PARTS
    assert str(offloaded).endswith("; host 180 B offloaded")


def test_without_a_prefetch_nothing_is_offloaded_in_the_model():
    base = build("gpipe", 1, 4)
    (a,) = predict_memory(base, [StageBytes(parameters=0, activation=100)])
    (b,) = predict_memory(base, [StageBytes(parameters=0, activation=100, offloaded=60)])
    assert a == b


def test_a_recomputed_micro_batch_offloads_nothing_in_the_model():
    base = build("gpipe", 1, 4)
    sched = with_prefetch(base, every_pair(base))
    (a,) = predict_memory(sched, [StageBytes(parameters=0, activation=100, input=10)], checkpoint="always")
    (b,) = predict_memory(
        sched, [StageBytes(parameters=0, activation=100, input=10, offloaded=60)], checkpoint="always"
    )
    assert a == b


def test_the_guard_counts_what_the_runtime_offloads(monkeypatch):
    install_counter_or_skip()
    torch.manual_seed(0)
    layers = [m for _ in range(2) for m in (nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))]
    x, y = torch.randn(32, 16), torch.randn(32, 16)
    pipe = Pipe(nn.Sequential(*layers), [3, 3], chunks=4, checkpoint="never", schedule="gpipe", memory_limit="1TiB")
    pipe.train_step(x, y, ProductLoss())
    before = pipe.memory_guard.last
    sent: list[int] = []
    original = CopyPath.to_host
    monkeypatch.setattr(
        CopyPath, "to_host", lambda path, t: (sent.append(t.numel() * t.element_size()), original(path, t))[1]
    )
    for stage in pipe._stages:
        stage.offload = OffloadPolicy(0.5, force=True)
    pipe.train_step(x, y, ProductLoss())
    after = pipe.memory_guard.last
    assert sum(d.activations for d in after) < sum(d.activations for d in before)
    assert all(d.offloaded > 0 for d in after)
    # What the model takes per micro-batch is what the runtime sent: 3 micro-batches per stage offload.
    per_stage = [
        st.offloaded
        for st in pipe._offload.bytes.stage_bytes(
            [StageBytes(parameters=0, activation=1 << 30)] * 2, x[:8], y[:8], ProductLoss()
        )
    ]
    assert sum(sent) == 3 * sum(per_stage) and all(per_stage)
    assert max(d.total for d in after) * (1 + MARGIN) < pipe.memory_guard.limit


class _Guard:
    """A memory guard whose device 0 needs 1000 bytes less 800 per unit of its stage's offload."""

    limit = 735  # fits a prediction of 700 with the margin: device 0 needs a fraction of 3/8 or more

    def __init__(self, stages):
        self.stages, self.offload, self.asked = stages, None, []

    def predict(self, layers, balance, schedule, checkpoint, wgrad_batch, sample, target, loss_fn):
        self.asked.append(checkpoint)
        policy = self.stages[0].offload
        need = 1000 - 800 * (policy.fraction if policy else 0.0)
        return [
            DeviceMemory(0, (0,), int(need), 0, 0, 0, 0, 0, 0, 0, 0),
            DeviceMemory(1, (1,), 500, 0, 0, 0, 0, 0, 0, 0, 0),
        ]


def test_auto_takes_per_device_the_least_fraction_that_fits():
    stages = [Stage(nn.Sequential(nn.Linear(2, 2), nn.GELU()), torch.device("meta")) for _ in range(2)]
    guard = _Guard(stages)
    offload = PipeOffload("auto", stages, guard)  # type: ignore[arg-type]
    assert guard.offload is offload.bytes
    sched = offload.for_step(build("gpipe", 2, 4), torch.zeros(1, 2), None, ProductLoss(), "auto")
    assert stages[0].offload == OffloadPolicy(3 / 8) and stages[1].offload is None
    assert sched.prefetched and all(s == 0 for s, _ in sched.prefetched)
    assert set(guard.asked) == {"never"}  # checkpoint="auto" is chosen after the offload, assuming none


def test_auto_without_a_limit_offloads_nothing():
    stages = [Stage(nn.Sequential(nn.Linear(2, 2)), torch.device("meta"))]
    offload = PipeOffload("auto", stages)
    sched = build("gpipe", 1, 4)
    assert offload.for_step(sched, torch.zeros(1, 2), None, ProductLoss(), "never") is sched
    assert stages[0].offload is None


def test_copy_bandwidth_is_measured_and_prices_the_simulated_copies():
    bandwidth = copy_bandwidth("cpu", nbytes=1 << 20, repeats=2)
    assert 0 < bandwidth.to_host < float("inf") and 0 < bandwidth.to_device < float("inf")
    assert "GiB/s" in str(bandwidth)
    prefetch, offload = copy_costs([1 << 20, 0], bandwidth)
    assert prefetch[0] == pytest.approx((1 << 20) / bandwidth.to_device) and prefetch[1] == 0.0
    assert offload[0] == pytest.approx((1 << 20) / bandwidth.to_host)
    base = build("1f1b", 2, 4)
    sched = with_prefetch(base, worth_prefetching(base, every_pair(base)))
    assert simulate(sched, 1.0, 1.0, 1.0, prefetch=prefetch, offload=offload).makespan >= simulate(base).makespan
    with pytest.raises(ValueError, match="nbytes >= 1"):
        copy_bandwidth("cpu", nbytes=0)


def test_auto_recompute_and_auto_offload_are_chosen_together_least_recompute_first():
    # Four CPU stages made movable. Under 330000 bytes, no offload lets "never", every other layer or
    # "except_last" fit (a stage whose backward follows its forward gains nothing from it), and
    # every layer (here each stage's one layer: "always") fits without any: the pipe recomputes
    # that and offloads nothing, rather than offloading all it can for "never" first.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32)) for _ in range(4)]
    x, y = torch.randn(4 * 64, 32), torch.randn(4 * 64, 32)
    pipe = Pipe(nn.Sequential(*blocks), [1, 1, 1, 1], chunks=4, memory_limit=330000, offload="auto")
    pipe._offload.movable = [True] * 4
    pipe.train_step(x, y, ProductLoss())
    assert str(pipe.checkpoint_chosen) == "every layer"
    assert [st.offload for st in pipe._stages] == [None] * 4
    assert all(d.total * (1 + MARGIN) <= 330000 and d.offloaded == 0 for d in pipe.memory_guard.last)
