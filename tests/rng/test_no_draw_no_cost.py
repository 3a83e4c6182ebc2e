"""Stages that cannot draw random numbers skip the task RNG, and calls that do not draw take no lock.

The task RNG's function mode costs host time on every op, and a routed call takes a device
lock and swaps generator states. Both must be paid only where a draw can happen: fastpipe's
kernels and the GPT of ``fastpipe train`` say they never draw (with dropout 0), and SDPA or
dropout called with ``p == 0`` (or not training) goes straight through.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastpipe import kernels
from fastpipe.rng.streams import TaskRNG, may_draw
from fastpipe.train.model import GPTConfig, LMLoss, build_gpt


def gpt(dropout: float) -> nn.Sequential:
    return build_gpt(GPTConfig(vocab=32, dim=16, n_head=2, n_layer=2, seq_len=8, dropout=dropout), seed=0)


def test_the_main_jobs_gpt_without_dropout_cannot_draw():
    model = gpt(0.0)
    assert not any(may_draw(layer) for layer in model)
    assert not may_draw(model[-1], LMLoss(model[-1]))


def test_with_dropout_it_draws_while_training_only():
    model = gpt(0.1)
    assert may_draw(model[1])
    model.eval()
    assert not may_draw(model[1])


@pytest.mark.parametrize(
    "layer",
    [kernels.LayerNorm(8), kernels.RMSNorm(8), kernels.GELU(), kernels.Dropout(0.0), kernels.MLPBlock(8, 16)],
    ids=lambda m: type(m).__name__,
)
def test_fastpipes_kernels_declare_they_do_not_draw(layer):
    assert not may_draw(layer)


def test_a_kernel_dropout_with_p_draws():
    assert may_draw(kernels.Dropout(0.2)) and may_draw(kernels.MLPBlock(8, 16, dropout=0.2))


def test_a_custom_module_is_still_assumed_to_draw():
    class Mine(nn.Module):
        def forward(self, x):
            return x

    assert may_draw(Mine())


class Counting(TaskRNG):
    def __init__(self) -> None:
        super().__init__(seed=1)
        self.draws = 0

    def drawing(self, devices):
        self.draws += 1
        return super().drawing(devices)


def test_calls_that_cannot_draw_take_no_lock():
    q = torch.randn(1, 2, 4, 8)
    x = torch.randn(4, 4)
    task = Counting()
    with task:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        F.scaled_dot_product_attention(q, q, q, None, 0.0)
        F.dropout(x, 0.0)
        F.dropout(x, 0.5, training=False)
        F.dropout(x, 0.5, False)
        F.alpha_dropout(x, 0.5)  # alpha dropout is off unless training=True
    assert task.draws == 0
    with task:
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
        F.dropout(x, 0.5)
        F.alpha_dropout(x, 0.5, training=True)
        torch.rand(3)
    assert task.draws == 4
