"""200 training steps leave no growing number of live tensors or threads, and a collected Pipe stops its threads."""

import gc
import threading
import warnings

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.runtime.worker import live_worker_threads


def live_tensors():
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() pokes lazy module attributes that warn
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def assert_no_growth(step, warmup: int, steps: int) -> None:
    """After ``warmup`` steps, ``steps`` more leave no more live tensors or threads."""
    for _ in range(warmup):
        step()
    tensors, threads = live_tensors(), threading.active_count()
    for _ in range(steps):
        step()
    assert live_tensors() <= tensors
    assert threading.active_count() == threads


def test_no_growth_over_200_steps():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.ReLU(), nn.Linear(16, 8), nn.LayerNorm(8))
    pipe = Pipe(model, balance=[2, 3], chunks=4, checkpoint="except_last")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 8)

    def step():
        opt.zero_grad()
        nn.functional.mse_loss(pipe(x), y).backward()
        opt.step()

    assert_no_growth(step, warmup=10, steps=200)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_train_step_frees_every_graph(schedule):
    # zb-h1 keeps each micro-batch's graph from B until its W: nothing may outlive the step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    pipe = Pipe(model, balance=[3, 2], chunks=4, checkpoint="except_last")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
    x, y = torch.randn(16, 8), torch.randn(16, 8)

    def step():
        opt.zero_grad()
        pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)
        opt.step()

    assert_no_growth(step, warmup=5, steps=100)


def test_backward_hands_gradients_to_autograd_without_a_copy():
    # Workers must keep no reference to a finished step: otherwise autograd cannot adopt the
    # pipeline's summed weight gradients as .grad and copies every one of them (it did:
    # 15 ms per step on the reference workload).
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), balance=[2, 2], chunks=4)
    made = []
    backward = pipe.runtime.backward

    def spy(*args, **kwargs):
        input_grads, param_grads = backward(*args, **kwargs)
        made.extend(g.data_ptr() for stage in param_grads for g in stage)
        return input_grads, param_grads

    pipe.runtime.backward = spy
    pipe(torch.randn(8, 32)).sum().backward()
    assert [p.grad.data_ptr() for p in pipe.parameters()] == made


def test_threads_stop_when_pipe_is_collected():
    gc.collect()
    before = live_worker_threads()
    pipe = Pipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), balance=[1, 1], chunks=2)
    pipe(torch.randn(4, 4)).sum().backward()
    assert live_worker_threads() == before + 2
    del pipe
    gc.collect()
    for _ in range(100):
        if live_worker_threads() == before:
            break
        threading.Event().wait(0.01)
    assert live_worker_threads() == before
