"""Sharded checkpoints over gloo ranks: a kill mid-save loses nothing, a resume continues bit for bit,
and one folder loads into 2 ranks, 4 ranks, a local Pipe and the plain Sequential."""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch
from _ckpt_training import HIDDEN, make_model, train
from _dist_utils import check_ok, run_ranks
from _kill_points import die_after_writing_the_shard, die_before_the_record
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.checkpoint import dcp
from fastpipe.checkpoint.commit import latest, read_record, step_dir

TIMEOUT = 15.0
# Reductions from input to loss (8 Linears of HIDDEN inputs, the mean over a batch of 8 x HIDDEN)
# plus the 8 rows a weight gradient sums over. A run in this process against spawned ranks is
# not bitwise: the ranks run one thread each (this process as many as the user's), and zb-h1's
# W stacks two micro-batches into one weight GEMM where 1F1B runs one per micro-batch.
K = 8 * HIDDEN + 8 * HIDDEN + 8


def distributed(
    balance: list[int], schedule: str, dropout: float, seed: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(make_model(seed, dropout), balance, chunks=4, schedule=schedule, timeout=TIMEOUT)
    return pipe, torch.optim.Adam(pipe.parameters(), lr=1e-2)


def _train_save_then_die(rank: int, world: int, root: str) -> dict:
    """3 steps, an asynchronous checkpoint, 3 more steps, then a save during which rank 1 kills itself."""
    torch.manual_seed(1234)
    pipe, opt = distributed([4, 4], "1f1b", 0.1, 0)
    losses = train(pipe, opt, range(3))
    pending = fastpipe.save_checkpoint(root, pipe, opt, 3, state={"losses": losses}, asynchronous=True, timeout=TIMEOUT)
    after = train(pipe, opt, range(3, 6))  # while the checkpoint is written
    assert isinstance(pending, dcp.PendingSave) and pending.wait() == step_dir(root, 3)
    if rank == 1:
        die_after_writing_the_shard()
    try:
        fastpipe.save_checkpoint(root, pipe, opt, 6, state={"losses": losses + after}, timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the survivor reports what it saw
        return {"before": losses, "after": after, "error": f"{type(exc).__name__}: {exc}"}
    return {"before": losses, "after": after, "error": None}


def _resume(rank: int, world: int, root: str, balance: list[int], schedule: str, dropout: float, save: int) -> dict:
    torch.manual_seed(999)  # a fresh process would start elsewhere
    pipe, opt = distributed(balance, schedule, dropout, seed=rank + 5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        resumed = fastpipe.resume_or_start(root, pipe, opt, timeout=TIMEOUT)
    step = resumed["step"]
    losses = train(pipe, opt, range(step, step + 3))
    if save:
        fastpipe.save_checkpoint(root, pipe, opt, step + 3, timeout=TIMEOUT)
        fastpipe.save_checkpoint(root, pipe, opt, step + 3 + save, timeout=TIMEOUT)  # no training between
    return {"step": step, "state": resumed["state"], "losses": losses, "warnings": [str(w.message) for w in seen]}


def _save_twice_rank_0_dies_before_the_record(rank: int, world: int, root: str) -> str:
    pipe, opt = distributed([4, 4], "1f1b", 0.0, 0)
    train(pipe, opt, range(1))
    fastpipe.save_checkpoint(root, pipe, opt, 1, timeout=TIMEOUT)
    if rank == 0:
        die_before_the_record()
    try:
        fastpipe.save_checkpoint(root, pipe, opt, 2, timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the survivor reports what it saw
        return f"{type(exc).__name__}: {exc}"
    return "saved"


def test_rank_0_killed_after_the_shards_before_the_record_leaves_the_previous_checkpoint(tmp_path) -> None:
    root = str(tmp_path)
    outcomes = run_ranks(_save_twice_rank_0_dies_before_the_record, 2, root, timeout=120)
    assert outcomes[0]["exitcode"] == -9
    assert check_ok(outcomes[1:])[0] != "saved"  # the survivor raised instead of hanging
    folder = step_dir(root, 2)
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(os.listdir(folder))  # DCP alone finished
    assert read_record(folder) is None and latest(root) == step_dir(root, 1)
    assert fastpipe.resume_or_start(root, make_model(seed=2))["step"] == 1


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> tuple[str, list[dict]]:
    root = str(tmp_path_factory.mktemp("killed"))
    return root, run_ranks(_train_save_then_die, 2, root, timeout=120)


def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint(killed_run) -> None:
    root, outcomes = killed_run
    assert outcomes[1]["exitcode"] == -9  # SIGKILL from inside its save
    survivor = check_ok(outcomes[:1])[0]
    assert survivor["error"] is not None  # it raised instead of hanging
    assert read_record(step_dir(root, 6)) is None  # the interrupted folder does not count
    assert latest(root) == step_dir(root, 3)
    plain = make_model(seed=3)
    record = dcp.load(latest(root), plain)
    assert record["step"] == 3 and len(record["state"]["losses"]) == 3


def test_a_resume_after_the_kill_continues_bit_for_bit(killed_run) -> None:
    root, outcomes = killed_run
    run = check_ok(outcomes[:1])[0]
    resumed = check_ok(run_ranks(_resume, 2, root, [4, 4], "1f1b", 0.1, 0, timeout=120))
    for r in resumed:
        assert r["step"] == 3 and r["state"] == {"losses": run["before"]}
        assert r["losses"] == run["after"]  # optimizer state and RNG (dropout masks) restored


def test_one_folder_loads_into_4_ranks_2_ranks_a_local_pipe_and_the_plain_model(killed_run, tmp_path) -> None:
    root = str(tmp_path)
    shutil.copytree(step_dir(killed_run[0], 3), step_dir(root, 3))

    def local(folder: str, balance: list[int]) -> list[float]:
        pipe = Pipe(make_model(seed=11), balance, chunks=4)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
        dcp.load(folder, pipe, opt)
        try:
            return train(pipe, opt, range(3, 6) if "000003" in folder else range(6, 9))
        finally:
            pipe.close()

    # 2 ranks -> 4 ranks (another balance and schedule); it saves steps 6 and 7 (the same weights)
    four = check_ok(run_ranks(_resume, 4, root, [2, 2, 2, 2], "zb-h1", 0.0, 1, timeout=150))
    assert all(r["step"] == 3 and r["losses"] == four[0]["losses"] for r in four)
    assert_close_reordered(torch.tensor(four[0]["losses"]), torch.tensor(local(step_dir(root, 3), [2, 6])), k=K)

    # 4 ranks -> 2 ranks, with the newest checkpoint damaged: refused by name, step 6 used instead
    shard = os.path.join(step_dir(root, 7), "__3_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 3] ^= 0x01
    open(shard, "wb").write(bytes(data))
    two = check_ok(run_ranks(_resume, 2, root, [4, 4], "1f1b", 0.0, 0, timeout=120))
    assert all(r["step"] == 6 for r in two)
    assert any("__3_0.distcp" in w and "previous complete checkpoint" in w for w in two[0]["warnings"])
    assert two[0]["losses"] == two[1]["losses"]
    assert_close_reordered(torch.tensor(two[0]["losses"]), torch.tensor(local(step_dir(root, 6), [3, 5])), k=K)

    # the plain Sequential, in this process
    plain = make_model(seed=12)
    dcp.load(step_dir(root, 6), plain)
    pipe = Pipe(make_model(seed=13), [8], chunks=1)
    dcp.load(step_dir(root, 6), pipe)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, pipe.state_dict()[key])
    pipe.close()


def tied(seed: int) -> nn.Sequential:
    """The last layer's weight is the first's (an embedding tied to the head, in miniature)."""
    torch.manual_seed(seed)
    first, last = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), last)


def _save_tied_then_load_it_back(rank: int, world: int, folder: str) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(tied(0), [2, 3], chunks=2, timeout=TIMEOUT)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    train(pipe, opt, range(2))
    dcp.save(pipe, folder, opt, timeout=TIMEOUT)
    again = DistributedPipe(tied(rank + 1), [2, 3], chunks=2, timeout=TIMEOUT)
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
    dcp.load(folder, again, opt2, timeout=TIMEOUT)
    return {
        "model": {k: v.clone() for k, v in pipe.state_dict().items()},
        "reloaded": {k: v.clone() for k, v in again.state_dict().items()},
        "losses": (train(pipe, opt, range(2, 4)), train(again, opt2, range(2, 4))),
    }


def test_a_weight_tied_across_ranks_is_saved_once_and_loads_into_the_tied_sequential(tmp_path) -> None:
    folder = str(tmp_path / "tied")
    ranks = check_ok(run_ranks(_save_tied_then_load_it_back, 2, folder, timeout=120))
    assert "4.weight" in ranks[1]["model"]  # the head's rank holds its own copy under the head's name
    keys = set(dcp._dcp().FileSystemReader(folder).read_metadata().state_dict_metadata)
    assert "model.0.weight" in keys and "model.4.weight" not in keys  # saved once, by the owner
    assert not any(k.startswith("optim.state.4.weight.") for k in keys)
    for r in ranks:  # the reader's copy came back from the owner's entry
        assert r["reloaded"].keys() == r["model"].keys()
        for key, value in r["model"].items():
            assert torch.equal(r["reloaded"][key], value), key
        assert r["losses"][0] == r["losses"][1]  # and its optimizer state too

    plain = tied(5)
    dcp.load(folder, plain)
    assert plain[4].weight is plain[0].weight
    assert torch.equal(plain[0].weight, ranks[0]["model"]["0.weight"])
    assert torch.equal(plain[4].bias, ranks[1]["model"]["4.bias"])


def _pp_dp_save_and_resume(rank: int, world: int, root: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from fastpipe.distributed_pipe import DistributedPipe

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pipe = DistributedPipe(make_model(), [4, 4], chunks=2, mesh=mesh, timeout=TIMEOUT)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    train(pipe, opt, range(2))
    fastpipe.save_checkpoint(root, pipe, opt, 2, timeout=TIMEOUT)
    expected = train(pipe, opt, range(2, 4))
    again = DistributedPipe(make_model(seed=rank + 1), [4, 4], chunks=2, mesh=mesh, timeout=TIMEOUT)
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
    resumed = fastpipe.resume_or_start(root, again, opt2, timeout=TIMEOUT)
    return {"step": resumed["step"], "expected": expected, "resumed": train(again, opt2, range(2, 4))}


def test_pipeline_and_data_parallel_ranks_write_each_key_once_and_resume(tmp_path) -> None:
    root = str(tmp_path)
    ranks = check_ok(run_ranks(_pp_dp_save_and_resume, 4, root, timeout=150))
    for r in ranks:
        assert r["step"] == 2 and r["resumed"] == r["expected"]
    folder = step_dir(root, 2)
    metadata = dcp._dcp().FileSystemReader(folder).read_metadata()
    written = sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if n.endswith(".distcp"))
    # The replicas' identical keys are written once: every byte of the shards is an entry of
    # DCP's index (a second copy would be written, and not indexed).
    assert sum(info.length for info in metadata.storage_data.values()) == written
    keys = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
    assert keys == {f"model.{k}" for k in make_model().state_dict()}


def _load_into_six_layers(rank: int, world: int, folder: str, path: str) -> dict:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(make_model(seed=rank + 1)[:6], [3, 3], chunks=2, timeout=TIMEOUT)
    refused = {}
    for name, load in (("dcp", lambda: dcp.load(folder, pipe)), ("one file", lambda: fastpipe.load(path, pipe))):
        try:
            load()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            refused[name] = (type(exc).__name__, str(exc))
    dcp.load(folder, pipe, strict=False, timeout=TIMEOUT)
    return {"refused": refused, "loaded": {k: v.clone() for k, v in pipe.state_dict().items()}}


def test_every_rank_refuses_a_checkpoint_of_a_bigger_model_unless_not_strict(tmp_path) -> None:
    folder, path = str(tmp_path / "ck"), str(tmp_path / "ckpt.pt")
    saved = make_model(seed=0)
    dcp.save(saved, folder)
    fastpipe.save(saved, path)
    ranks = check_ok(run_ranks(_load_into_six_layers, 2, folder, path, timeout=120))
    for r in ranks:  # each rank holds keys of the checkpoint; the unexpected ones are no rank's
        for kind in ("dcp", "one file"):
            error, message = r["refused"][kind]
            assert error == "CheckpointKeyError", message
            assert "holds 4 keys the model lacks (6.0.bias, 6.0.weight, 7.0.bias, 7.0.weight)" in message
        for key, value in r["loaded"].items():
            assert torch.equal(value, saved.state_dict()[key]), key
