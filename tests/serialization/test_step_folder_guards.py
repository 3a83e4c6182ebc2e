"""Sharded checkpoints refuse what would make them wrong: a racing second save into a step folder,
another model's keys, and DCP's failures (a shape that differs, a full disk) surface as a
fastpipe error that leads with the cause, with nothing earlier lost."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe.checkpoint import dcp
from fastpipe.checkpoint.commit import CheckpointError, CheckpointKeyError, latest, read_record, step_dir


def layers(n: int, width: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)])


def _equal(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_a_second_save_into_a_step_folder_being_written_raises_and_the_first_lands_whole(tmp_path, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    root = str(tmp_path)
    first, second = layers(2, seed=1), layers(2, seed=2)
    written, go_on = threading.Event(), threading.Event()
    real = FileSystemWriter.write_data

    def pause_after_the_shard(self: Any, plan: Any, planner: Any) -> Any:
        result = real(self, plan, planner)
        if threading.current_thread().name == "first-saver":
            written.set()
            assert go_on.wait(30)
        return result

    monkeypatch.setattr(FileSystemWriter, "write_data", pause_after_the_shard)
    errors: list[BaseException] = []

    def save_first() -> None:
        try:
            fastpipe.save_checkpoint(root, first, None, 5, state={"who": "first"})
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    saver = threading.Thread(target=save_first, name="first-saver")
    saver.start()
    assert written.wait(30)  # its shard is on disk; its index and record are not
    with pytest.raises(CheckpointError, match=r"another save is writing .*step-000005.*this save wrote nothing"):
        fastpipe.save_checkpoint(root, second, None, 5, state={"who": "second"})
    go_on.set()
    saver.join(30)
    assert not errors
    record = read_record(step_dir(root, 5))
    assert record is not None and record["state"] == {"who": "first"}
    into = layers(2, seed=3)
    assert fastpipe.resume_or_start(root, into)["step"] == 5
    assert _equal(into, first)  # the first saver's tensors, passing their own checksums


def test_a_four_layer_checkpoint_does_not_resume_into_a_two_layer_sequential(tmp_path) -> None:
    root = str(tmp_path)
    four = layers(4, seed=1)
    fastpipe.save_checkpoint(root, four, None, 3)
    two = layers(2, seed=2)
    before = {k: v.clone() for k, v in two.state_dict().items()}
    with pytest.raises(CheckpointKeyError, match=r"holds 4 keys the model lacks \(2\.0\.bias, 2\.0\.weight, "):
        fastpipe.resume_or_start(root, two)
    assert all(torch.equal(v, before[k]) for k, v in two.state_dict().items())  # nothing was loaded
    resumed = fastpipe.resume_or_start(root, two, strict=False)
    assert resumed["step"] == 3
    assert all(torch.equal(v, four.state_dict()[k]) for k, v in two.state_dict().items())
    with pytest.raises(KeyError, match=r"4 of the model's keys are missing from it \(4\.0\.bias"):
        dcp.load(step_dir(root, 3), layers(6))


def test_a_shape_that_differs_raises_a_fastpipe_error_that_leads_with_the_cause(tmp_path) -> None:
    folder = str(tmp_path / "ck")
    dcp.save(layers(2, width=4), folder)
    with pytest.raises(Exception) as info:  # an Exception: ``except Exception`` catches it
        dcp.load(folder, layers(2, width=3))
    assert isinstance(info.value, CheckpointError)
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"fastpipe.checkpoint.dcp: could not load {folder}: rank 0: ValueError: Size mismatch")
    assert "for model.0.0.bias" in first_line
    assert type(info.value.__cause__).__name__ == "CheckpointException"


@contextlib.contextmanager
def _full_disk() -> Iterator[None]:
    """DCP's shard files take no more bytes: every write raises ``OSError(EFBIG)``."""
    from torch.distributed.checkpoint import filesystem

    real = filesystem.FileSystem.create_stream

    class Full:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def write(self, data: bytes) -> int:
            raise OSError(errno.EFBIG, "File too large")

        def __getattr__(self, name: str) -> Any:
            return getattr(self.stream, name)

    @contextlib.contextmanager
    def create_stream(self: Any, path: Any, mode: str) -> Iterator[Any]:
        with real(self, path, mode) as stream:
            yield Full(stream) if "w" in mode else stream

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(filesystem.FileSystem, "create_stream", create_stream)
        yield


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_full_disk_raises_a_fastpipe_error_and_keeps_the_previous_checkpoint(tmp_path, asynchronous) -> None:
    root = str(tmp_path)
    saved = layers(2, seed=1)
    fastpipe.save_checkpoint(root, saved, None, 1)
    with _full_disk(), pytest.raises(CheckpointError) as info:
        pending = fastpipe.save_checkpoint(root, layers(2, seed=2), None, 2, asynchronous=asynchronous)
        if isinstance(pending, dcp.PendingSave):
            pending.wait()
    first_line = str(info.value).splitlines()[0]
    assert first_line.startswith(f"fastpipe.checkpoint.dcp: could not save {step_dir(root, 2)}: rank 0: OSError")
    assert "File too large" in first_line
    assert read_record(step_dir(root, 2)) is None and latest(root) == step_dir(root, 1)
    into = layers(2, seed=3)
    assert fastpipe.resume_or_start(root, into)["step"] == 1
    assert _equal(into, saved)
    fastpipe.save_checkpoint(root, layers(2, seed=2), None, 2)  # the folder's lock was let go
    assert latest(root) == step_dir(root, 2) and os.path.exists(os.path.join(step_dir(root, 2), ".metadata"))
