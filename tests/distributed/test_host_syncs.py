"""A training step reads the host a fixed number of times, however many micro-batches it has.

A host read of a CUDA value (``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``)
waits for every kernel queued before it: one per micro-batch empties the GPU's queue once per
micro-batch. The same calls read CPU tensors here, so counting them (by call site) during a
step on gloo ranks shows what a GPU step would wait for. The steps cover each loss rule
that reads values (class-weighted cross-entropy with ignored targets, a declared normaliser)
and loss scaling.

What a step may read, and why each is a constant:

* stage 0's rank draws the step's seed from the CPU generator (``fastpipe.rng.seeds``);
* every rank reads the shared micro-batch sizes, seed and digest once (sent over gloo);
* every rank reads the loss message once (the last rank's copy of it is the one GPU wait);
* the last rank reads its micro-batches' class weights or normalisers together, once;
* with a scaler, every rank reads the agreed scale once.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import traceback
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from torch import nn

import fastpipe
from fastpipe.step.host_io import read_floats, value_to
from fastpipe.step.rules import target_weight

READS = ("item", "tolist", "__float__", "__int__", "__index__", "__bool__")
LOSSES = ("mse", "class_weighted_ce", "token_loss", "scaled_mse")
#: The most reads one rank makes in one step (the module docstring's list, all on one rank).
MOST_READS = 4


@contextlib.contextmanager
def counting_reads() -> Iterator[collections.Counter[str]]:
    """Counts every host read of a tensor in the block, by ``"method file:line"`` of its caller."""
    counts: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()  # Pipe's worker threads read too
    real = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = traceback.extract_stack(limit=2)[0]
            with lock:
                counts[f"{name} {os.path.basename(caller.filename)}:{caller.lineno}"] += 1
            return real[name](self, *args, **kwargs)

        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, method in real.items():
            setattr(torch.Tensor, name, method)


def _step_inputs(loss: str, chunks: int) -> tuple[torch.Tensor, torch.Tensor, Any, bool]:
    """A mini-batch of 2 samples per micro-batch, its target, the loss, and whether to scale it."""
    g = torch.Generator().manual_seed(chunks)
    x = torch.randn(2 * chunks, 8, generator=g)
    if loss == "class_weighted_ce":
        y = torch.randint(0, 8, (2 * chunks,), generator=g)
        y[::3] = -100  # ignored targets: each micro-batch counts its own
        return x, y, nn.CrossEntropyLoss(weight=torch.rand(8, generator=g) + 0.5), False
    y = torch.randn(2 * chunks, 8, generator=g)
    if loss == "token_loss":
        return (
            x,
            y,
            fastpipe.token_loss(lambda out, t: ((out - t) * (t > 0)).square().sum(), lambda t: (t > 0).sum()),
            False,
        )
    return x, y, nn.MSELoss(), loss == "scaled_mse"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])


def _rank_reads(rank: int, world: int) -> dict[str, dict[int, dict[str, int]]]:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fastpipe import DistributedPipe

    out: dict[str, dict[int, dict[str, int]]] = {}
    for chunks in (2, 8):
        pipe = DistributedPipe(_model(), [2, 2], chunks=chunks, schedule="1f1b", timeout=20)
        for loss in LOSSES:
            x, y, loss_fn, scaled = _step_inputs(loss, chunks)
            scaler = ShardedGradScaler("cpu", init_scale=2.0**4) if scaled else None
            pipe.train_step(x, y, loss_fn, scaler=scaler)  # the first step: set-up reads may differ
            with counting_reads() as counts:
                pipe.train_step(x, y, loss_fn, scaler=scaler)
            out.setdefault(loss, {})[chunks] = dict(counts)
        pipe.close()
    return out


def test_a_distributed_step_reads_the_host_as_often_for_8_micro_batches_as_for_2(transport: str) -> None:
    for rank, reads in enumerate(check_ok(run_ranks(_rank_reads, 2, timeout=90))):
        for loss, by_chunks in reads.items():
            assert by_chunks[2] == by_chunks[8], f"rank {rank}, {loss}: {by_chunks}"
            assert sum(by_chunks[8].values()) <= MOST_READS, f"rank {rank}, {loss}: {by_chunks[8]}"
        # The ranks agree on the loss scale with one read of the agreed value.
        assert sum(reads["scaled_mse"][8].values()) == sum(reads["mse"][8].values()) + 1, reads


@pytest.mark.parametrize("loss", LOSSES)
def test_a_pipe_step_reads_the_host_as_often_for_8_micro_batches_as_for_2(loss: str) -> None:
    reads = {}
    for chunks in (2, 8):
        pipe = fastpipe.Pipe(_model(), balance=[2, 2], chunks=chunks)
        x, y, loss_fn, scaled = _step_inputs(loss, chunks)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
        pipe.train_step(x, y, loss_fn, scaler=scaler)
        with counting_reads() as counts:
            pipe.train_step(x, y, loss_fn, scaler=scaler)
        reads[chunks] = dict(counts)
    assert reads[2] == reads[8]
    assert sum(reads[8].values()) <= 2, reads[8]  # the step's seed; a normaliser or the scale


def test_read_floats_reads_each_device_and_dtype_once_and_gives_floats_bit_for_bit() -> None:
    values: list[Any] = [
        torch.tensor(0.1, dtype=torch.float32),
        torch.tensor(2**31 + 1, dtype=torch.int64),  # stacked with the float32s, it would round to 2**31
        3,
        torch.tensor([0.3], dtype=torch.float32),
        torch.tensor(True),
        torch.tensor(1 / 3, dtype=torch.bfloat16),
    ]
    expected = [float(v) for v in values]
    with counting_reads() as counts:
        got = read_floats(values, "the values")
    assert [v.hex() for v in got] == [v.hex() for v in expected]
    assert sum(counts.values()) == 4, counts  # float32, int64, bool, bfloat16: one stack each


def test_read_floats_refuses_a_tensor_of_several_elements() -> None:
    with pytest.raises(ValueError, match=r"loss_fn.normaliser\(target\) must be a number or a one-element tensor"):
        read_floats([torch.ones(2)], "loss_fn.normaliser(target)")


def test_class_weights_of_micro_batches_add_up_as_one_float_each() -> None:
    # Each micro-batch's weight sums in float32, then the shares add in order in float64.
    g = torch.Generator().manual_seed(0)
    weight = torch.rand(50, generator=g) * 10
    targets = [torch.randint(-1, 50, (n,), generator=g) for n in (300, 7, 1, 0, 64)]
    loss_fn = nn.CrossEntropyLoss(weight=weight, ignore_index=-1)
    expected = 0.0
    for t in targets:
        expected += float(weight[t[t != -1]].sum())
    assert target_weight(loss_fn, targets).hex() == expected.hex()
    assert target_weight(nn.CrossEntropyLoss(ignore_index=-1), targets) == sum(int((t != -1).sum()) for t in targets)


def test_host_tensors_bound_for_a_gpu_go_through_pinned_memory_without_blocking(monkeypatch) -> None:
    # CPU-only torch has no pinned memory: the calls are recorded instead (the GPU test runs them).
    pinned: list[bool] = []
    moves: list[bool] = []
    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*shape: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        pinned.append(pin_memory)
        return real_empty(*shape, **kwargs)

    def to(self: torch.Tensor, device: Any, *args: Any, non_blocking: bool = False, **kwargs: Any) -> torch.Tensor:
        if torch.device(device).type != "cuda":
            return real_to(self, device, *args, non_blocking=non_blocking, **kwargs)
        moves.append(non_blocking)
        return self.clone()

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    x, y = torch.randn(4, 3), torch.arange(4)
    moved = value_to((x, "mask", y), torch.device("cuda:0"))
    assert pinned == [True, True] and moves == [True, True]
    assert moved[1] == "mask" and torch.equal(moved[0], x) and torch.equal(moved[2], y)
    assert value_to(x, torch.device("cpu")) is x  # nothing to stage on the host
