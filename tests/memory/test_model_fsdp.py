"""The memory model of stages sharded over their replicas (``dp_shard="fsdp"``) against each rank's counted bytes.

4 gloo ranks: 2 pipeline ranks x 2 replicas. Each rank is a process, so the exact CPU counter
(:mod:`fastpipe.memory._cpu_counter`) counts that rank alone, everything it holds included: its
parameter shards, its Adam state, the step's gathered parameters, full-size gradient sums and
reduce-scatter buffers. The prediction is the pipe's own (``memory_limit``), made before the step
runs. One spawn of the ranks serves every test of the module.
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from _memory_utils import install_counter_or_skip, metered_after_a_first_step
from torch import nn

H, M = 64, 4

# (name, schedule, balance, hidden width, rows per micro-batch). A width of 255 rows shards
# unevenly over 2 replicas: FSDP2 pads each shard to 128 rows. With 16 rows every rank peaks as
# its last stage reduce-scatters, the gathered parameters still alive; with 256 (1f1b-256) the
# first stage peaks on its activations, beside the gathered parameters and the other's sums.
CASES = [
    ("gpipe", "gpipe", [2, 2], 255, 16),
    ("1f1b", "1f1b", [2, 2], 255, 16),
    ("1f1b-256", "1f1b", [2, 2], 255, 256),
    ("zb-h1", "zb-h1", [2, 2], 255, 16),
    ("zb-v", "zb-v", [1, 1, 1, 1], 256, 16),
    ("interleaved", "interleaved", [1, 1, 1, 1], 256, 16),
    ("dualpipev", "dualpipev", [1, 1, 1, 1], 256, 16),
]


def model(hidden: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(H, hidden), nn.GELU(), nn.Linear(hidden, H)) for _ in range(4)])


def counted_and_predicted(rank: int, world: int) -> dict[str, Any]:
    """Per case: this rank's counted peak over a step (everything it holds), what it held before the
    step, the pipe's prediction of its device, and the shards measured on its plain stages."""
    from torch.distributed.device_mesh import init_device_mesh

    import fastpipe
    from fastpipe.memory._cpu_counter import install
    from fastpipe.memory.sharded import shard_bytes

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    batches = {rows: (torch.randn(M * rows, H), torch.randn(M * rows, H)) for *_, rows in CASES}
    install()  # after the data (which is not the device's), before the models
    out: dict[str, Any] = {}
    for name, schedule, balance, hidden, rows in CASES:
        x, y = batches[rows]
        pipe = fastpipe.DistributedPipe(
            model(hidden), balance, chunks=M, schedule=schedule, mesh=mesh, dp_shard="fsdp", memory_limit="1TiB"
        )
        opt = torch.optim.Adam(pipe.parameters())  # the state the prediction counts
        peak = metered_after_a_first_step(pipe, opt, x, y)
        assert pipe.memory_guard is not None
        device = pipe.memory_guard.last[mesh.get_local_rank("pp")]
        plain = model(hidden)
        cuts = [sum(balance[:s]) for s in range(len(balance) + 1)]
        whole = [shard_bytes(plain[cuts[s] : cuts[s + 1]], 2, scatter_copies=2) for s in pipe.stages]
        out[name] = {
            "counted": peak.start + peak.peak,
            "between": peak.start,
            "device": device,
            "from_plain": whole,
            "from_shards": [shard_bytes(m, 2, scatter_copies=2) for m in pipe.stages.values()],
        }
        pipe.close()
        del pipe, opt, plain  # the next case counts what its own pipe holds
        gc.collect()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    install_counter_or_skip()  # built here once, so that the ranks only load it
    return check_ok(run_ranks(counted_and_predicted, 4, timeout=600))


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_each_ranks_predicted_peak_is_within_5_percent_of_its_counted_peak(
    ranks: list[dict[str, Any]], name: str
) -> None:
    for rank, got in enumerate(ranks):
        counted, device = got[name]["counted"], got[name]["device"]
        assert device.gathered > 0, device  # the step's gathered parameters are alive at its peak
        assert device.total == pytest.approx(counted, rel=0.05), (name, rank, counted, str(device))


def test_what_a_rank_keeps_between_steps_is_predicted_as_its_padded_shards(ranks: list[dict[str, Any]]) -> None:
    for rank, got in enumerate(ranks):
        for schedule, run in got.items():
            device = run["device"]
            kept = device.parameters + device.optimizer + device.receive_buffers
            # Adam's step counters (a few bytes per tensor) are the rest. The second replica's shards
            # of 255 rows hold 127 of them, the prediction the first's 128: a device at its largest.
            assert kept == pytest.approx(run["between"], rel=0.01 if rank % 2 == 0 else 0.02), (schedule, rank)
            assert kept >= run["between"] - 256, (schedule, rank, kept, run["between"])


def test_a_plain_stage_measures_the_shards_fsdp_makes_of_it(ranks: list[dict[str, Any]]) -> None:
    for got in ranks:
        for run in got.values():
            assert run["from_plain"] == run["from_shards"]
            assert sum(sb.parameters for sb in run["from_shards"]) == run["device"].parameters


def test_shard_figures_out_of_range_are_refused_by_name() -> None:
    from fastpipe.memory.model import StageBytes, predict_memory
    from fastpipe.memory.sharded import ShardBytes, shard_bytes
    from fastpipe.schedule.builders import build

    with pytest.raises(ValueError, match="ShardBytes.shards"):
        ShardBytes(0, 10, 10)
    with pytest.raises(ValueError, match="ShardBytes.trainable"):
        ShardBytes(2, 10, -1)
    with pytest.raises(ValueError, match="shards=0"):
        shard_bytes(model(256), 0)
    with pytest.raises(ValueError, match="1 ShardBytes for a schedule of 2 stages"):
        predict_memory(build("1f1b", 2, M), [StageBytes(8, 8)] * 2, sharded=[ShardBytes(2, 4, 4)])
