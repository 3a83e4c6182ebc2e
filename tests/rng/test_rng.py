"""Randomness inside a pipeline: reproducible, replayed exactly by recomputation."""

import copy

import pytest
import torch
from torch import nn

from fastpipe import Pipe
from fastpipe.rng.streams import TaskRNG, task_seed


def dropout_model():
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.Dropout(0.3),
        nn.ReLU(),
        nn.Linear(32, 32),
        nn.Dropout(0.5),
        nn.Linear(32, 16),
        nn.AlphaDropout(0.2),
        nn.Linear(16, 4),
    )


def run(checkpoint, seed=7, chunks=4):
    pipe = Pipe(dropout_model(), balance=[3, 3, 2], chunks=chunks, checkpoint=checkpoint)
    torch.manual_seed(seed)
    x = torch.randn(12, 16, requires_grad=True)
    out = pipe(x)
    out.square().sum().backward()
    return out.detach(), x.grad, [p.grad.clone() for p in pipe.parameters()]


def test_checkpoint_modes_give_identical_bits():
    never = run("never")
    for mode in ("always", "except_last"):
        other = run(mode)
        assert torch.equal(never[0], other[0]), mode
        assert torch.equal(never[1], other[1]), mode
        for a, b in zip(never[2], other[2]):
            assert torch.equal(a, b), mode


def test_fixed_seed_is_reproducible_and_seed_matters():
    a, b, c = run("except_last", seed=3), run("except_last", seed=3), run("except_last", seed=4)
    assert torch.equal(a[0], b[0])
    assert not torch.equal(a[0], c[0])


def test_dropout_actually_drops():
    pipe = Pipe(nn.Sequential(nn.Identity(), nn.Dropout(0.5)), balance=[1, 1], chunks=2)
    out = pipe(torch.ones(64, 64))
    frac = (out == 0).float().mean().item()
    assert 0.45 < frac < 0.55
    assert set(out.unique().tolist()) <= {0.0, 2.0}


def test_micro_batches_get_different_masks():
    pipe = Pipe(nn.Sequential(nn.Identity(), nn.Dropout(0.5)), balance=[1, 1], chunks=2)
    out = pipe(torch.ones(2, 256))
    assert not torch.equal(out[0], out[1])


def test_caller_generator_advances_once_per_step():
    pipe = Pipe(dropout_model(), balance=[4, 4], chunks=2)
    torch.manual_seed(5)
    pipe(torch.randn(4, 16))
    after_one = torch.rand(1)
    torch.manual_seed(5)
    torch.randn(4, 16)
    torch.empty((), dtype=torch.int64).random_(0, 1 << 62)
    assert torch.equal(after_one, torch.rand(1))


def test_eval_has_no_dropout():
    model = dropout_model()
    ref = copy.deepcopy(model).eval()
    pipe = Pipe(model, balance=[4, 4], chunks=3).eval()
    x = torch.randn(6, 16)
    torch.testing.assert_close(pipe(x), ref(x))


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: nn.functional.dropout(x, 0.4),
        lambda x: nn.functional.dropout2d(x.view(4, 4, 2, 2), 0.4),
        lambda x: nn.functional.dropout1d(x.view(4, 4, 4), 0.4),
        lambda x: nn.functional.alpha_dropout(x, 0.4, training=True),
        lambda x: nn.functional.feature_alpha_dropout(x.view(4, 4, 4), 0.4, training=True),
        lambda x: torch.rand(3) + torch.randn(2).sum() + torch.randint(0, 9, (2,)).sum(),
        lambda x: x.clone().uniform_() + x.clone().normal_() + x.clone().bernoulli_(0.5),
        lambda x: torch.randn_like(x) + torch.rand_like(x),
        lambda x: torch.multinomial(x.abs() + 0.1, 2),
    ],
)
def test_task_rng_replays_every_random_op(fn):
    x = torch.randn(4, 16)
    with TaskRNG(task_seed(11, 1, 2)):
        a = fn(x)
    torch.rand(5)  # disturb the global generator in between
    with TaskRNG(task_seed(11, 1, 2)):
        b = fn(x)
    with TaskRNG(task_seed(11, 1, 3)):
        c = fn(x)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_task_dropout_matches_torch_arithmetic():
    # The mask source differs from torch's, the arithmetic must not: kept values are x/(1-p).
    x = torch.randn(64, 64)
    with TaskRNG(3):
        y = nn.functional.dropout(x, 0.25)
    kept = y != 0
    torch.testing.assert_close(y[kept], x[kept] / 0.75)


def test_dropout_inplace_and_p_edges():
    x = torch.ones(8, 8)
    with TaskRNG(1):
        assert torch.equal(nn.functional.dropout(x, 0.0), x)
        assert torch.count_nonzero(nn.functional.dropout(x, 1.0)) == 0
        y = x.clone()
        nn.functional.dropout(y, 0.5, inplace=True)
        assert torch.count_nonzero(y) < 64
        with pytest.raises(ValueError, match="between 0 and 1"):
            nn.functional.dropout(x, 1.5)


def test_task_seeds_are_distinct():
    seeds = {task_seed(123, s, m) for s in range(8) for m in range(64)}
    assert len(seeds) == 8 * 64
    assert all(0 <= s < 2**63 for s in seeds)
