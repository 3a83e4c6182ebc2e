"""200 training steps leave no growing number of live tensors or threads."""

import gc
import threading
import warnings

import torch
from torch import nn

from fastpipe import Pipe


def live_tensors():
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() pokes lazy module attributes that warn
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


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

    for _ in range(10):
        step()
    tensors, threads = live_tensors(), threading.active_count()
    for _ in range(200):
        step()
    assert live_tensors() <= tensors
    assert threading.active_count() == threads
