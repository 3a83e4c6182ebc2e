"""A loss that declares what its mean divides by pipelines exactly; one that cannot be read warns.

``fastpipe.token_loss(summed, normaliser)`` (or any object with ``summed`` and ``normaliser``)
is run as its sum per micro-batch, divided by the mini-batch's normaliser: the result equals
the loss on the whole batch even when micro-batches hold different numbers of valid tokens.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.step.rules import TokenNormalised


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))


def masked_mse() -> fastpipe.TokenLoss:
    """A mean over the entries a mask keeps (a data-dependent count per micro-batch)."""
    return fastpipe.token_loss(
        lambda out, y: ((out - y[0]).square() * y[1]).sum(),
        lambda y: y[1].sum(),
    )


def batch() -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 6, generator=g), torch.randn(9, 3, generator=g)
    mask = torch.zeros(9, 3)
    mask[0, 0] = 1  # micro-batch 0: one entry; 1: none at all; 2: all of them
    mask[6:] = 1
    return x, (y, mask)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_a_declared_normaliser_weighs_micro_batches_exactly(schedule):
    loss_fn = masked_mse()
    assert isinstance(loss_fn, TokenNormalised)
    x, y = batch()
    plain, piped = model(), model()
    pipe = Pipe(piped, balance=[2, 1], chunks=3, schedule=schedule)
    loss = pipe.train_step(x, y, loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    assert_close_reordered(loss, expected.detach(), k=32)
    for p, q in zip(pipe.parameters(), plain.parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=32)
    # Weighed by samples, the same loss would be far off: the check above can fail.
    sample_weighted = sum(
        loss_fn(plain(xm), (ym, mm)) * len(xm) / 9
        for xm, ym, mm in zip(x.chunk(3), y[0].chunk(3), y[1].chunk(3))
        if mm.sum()
    )
    assert abs(float(sample_weighted) - float(expected)) > 1e-2


class OwnLoss:
    """The protocol without the helper: any object with summed and normaliser."""

    reduction = "mean"

    def summed(self, out, y):
        return (out - y).abs().sum()

    def normaliser(self, y):
        return float(y.numel())

    def __call__(self, out, y):
        return self.summed(out, y) / self.normaliser(y)


def test_an_object_with_summed_and_normaliser_is_exact_too():
    x, y = torch.randn(7, 6), torch.randn(7, 3)  # 7 rows in 3 chunks: 3, 3, 1
    plain, piped = model(), model()
    loss = Pipe(piped, balance=[2, 1], chunks=3).train_step(x, y, OwnLoss())
    expected = OwnLoss()(plain(x), y)
    assert_close_reordered(loss, expected.detach(), k=32)


def test_a_function_without_a_reduction_warns_once_it_matters():
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    pipe = Pipe(model(), balance=[2, 1], chunks=2)
    with pytest.warns(UserWarning, match="cannot tell how loss_fn mse_loss reduces.*fastpipe.token_loss"):
        pipe.train_step(x, y, nn.functional.mse_loss)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message="fastpipe: chunks=1")  # the chunks=1 pipe below does not pipeline
        pipe.train_step(x, y, nn.MSELoss())  # reduction="mean" says it: no warning
        Pipe(model(), balance=[2, 1], chunks=1).train_step(x, y, nn.functional.mse_loss)  # one micro-batch
