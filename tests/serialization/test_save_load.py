"""Checkpoints outlive the topology: save on 4 stages, load on 2, on one process, on the plain model."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from _ckpt_training import HIDDEN, make_model
from _ckpt_training import train as _train
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.checkpoint.serialization import load, save


def _save_on_four(rank: int, world: int, path: str) -> list[float]:
    from fastpipe.distributed_pipe import DistributedPipe

    pipe = DistributedPipe(make_model(), [2, 2, 2, 2], chunks=4, schedule="1f1b", timeout=20)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    _train(pipe, opt, range(3))
    save(pipe, path, opt)
    return _train(pipe, opt, range(3, 5))


def _load_on_two(rank: int, world: int, path: str) -> list[float]:
    from fastpipe.distributed_pipe import DistributedPipe

    def build_stage(stage: int) -> nn.Sequential:  # only this rank's layers, never materialised whole
        with torch.device("meta"):
            return make_model()[4 * stage : 4 * stage + 4]

    pipe = DistributedPipe.from_stage_builder(build_stage, [4, 4], chunks=4, schedule="zb-h1", timeout=20)
    assert [n for n, _ in pipe.named_children()] == [str(i) for i in range(4 * rank, 4 * rank + 4)]
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    load(path, pipe, opt)
    return _train(pipe, opt, range(3, 5))


def test_save_on_four_ranks_load_on_two_ranks_one_process_and_plain(tmp_path, monkeypatch) -> None:
    # Bit for bit across schedules needs the same weight GEMMs: zb-h1's W must not stack two
    # micro-batches into one GEMM where 1F1B runs one per micro-batch (the ranks inherit this).
    monkeypatch.setenv("FASTPIPE_WGRAD_BATCH", "1")
    path = str(tmp_path / "ckpt.pt")
    after = check_ok(run_ranks(_save_on_four, 4, path, timeout=90))
    assert all(a == after[0] for a in after)  # the loss is the same on every rank
    ckpt = torch.load(path, weights_only=False)
    assert list(ckpt["model"]) == list(make_model().state_dict())  # the Sequential's keys, all stages

    # two ranks, another balance and schedule: the same continuation, bit for bit
    resumed = check_ok(run_ranks(_load_on_two, 2, path, timeout=60))
    assert resumed[0] == after[0] and resumed[1] == after[0]

    # one process, two stages: this process runs as many threads as the user's (the ranks one
    # each), so other GEMM kernels; equal up to rounding over 8 Linears of HIDDEN inputs, the
    # loss's mean over 8 x HIDDEN values and the 8 rows a weight gradient sums over
    pipe = Pipe(make_model(seed=7), [4, 4], chunks=4)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    load(path, pipe, opt)
    k = 8 * HIDDEN + 8 * HIDDEN + 8
    assert_close_reordered(torch.tensor(_train(pipe, opt, range(3, 5))), torch.tensor(after[0]), k=k)

    # the plain Sequential
    plain = make_model(seed=8)
    load(path, plain)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, ckpt["model"][key])


def test_a_failed_write_leaves_the_previous_file_intact(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "ckpt.pt")
    model = make_model()
    save(model, path)
    before = open(path, "rb").read()

    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):  # writes half a file, then "the process is killed"
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(torch, "save", dying_save)
    with torch.no_grad():
        model[0][0].weight.add_(1.0)
    with pytest.raises(KeyboardInterrupt):
        save(model, path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    # no temporary file left behind: the checkpoint, its record and its lock file
    assert sorted(os.listdir(tmp_path)) == [".ckpt.pt.lock", "ckpt.pt", "ckpt.pt.commit"]
    restored = make_model(seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the file still matches its record
        load(path, restored)
    assert torch.equal(restored[0][0].weight, make_model()[0][0].weight)


def test_resume_continues_the_loss_curve_bit_identically(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    torch.manual_seed(1234)
    pipe = Pipe(make_model(dropout=0.1), [2, 2, 2, 2], chunks=4)
    opt = torch.optim.Adam(pipe.parameters(), lr=1e-2)
    _train(pipe, opt, range(3))
    save(pipe, path, opt)
    expected = _train(pipe, opt, range(3, 5))
    pipe.close()

    torch.manual_seed(999)  # a fresh process would start elsewhere
    # Dropout masks are drawn per (stage, micro-batch), so the resumed run keeps the balance.
    resumed = Pipe(make_model(seed=5, dropout=0.1), [2, 2, 2, 2], chunks=4)
    opt2 = torch.optim.Adam(resumed.parameters(), lr=1e-2)
    load(path, resumed, opt2, restore_rng=True)
    assert _train(resumed, opt2, range(3, 5)) == expected
    resumed.close()


def test_optimizer_state_is_keyed_by_parameter_name(tmp_path) -> None:
    path = str(tmp_path / "ckpt.pt")
    model = make_model()
    opt = torch.optim.SGD(
        [{"params": model[:4].parameters(), "lr": 0.1}, {"params": model[4:].parameters(), "lr": 0.2}], momentum=0.9
    )
    model(torch.randn(2, HIDDEN)).sum().backward()
    opt.step()
    save(model, path, opt)
    saved = torch.load(path, weights_only=False)["optimizer"]
    assert set(saved["state"]) == {n for n, _ in model.named_parameters()}
    assert [g["lr"] for g in saved["param_groups"]] == [0.1, 0.2]
    # load into an optimizer with one group per stage of a 2-stage Pipe
    pipe = Pipe(make_model(seed=1), [2, 6])
    opt2 = torch.optim.SGD([{"params": p.parameters()} for p in pipe.partitions], lr=1.0, momentum=0.9)
    load(path, pipe, opt2)
    assert [g["lr"] for g in opt2.param_groups] == [0.1, 0.1]  # hyper-parameters of the first saved group
    names = dict(pipe.named_parameters())
    for name, state in saved["state"].items():
        assert torch.equal(opt2.state[names[name]]["momentum_buffer"], state["momentum_buffer"])
    pipe.close()
