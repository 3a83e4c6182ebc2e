"""Sharded checkpoints of stages sharded with FSDP2 (``dp_shard="fsdp"``, 4 gloo ranks).

A 2x2 (pp=2, dp=2) checkpoint holds each rank's DTensor shards once and loads, bit for bit, into
4 pipeline ranks, 1 stage over 4 shards, replicas, a local Pipe and the plain Sequential; a
replicated one loads sharded. One more step from the loaded state is the uninterrupted run's. A
damaged shard is refused by name and resume falls back to the previous complete checkpoint.
One spawn of the 4 ranks serves every test of the module.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.checkpoint import dcp
from fastpipe.checkpoint.commit import CheckpointCorruptError, latest, step_dir

TIMEOUT = 20.0
# Widths whose rows do not split evenly over 2 or 4 shards: 13 rows as 7+6 or 4+4+4+1; the
# last layer's 3 rows leave rank 3 of 4 an empty shard.
WIDTHS = [16, 13, 16, 7, 3]
# Reductions from input to loss (the Linears' inputs, the mean over 8 x 3 outputs) plus the 8
# rows a weight gradient sums over, for results whose arithmetic differs (another D, one
# process with its own thread count).
K = sum(WIDTHS[:-1]) + 8 * 3 + 8
LAYOUTS = {  # name: (dp_shard, (pp, dp), balance)
    "2x2 fsdp": ("fsdp", (2, 2), [2, 2]),
    "4x1 fsdp": ("fsdp", (4, 1), [1, 1, 1, 1]),
    "1x4 fsdp": ("fsdp", (1, 4), [4]),
    "2x2 replicate": ("replicate", (2, 2), [2, 2]),
}


def model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(WIDTHS, WIDTHS[1:])])


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, WIDTHS[0], generator=g), torch.randn(8, WIDTHS[-1], generator=g)


def train(pipe: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Adam steps of MSE, each replica on the whole batch (so any D computes the same gradient)."""
    losses = []
    for step in steps:
        x, y = batch(step)
        opt.zero_grad(set_to_none=True)
        if isinstance(pipe, Pipe):
            loss = pipe.train_step(x, y, nn.MSELoss())
        elif isinstance(pipe, nn.Sequential):
            loss = nn.MSELoss()(pipe(x), y)
            loss.backward()
        else:
            loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        opt.step()
        losses.append(loss.item())
    return losses


def tied(seed: int) -> nn.Sequential:
    """The last layer's weight is the first's (an embedding tied to the head, in miniature)."""
    torch.manual_seed(seed)
    first, last = nn.Linear(WIDTHS[0], WIDTHS[0]), nn.Linear(WIDTHS[0], WIDTHS[0])
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(WIDTHS[0], WIDTHS[0]), nn.Tanh(), last)


def _train_tied(pipe: Any, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = batch(step)[0], batch(step + 50)[0]
        opt.zero_grad(set_to_none=True)
        losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss()).item())
        opt.step()
    return losses


def _tied_round_trip(mesh: Any, folder: str, rank: int) -> dict[str, Any]:
    """A weight tied across the two stages, sharded on both: saved, loaded into fresh pipes, one more step."""
    from fastpipe.distributed_pipe import DistributedPipe

    out: dict[str, Any] = {}
    for name, seed in (("saved", 0), ("loaded", rank + 1)):
        pipe = DistributedPipe(tied(seed), [2, 3], chunks=2, mesh=mesh, dp_shard="fsdp", timeout=TIMEOUT)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        if name == "saved":
            _train_tied(pipe, opt, range(2))
            dcp.save(pipe, folder, opt, timeout=TIMEOUT)
            out["entries"] = sorted(dcp._dcp().FileSystemReader(folder).read_metadata().state_dict_metadata)
        else:
            dcp.load(folder, pipe, opt, timeout=TIMEOUT)
        out[name] = full_state(pipe, opt), _train_tied(pipe, opt, range(2, 3))
        pipe.close()
    return out


