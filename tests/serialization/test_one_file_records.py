"""One-file checkpoints cannot be silently wrong: a record with sizes and CRC-32s, a previous file to
fall back on, strict keys, and a lock against a racing second save."""

from __future__ import annotations

import errno
import os
import threading
import warnings

import pytest
import torch
from _ckpt_training import make_model
from _damage import flip_tensor_bytes
from torch import nn

import fastpipe
from fastpipe.checkpoint import commit, serialization
from fastpipe.checkpoint.commit import CheckpointCorruptError, CheckpointError, CheckpointKeyError


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def _no_warnings_load(path: str, into: nn.Module, **kwargs: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastpipe.load(path, into, **kwargs)  # type: ignore[arg-type]


def test_a_damaged_newest_file_falls_back_to_the_previous_one_with_a_warning_naming_it(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    older, newer = make_model(seed=1), make_model(seed=2)
    fastpipe.save(older, path)
    fastpipe.save(newer, path)
    assert sorted(os.listdir(tmp_path)) == [".ckpt.pt.lock", "ckpt.pt", "ckpt.pt.commit", "ckpt.pt.prev"]
    into = make_model(seed=3)
    _no_warnings_load(path, into)
    assert _same(into, newer)

    flip_tensor_bytes(path)
    into = make_model(seed=3)
    with pytest.warns(UserWarning, match=r"ckpt\.pt is corrupt.*loading the previous checkpoint .*ckpt\.pt\.prev"):
        fastpipe.load(path, into)
    assert _same(into, older)


def test_with_no_intact_file_left_the_load_raises_naming_the_file(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    fastpipe.save(make_model(seed=1), path)
    fastpipe.save(make_model(seed=2), path)
    flip_tensor_bytes(path)
    flip_tensor_bytes(path + ".prev")
    with pytest.raises(CheckpointCorruptError, match=r"ckpt\.pt is corrupt: .*ckpt\.pt\.prev is corrupt") as info:
        fastpipe.load(path, make_model(seed=3))
    assert info.value.path == path

    truncated = str(tmp_path / "once.pt")  # one save: there is no previous file to fall back on
    fastpipe.save(make_model(seed=1), truncated)
    with open(truncated, "r+b") as f:
        f.truncate(os.path.getsize(truncated) // 2)
    with pytest.raises(CheckpointCorruptError, match=r"once\.pt\.prev is missing"):
        fastpipe.load(truncated, make_model(seed=3))


def test_a_save_cut_short_before_its_record_keeps_the_last_recorded_checkpoint(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ckpt.pt")
    first, second, third = make_model(seed=1), make_model(seed=2), make_model(seed=3)
    fastpipe.save(first, path)
    real = serialization.atomic_write

    def dies_at_the_record(obj: object, target: str) -> None:
        if target.endswith(".commit"):
            raise KeyboardInterrupt("killed before the record")
        real(obj, target)

    monkeypatch.setattr(serialization, "atomic_write", dies_at_the_record)
    with pytest.raises(KeyboardInterrupt):
        fastpipe.save(second, path)  # its file is in place, its record is not
    monkeypatch.undo()
    into = make_model(seed=4)
    with pytest.warns(UserWarning, match=r"ckpt\.pt is corrupt"):
        fastpipe.load(path, into)
    assert _same(into, first)  # the unrecorded file does not count

    fastpipe.save(third, path)  # replaces the unrecorded file; the first stays the one to fall back on
    _no_warnings_load(path, into)
    assert _same(into, third)
    flip_tensor_bytes(path)
    with pytest.warns(UserWarning, match="previous checkpoint"):
        fastpipe.load(path, into)
    assert _same(into, first)


def test_a_file_without_a_record_loads_with_a_warning_that_it_cannot_be_verified(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    model = make_model(seed=1)
    fastpipe.save(model, path)
    os.unlink(path + ".commit")  # as an earlier fastpipe wrote it
    into = make_model(seed=2)
    with pytest.warns(UserWarning, match=r"ckpt\.pt has no commit record .* cannot be verified"):
        fastpipe.load(path, into)
    assert _same(into, model)
    with pytest.raises(FileNotFoundError, match="there is no checkpoint at"):
        fastpipe.load(str(tmp_path / "none.pt"), into)


def test_keep_1_keeps_no_previous_file(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    fastpipe.save(make_model(seed=1), path)
    fastpipe.save(make_model(seed=2), path)
    fastpipe.save(make_model(seed=3), path, keep=1)
    assert not os.path.exists(path + ".prev")
    with pytest.raises(ValueError, match="keep must be 1 .* or 2"):
        fastpipe.save(make_model(), path, keep=3)


def test_loading_is_strict_about_keys_and_strict_false_loads_the_shared_ones(tmp_path) -> None:
    path = str(tmp_path / "four.pt")
    four = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(4)])
    fastpipe.save(four, path)
    two = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
    before = {k: v.clone() for k, v in two.state_dict().items()}
    with pytest.raises(CheckpointKeyError, match=r"holds 4 keys the model lacks \(2\.0\.bias, 2\.0\.weight, "):
        fastpipe.load(path, two)
    assert all(torch.equal(v, before[k]) for k, v in two.state_dict().items())  # nothing was loaded
    fastpipe.load(path, two, strict=False)
    assert all(torch.equal(v, four.state_dict()[k]) for k, v in two.state_dict().items())

    six = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(6)])
    with pytest.raises(KeyError, match=r"4 of the model's keys are missing from it \(4\.0\.bias"):
        fastpipe.load(path, six)


def test_a_second_save_while_one_is_writing_raises_and_the_first_lands_whole(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ckpt.pt")
    first, second = make_model(seed=1), make_model(seed=2)
    writing, go_on = threading.Event(), threading.Event()
    real = torch.save

    def slow_first_save(obj: object, f: object, *args: object, **kwargs: object) -> None:
        real(obj, f, *args, **kwargs)  # type: ignore[arg-type]
        if threading.current_thread().name == "first-saver" and not writing.is_set():
            writing.set()
            assert go_on.wait(30)

    monkeypatch.setattr(torch, "save", slow_first_save)
    saver = threading.Thread(target=fastpipe.save, args=(first, path), name="first-saver")
    saver.start()
    assert writing.wait(30)  # the first save is mid-write, holding the lock
    with pytest.raises(CheckpointError, match=r"another save is writing .*ckpt\.pt.*this save wrote nothing"):
        fastpipe.save(second, path)
    go_on.set()
    saver.join(30)
    monkeypatch.undo()
    into = make_model(seed=3)
    _no_warnings_load(path, into)
    assert _same(into, first)
    fastpipe.save(second, path)  # the lock is free again
    _no_warnings_load(path, into)
    assert _same(into, second)


def test_a_file_system_without_locks_saves_with_a_warning(tmp_path, monkeypatch) -> None:
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(commit.fcntl, "flock", no_locks)
    path = str(tmp_path / "ckpt.pt")
    model = make_model(seed=1)
    with pytest.warns(UserWarning, match=r"cannot lock files .* nothing stops a second save racing into"):
        fastpipe.save(model, path)
    into = make_model(seed=2)
    _no_warnings_load(path, into)
    assert _same(into, model)
