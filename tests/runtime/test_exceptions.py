"""An exception in a stage reaches the caller, names the stage, and leaves the Pipe usable."""

import threading

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.worker import live_worker_threads


class Boom(nn.Module):
    def __init__(self, on_forward=None, on_backward=None):
        super().__init__()
        self.on_forward = on_forward
        self.on_backward = on_backward
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if self.on_forward is not None and x.size(0) and float(x[0, 0]) == self.on_forward:
            raise ValueError("bad sample")
        y = self.fc(x)
        if self.on_backward is not None:
            y = y + _Raise.apply(y) * 0
        return y


class _Raise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise KeyError("backward failed")


def test_forward_exception_names_stage_and_micro_batch():
    pipe = Pipe(nn.Sequential(nn.Identity(), Boom(on_forward=99.0), nn.Linear(4, 4)), balance=[1, 1, 1], chunks=4)
    x = torch.zeros(8, 4)
    x[4, 0] = 99.0  # the first sample of micro-batch 2
    with pytest.raises(ValueError, match="bad sample") as info:
        pipe(x)
    assert any("stage 1, micro-batch 2" in note for note in info.value.__notes__)
    # The pipe still works afterwards and no worker thread was lost or leaked.
    assert pipe(torch.zeros(8, 4)).shape == (8, 4)


def test_backward_exception_names_stage():
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Boom(on_backward=True), nn.Linear(4, 4)), balance=[1, 1, 1], chunks=2)
    out = pipe(torch.randn(4, 4))
    with pytest.raises(KeyError) as info:
        out.sum().backward()
    assert any("stage 1" in note and "backward" in note for note in info.value.__notes__)
    pipe[1].on_backward = None
    pipe(torch.randn(4, 4)).sum().backward()


def test_no_thread_leak_after_failures_and_close():
    import gc

    gc.collect()
    before_threads = threading.active_count()
    before_workers = live_worker_threads()
    for _ in range(5):
        pipe = Pipe(nn.Sequential(Boom(on_forward=1.0), nn.Linear(4, 4)), balance=[1, 1], chunks=2)
        with pytest.raises(ValueError):
            pipe(torch.ones(4, 4))
        pipe.close()
    assert live_worker_threads() == before_workers
    assert threading.active_count() == before_threads


def test_a_pipe_whose_backward_failed_is_collected():
    # Its output holds the pipeline's autograd node; the node must not hold the output in
    # turn, or the failed step would keep the pipe and its parameters alive for good.
    import gc
    import weakref

    def failed_step():
        pipe = Pipe(nn.Sequential(nn.Linear(4, 4), Boom(on_backward=True)), balance=[1, 1], chunks=2)
        out = pipe(torch.randn(4, 4))
        with pytest.raises(KeyError):
            out.sum().backward()
        return weakref.ref(pipe), weakref.ref(pipe[0].weight)

    pipe, weight = failed_step()
    gc.collect()
    assert pipe() is None and weight() is None