def full_state(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The parameters and optimizer state this rank holds, whole (a DTensor's shards gathered), by name."""
    from torch.distributed.tensor import DTensor

    def whole(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    out = {f"model.{k}": whole(v) for k, v in module.state_dict().items()}
    names = {id(p): n for n, p in module.named_parameters()}
    for p, state in opt.state.items():
        out.update({f"optim.{names[id(p)]}.{k}": whole(v) for k, v in state.items()})
    return out


def _pipe(layout: str, meshes: dict[tuple[int, int], Any], seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from fastpipe.distributed_pipe import DistributedPipe

    dp_shard, shape, balance = LAYOUTS[layout]
    pipe = DistributedPipe(model(seed), balance, chunks=2, mesh=meshes[shape], dp_shard=dp_shard, timeout=TIMEOUT)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=1e-2)


def _save_reshard_and_resume(rank: int, world: int, root: str, replicated_root: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {shape: init_device_mesh("cpu", shape, mesh_dim_names=("pp", "dp")) for shape in [(2, 2), (4, 1), (1, 4)]}
    out: dict[str, Any] = {}
    pipe, opt = _pipe("2x2 fsdp", meshes, seed=0)
    train(pipe, opt, range(2))
    pending = fastpipe.save_checkpoint(root, pipe, opt, 2, asynchronous=True, timeout=TIMEOUT)
    assert isinstance(pending, dcp.PendingSave)
    out["saved"] = full_state(pipe, opt)
    out["uninterrupted"] = train(pipe, opt, range(2, 3)), full_state(pipe, opt)  # while the save is written
    pending.wait()
    fastpipe.save_checkpoint(root, pipe, opt, 3, timeout=TIMEOUT)
    pipe.close()

    for layout in LAYOUTS:
        again, opt2 = _pipe(layout, meshes, seed=rank + 1)
        dcp.load(step_dir(root, 2), again, opt2, timeout=TIMEOUT)
        loaded = full_state(again, opt2)
        if layout == "2x2 replicate":  # and back: the replicas' checkpoint loads into shards below
            fastpipe.save_checkpoint(replicated_root, again, opt2, 2, timeout=TIMEOUT)
        out[layout] = loaded, train(again, opt2, range(2, 3)), full_state(again, opt2)
        again.close()
    again, opt2 = _pipe("2x2 fsdp", meshes, seed=rank + 7)
    resumed = fastpipe.resume_or_start(replicated_root, again, opt2, timeout=TIMEOUT)
    out["replicated to 2x2 fsdp"] = full_state(again, opt2), train(again, opt2, range(2, 3)), full_state(again, opt2)
    out["replicated step"] = resumed["step"]
    again.close()

    out["tied"] = _tied_round_trip(meshes[2, 2], os.path.join(replicated_root, "tied"), rank)

    # The newest checkpoint's shard of rank 3 (stage 1's second half of the rows) loses a bit.
    dist.barrier()
    if rank == 0:
        shard = os.path.join(step_dir(root, 3), "__3_0.distcp")
        data = bytearray(open(shard, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(shard, "wb").write(bytes(data))
    dist.barrier()
    again, opt2 = _pipe("2x2 fsdp", meshes, seed=rank + 9)
    try:
        dcp.load(step_dir(root, 3), again, opt2, timeout=TIMEOUT)
    except CheckpointCorruptError as exc:
        out["refused"] = exc.path
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = fastpipe.resume_or_start(root, again, opt2, timeout=TIMEOUT)
    out["fallback"] = resumed["step"], [str(w.message) for w in seen], full_state(again, opt2)
    again.close()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[dict[str, Any]]]:
    root, replicated_root = str(tmp_path_factory.mktemp("fsdp")), str(tmp_path_factory.mktemp("replicated"))
    return root, check_ok(run_ranks(_save_reshard_and_resume, 4, root, replicated_root, timeout=240))


def _whole(ranks: list[dict[str, Any]], pick: Any) -> dict[str, torch.Tensor]:
    """Every rank's share merged into the whole model's; the ranks that hold one key agree on it bitwise."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for key, value in pick(r).items():
            assert key not in merged or torch.equal(merged[key], value), f"ranks disagree on {key}"
            merged[key] = value
    return merged


def _equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), key


def _close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert_close_reordered(actual[key], value, k=K, msg=key)


def test_every_replica_writes_its_own_rows_and_no_entry_twice(run) -> None:
    root, _ = run
    folder = step_dir(root, 2)
    metadata = dcp._dcp().FileSystemReader(folder).read_metadata()
    files = sorted(n for n in os.listdir(folder) if n.endswith(".distcp"))
    assert files == [f"__{r}_0.distcp" for r in range(4)]
    written = sum(os.path.getsize(os.path.join(folder, n)) for n in files)
    # Each byte written is an entry of DCP's index: no replica wrote a replicated entry
    # (Adam's step, the hyper-parameters) a second time.
    assert sum(info.length for info in metadata.storage_data.values()) == written
    for rank in range(4):  # each rank wrote its shards: nothing was gathered to one writer
        assert any(
            index.fqn.startswith("model.")
            for index, info in metadata.storage_data.items()
            if info.relative_path == f"__{rank}_0.distcp"
        )
    entries = metadata.state_dict_metadata
    for key in ("model.0.0.weight", "optim.state.3.0.weight.exp_avg", "optim.state.1.0.bias.exp_avg_sq"):
        size = entries[key].size[0]
        first = -(-size // 2)  # FSDP2's rows for the first replica: torch.chunk's
        assert sorted((c.offsets[0], c.sizes[0]) for c in entries[key].chunks) == [(0, first), (first, size - first)]
    assert len(entries["optim.state.0.0.weight.step"].chunks) == 1


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_sharded_checkpoint_loads_bitwise_into_any_layout(run, layout: str) -> None:
    _, ranks = run
    _equal(_whole(ranks, lambda r: r[layout][0]), _whole(ranks, lambda r: r["saved"]))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_more_step_after_loading_is_the_uninterrupted_runs(run, layout: str) -> None:
    _, ranks = run
    loss = ranks[0]["uninterrupted"][0]
    assert all(r["uninterrupted"][0] == loss for r in ranks)
    expected = _whole(ranks, lambda r: r["uninterrupted"][1])
    after = _whole(ranks, lambda r: r[layout][2])
    if layout == "2x2 fsdp":  # the layout saved: the same arithmetic
        assert all(r[layout][1] == loss for r in ranks)
        _equal(after, expected)
    else:
        for r in ranks:
            assert_close_reordered(torch.tensor(r[layout][1]), torch.tensor(loss), k=K)
        _close(after, expected)


def test_a_replicated_checkpoint_loads_sharded(run) -> None:
    _, ranks = run
    assert all(r["replicated step"] == 2 for r in ranks)
    saved = _whole(ranks, lambda r: r["saved"])
    _equal(_whole(ranks, lambda r: r["replicated to 2x2 fsdp"][0]), saved)
    # The replicas held the sharded run's exact state, and run the sharded step again.
    assert all(r["replicated to 2x2 fsdp"][1] == r["uninterrupted"][0] for r in ranks)
    _equal(_whole(ranks, lambda r: r["replicated to 2x2 fsdp"][2]), _whole(ranks, lambda r: r["uninterrupted"][1]))


def test_a_sharded_checkpoint_loads_into_a_local_pipe_and_the_plain_sequential(run) -> None:
    root, ranks = run
    saved = _whole(ranks, lambda r: r["saved"])
    expected = _whole(ranks, lambda r: r["uninterrupted"][1])
    loss = ranks[0]["uninterrupted"][0]
    local = Pipe(model(seed=21), [1, 3], chunks=2)
    plain = model(seed=22)
    try:
        for module in (local, plain):
            opt = torch.optim.Adam(module.parameters(), lr=1e-2)
            dcp.load(step_dir(root, 2), module, opt)
            _equal(full_state(module, opt), saved)
            assert_close_reordered(torch.tensor(train(module, opt, range(2, 3))), torch.tensor(loss), k=K)
            _close(full_state(module, opt), expected)
    finally:
        local.close()


def test_a_damaged_shard_is_refused_by_name_and_resume_falls_back(run) -> None:
    root, ranks = run
    assert latest(root) == step_dir(root, 3)  # its record is intact; its bytes are not
    damaged = os.path.join(step_dir(root, 3), "__3_0.distcp")
    saved = _whole(ranks, lambda r: r["saved"])
    for r in ranks:
        assert r["refused"] == damaged
        step, seen, state = r["fallback"]
        assert step == 2
        assert any("__3_0.distcp" in w and "previous complete checkpoint" in w for w in seen)
    _equal(_whole(ranks, lambda r: r["fallback"][2]), saved)


def test_a_weight_tied_across_sharded_stages_is_saved_once_and_loads_back(run) -> None:
    _, ranks = run
    entries = ranks[0]["tied"]["entries"]
    assert "model.0.weight" in entries and "model.4.weight" not in entries  # saved once, by the owner
    assert not any(k.startswith("optim.state.4.weight.") for k in entries)
    assert "model.4.weight" in _whole(ranks, lambda r: r["tied"]["saved"][0])  # the head's rank holds a copy
    for r in ranks:
        (saved, loss), (loaded, loss_after_load) = r["tied"]["saved"], r["tied"]["loaded"]
        _equal(loaded, saved)  # the copy and its Adam state came back from the owner's entry
        assert loss_after_load == loss
