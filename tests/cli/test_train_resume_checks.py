"""``fastpipe train --resume`` in one process never continues from a damaged model file: it falls back
to the save before it, by name, or refuses."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator

import pytest
import torch
from _damage import flip_tensor_bytes
from test_train_cli import TINY
from torch import nn

from fastpipe.checkpoint.commit import CheckpointError, SaveLock, atomic_write
from fastpipe.cli import main
from fastpipe.train.resume import RUN_FORMAT, save_run


@pytest.fixture(autouse=True)
def _threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # fastpipe train sets one thread per stage worker


def _train(out: str, *flags: str) -> dict:
    assert main(["train", *TINY, "--out", out, *flags]) == 0
    with open(os.path.join(out, "report.json")) as f:
        return dict(json.load(f))


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[float]]:
    """6 steps with dropout, saved every 2: ``run.pt`` keeps the saves of steps 6 and 4."""
    tmp = str(tmp_path_factory.mktemp("saved"))
    ckpt = os.path.join(tmp, "ckpt")
    whole = _train(os.path.join(tmp, "out"), "--steps", "6", "--dropout", "0.1", "--save", ckpt, "--save-every", "2")
    visible = sorted(n for n in os.listdir(ckpt) if not n.startswith("."))
    assert visible == ["model-000004.pt", "model-000006.pt", "run.pt"]
    return ckpt, whole["history"]


def test_a_damaged_newest_model_file_resumes_from_the_save_before_it(saved_run, tmp_path) -> None:
    ckpt = shutil.copytree(saved_run[0], str(tmp_path / "ckpt"))
    newest = os.path.join(ckpt, "model-000006.pt")
    intact = torch.load(newest, weights_only=False)["model"]
    assert flip_tensor_bytes(newest) >= len(intact)
    damaged = torch.load(newest, weights_only=False)["model"]  # torch.load does not notice
    assert all(not torch.equal(intact[k], damaged[k]) for k in intact)
    flags = ["--steps", "6", "--dropout", "0.1", "--save", ckpt, "--resume", "auto"]
    with pytest.warns(UserWarning, match=r"model-000006\.pt is corrupt.*save before it.*model-000004\.pt \(step 4\)"):
        resumed = _train(str(tmp_path / "out"), *flags)
    assert resumed["start_step"] == 4
    assert resumed["history"] == saved_run[1]  # bitwise: steps 5 and 6 again, from the intact save


def test_with_every_model_file_damaged_the_resume_refuses(saved_run, tmp_path, capsys) -> None:
    ckpt = shutil.copytree(saved_run[0], str(tmp_path / "ckpt"))
    for step in (4, 6):
        flip_tensor_bytes(os.path.join(ckpt, f"model-{step:06d}.pt"))
    code = main(["train", *TINY, "--steps", "6", "--out", str(tmp_path / "out"), "--resume", ckpt])
    assert code == 2
    error = capsys.readouterr().err
    assert "model-000006.pt is corrupt" in error and "model-000004.pt is corrupt" in error


def test_a_record_without_checksums_resumes_with_a_warning(saved_run, tmp_path) -> None:
    ckpt = shutil.copytree(saved_run[0], str(tmp_path / "ckpt"))
    # run.pt as an earlier fastpipe wrote it: one save, with no sizes or checksums
    save = torch.load(os.path.join(ckpt, "run.pt"), weights_only=False)["saves"][1]
    atomic_write(
        {**{k: v for k, v in save.items() if k != "files"}, "format": RUN_FORMAT}, os.path.join(ckpt, "run.pt")
    )
    flags = ["--steps", "6", "--dropout", "0.1", "--resume", ckpt]
    with pytest.warns(UserWarning, match=r"records no checksums .*model-000004\.pt cannot be verified"):
        resumed = _train(str(tmp_path / "out"), *flags)
    assert resumed["start_step"] == 4 and resumed["history"] == saved_run[1]


def test_a_second_run_saving_into_the_folder_raises_and_writes_nothing(tmp_path) -> None:
    folder = str(tmp_path)
    model = nn.Sequential(nn.Linear(2, 2))
    opt = torch.optim.AdamW(model.parameters())
    with SaveLock(os.path.join(folder, ".run.pt.lock"), folder):  # another run, mid-save
        with pytest.raises(CheckpointError, match="another save is writing"):
            save_run(folder, model, opt, 2, {"settings": {}, "history": [1.0, 2.0]})
    assert not [n for n in os.listdir(folder) if not n.startswith(".")]
    save_run(folder, model, opt, 2, {"settings": {}, "history": [1.0, 2.0]})
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == ["model-000002.pt", "run.pt"]
