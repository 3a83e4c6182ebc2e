"""Sharded checkpoints in one process: a round trip is bitwise, and only a complete, intact checkpoint loads."""

from __future__ import annotations

import os
import threading

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.checkpoint import dcp
from fastpipe.checkpoint.commit import (
    RECORD,
    CheckpointCorruptError,
    complete_checkpoints,
    latest,
    read_record,
    step_dir,
)

HIDDEN = 8


def make_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh()) for _ in range(4)])


def tied_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    first, last = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), last)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, HIDDEN, generator=g), torch.randn(8, HIDDEN, generator=g)
        opt.zero_grad(set_to_none=True)
        if isinstance(model, Pipe):
            loss = model.train_step(x, y, nn.MSELoss())
        else:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def saved_run(root: str, steps: tuple[int, ...] = (1, 2)) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    done = 0
    for step in steps:
        train(model, opt, range(done, step))
        done = step
        fastpipe.save_checkpoint(root, model, opt, step, state={"losses": [float(step)]})
    return model, opt


def test_round_trip_is_bitwise_and_three_more_steps_match(tmp_path) -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, opt, range(3))
    torch.manual_seed(42)
    dcp.save(model, str(tmp_path / "ck"), opt, step=3, state={"position": 3})
    expected_draw = torch.rand(3)
    expected = train(model, opt, range(3, 6))

    torch.manual_seed(7)
    again = make_model(seed=5)
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.5)
    record = dcp.load(str(tmp_path / "ck"), again, opt2)
    assert record["step"] == 3 and record["state"] == {"position": 3}
    assert torch.equal(torch.rand(3), expected_draw)  # the generator continues where the save left it
    assert train(again, opt2, range(3, 6)) == expected
    for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_sequential_checkpoint_loads_into_a_local_pipe(tmp_path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    dcp.save(model, str(tmp_path / "ck"), opt, step=2)
    pipe = Pipe(make_model(seed=3), [1, 3], chunks=1)
    opt2 = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    dcp.load(str(tmp_path / "ck"), pipe, opt2)
    assert train(pipe, opt2, range(2, 4)) == train(model, opt, range(2, 4))
    pipe.close()


def test_a_tied_weight_is_saved_once_under_its_first_name(tmp_path) -> None:
    model = tied_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    dcp.save(model, str(tmp_path / "ck"), opt)
    keys = set(dcp._dcp().FileSystemReader(str(tmp_path / "ck")).read_metadata().state_dict_metadata)
    assert "model.0.weight" in keys and "model.4.weight" not in keys
    assert "optim.state.0.weight.exp_avg" in keys and not any(k.startswith("optim.state.4.weight.") for k in keys)
    again = tied_model(seed=1)
    opt2 = torch.optim.Adam(again.parameters(), lr=1e-2)
    dcp.load(str(tmp_path / "ck"), again, opt2)
    assert again[4].weight is again[0].weight
    assert train(again, opt2, range(2, 4)) == train(model, opt, range(2, 4))


def test_latest_is_the_newest_folder_with_a_record_and_old_ones_are_pruned(tmp_path) -> None:
    root = str(tmp_path)
    saved_run(root, (1, 2, 3, 4, 5))
    assert complete_checkpoints(root) == [step_dir(root, s) for s in (5, 4, 3)]  # keep=3
    os.unlink(os.path.join(step_dir(root, 5), RECORD))  # an unfinished save
    assert latest(root) == step_dir(root, 4)
    resumed = fastpipe.resume_or_start(root, make_model(seed=9), None)
    assert resumed["step"] == 4 and resumed["state"] == {"losses": [4.0]}
    assert fastpipe.resume_or_start(str(tmp_path / "none"), make_model(), state={"a": 1})["step"] == 0


def _shard(folder: str) -> str:
    return os.path.join(folder, next(n for n in sorted(os.listdir(folder)) if n.endswith(".distcp")))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_shard_is_refused_naming_it_and_the_previous_checkpoint_loads(tmp_path, damage) -> None:
    root = str(tmp_path)
    saved_run(root, (1, 2))
    shard = _shard(step_dir(root, 2))
    data = bytearray(open(shard, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))

    with pytest.raises(CheckpointCorruptError, match=shard.replace(".", r"\.")):
        dcp.load(step_dir(root, 2), make_model())
    model = make_model(seed=4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with pytest.warns(UserWarning, match=f"{os.path.basename(shard)}.*previous complete checkpoint"):
        resumed = fastpipe.resume_or_start(root, model, opt)
    assert resumed["step"] == 1 and resumed["folder"] == step_dir(root, 1)
    reference, ref_opt = saved_run(str(tmp_path / "ref"), (1,))
    assert train(model, opt, range(1, 3)) == train(reference, ref_opt, range(1, 3))


def test_async_save_keeps_the_values_of_the_call(tmp_path) -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, range(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = [1.0, 2.0]
    pending = fastpipe.save_checkpoint(str(tmp_path), model, opt, 2, state={"losses": losses}, asynchronous=True)
    assert isinstance(pending, dcp.PendingSave)
    losses += train(model, opt, range(2, 4))  # the loop goes on while the save is written
    assert pending.wait() == step_dir(str(tmp_path), 2)
    # wait() returns once the writer thread is gone: a script that ends right after it must
    # not end the interpreter while that thread still frees the save's tensors.
    assert not [t for t in threading.enumerate() if t.name == "fastpipe-dcp-commit"]
    record = read_record(step_dir(str(tmp_path), 2))
    assert record is not None and set(record["files"]) == {".metadata", "__0_0.distcp"}
    assert record["state"] == {"losses": [1.0, 2.0]}
    again = make_model(seed=2)
    dcp.load(step_dir(str(tmp_path), 2), again)
    for key, value in again.state_dict().items():
        assert torch.equal(value, before[key])
