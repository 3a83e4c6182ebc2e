"""A mean over targets, not samples: cross-entropy with ``ignore_index`` or class weights equals the plain loss.

Padded batches give micro-batches different numbers of targets that count, so weighing each
micro-batch's mean by its samples is off the plain ``loss_fn(model(x), y)``. fastpipe runs
such losses sum-reduced per micro-batch and divides by the mini-batch's target weight.
"""

from __future__ import annotations

import pytest
import torch
from _dist_utils import check_ok, run_ranks
from fp_tolerance import assert_close_reordered, close_reordered
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from fastpipe import DistributedPipe, Pipe
from fastpipe.step.rules import microbatch_loss, microbatch_weights, target_weight

CLASSES, HIDDEN, K = 7, 16, 64


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, CLASSES))


def padded_batch(rows: int = 12, ignored: tuple[int, ...] = (0, 1, 2, 3, 7)) -> tuple[torch.Tensor, torch.Tensor]:
    """With chunks=3, the first micro-batch's targets are all ignored and the others differ in count."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, HIDDEN, generator=g)
    y = torch.randint(0, CLASSES, (rows,), generator=g)
    y[list(ignored)] = -100
    return x, y


def check_step(
    loss_fn: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    chunks: int = 3,
    head: tuple[nn.Module, ...] = (),
    balance: tuple[int, ...] = (2, 2),
    **kwargs: object,
) -> None:
    """``train_step``'s loss and gradients against the plain model's, ``head`` layers appended to both."""
    plain, piped = model(), model()
    for layer in head:
        plain.append(layer)
        piped.append(layer)
    pipe = Pipe(piped, balance=list(balance), chunks=chunks, **kwargs)
    loss = pipe.train_step(x, y, loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    assert_close_reordered(loss, expected, k=K)
    for p, q in zip(pipe.parameters(), plain.parameters()):
        assert_close_reordered(p.grad, q.grad, k=K)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_ignore_index_equals_the_plain_loss(schedule: str, checkpoint: str) -> None:
    x, y = padded_batch()
    check_step(nn.CrossEntropyLoss(ignore_index=-100), x, y, schedule=schedule, checkpoint=checkpoint)


@pytest.mark.parametrize(
    "loss_fn",
    [
        nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES)),
        nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES), ignore_index=3, label_smoothing=0.1),
        nn.CrossEntropyLoss(label_smoothing=0.2),
    ],
    ids=["class-weights", "weights-ignore-smoothing", "smoothing"],
)
def test_class_weights_and_smoothing(loss_fn: nn.Module) -> None:
    x, y = padded_batch(ignored=())
    y[5] = 3
    check_step(loss_fn, x, y)


def test_nll_loss_with_ignore_index() -> None:
    x, y = padded_batch()
    loss_fn = nn.NLLLoss(ignore_index=-100, weight=torch.linspace(1.0, 2.0, CLASSES))
    check_step(loss_fn, x, y, head=(nn.LogSoftmax(-1),), balance=(3, 2))


def test_tokens_along_a_sequence_dimension() -> None:
    # (batch, classes, positions) logits and (batch, positions) targets, as CrossEntropyLoss takes them.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, HIDDEN, generator=g)
    y = torch.randint(0, CLASSES, (6, 4), generator=g)
    y[0] = -100
    y[3, 1:] = -100
    head = (nn.Unflatten(1, (CLASSES, 1)), _Repeat(4))  # stateless: one instance serves both models
    check_step(nn.CrossEntropyLoss(ignore_index=-100), x, y, head=head, balance=(3, 3))


class _Repeat(nn.Module):
    """[batch, classes, 1] -> [batch, classes, n]: one logit per position, each position its own."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.expand(-1, -1, self.n) * torch.arange(1, self.n + 1, dtype=x.dtype)


def test_probability_targets_stay_weighted_by_samples() -> None:
    x, _ = padded_batch()
    probs = torch.softmax(torch.randn(12, CLASSES, generator=torch.Generator().manual_seed(3)), -1)
    loss_fn = nn.CrossEntropyLoss(weight=torch.linspace(0.5, 2.0, CLASSES))
    assert microbatch_loss(loss_fn, list(probs.split(4))) is loss_fn
    check_step(loss_fn, x, probs)


def test_a_subclass_with_its_own_forward_is_weighted_by_samples() -> None:
    class Halved(nn.CrossEntropyLoss):
        def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return super().forward(input, target) / 2

    loss_fn = Halved(ignore_index=-100)
    targets = list(padded_batch()[1].split(4))
    assert microbatch_loss(loss_fn, targets) is loss_fn
    assert microbatch_weights(loss_fn, targets, [4, 4, 4], "train_step") == [1 / 3] * 3


def test_the_callers_loss_is_left_alone_and_the_weights_count_targets() -> None:
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100, weight=torch.tensor([1.0, 2.0, 3.0]))
    targets = [torch.tensor([0, -100]), torch.tensor([2, 2, -100]), torch.tensor([-100])]
    assert target_weight(loss_fn, targets) == 1.0 + 3.0 + 3.0
    assert microbatch_weights(loss_fn, targets, [2, 3, 1], "train_step") == [1 / 7] * 3
    summed = microbatch_loss(loss_fn, targets)
    assert summed is not loss_fn and summed.reduction == "sum" and loss_fn.reduction == "mean"
    assert summed.weight is loss_fn.weight
    # Nothing counts: the plain mean is NaN, and so is the pipeline's.
    assert all(w != w for w in microbatch_weights(loss_fn, [torch.tensor([-100])], [1], "fit"))


def test_fit_sync_equals_train_step_then_step() -> None:
    batches = [padded_batch(ignored=ignored) for ignored in ((0, 1, 2, 3, 7), (5,), (8, 9, 10, 11))]
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    pipe_a, pipe_b = Pipe(model(), [2, 2], chunks=3), Pipe(model(), [2, 2], chunks=3)
    opt_a = torch.optim.SGD(pipe_a.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(pipe_b.parameters(), lr=0.1)
    plain = model()
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    fitted = [float(loss) for loss in pipe_a.fit(batches, loss_fn, opt_a, consistency="sync", window=2)]
    stepped, expected = [], []
    for x, y in batches:
        opt_b.zero_grad()
        stepped.append(float(pipe_b.train_step(x, y, loss_fn)))
        opt_b.step()
        opt_plain.zero_grad()
        plain_loss = loss_fn(plain(x), y)
        plain_loss.backward()
        opt_plain.step()
        expected.append(float(plain_loss.detach()))
    assert fitted == stepped  # bit for bit: the same schedule on the same micro-batches, the same arithmetic
    assert fitted == pytest.approx(expected, rel=1e-5)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(2, 12),
    chunks=st.integers(1, 4),
    mask=st.lists(st.booleans(), min_size=12, max_size=12),
    smoothing=st.sampled_from([0.0, 0.1]),
)
def test_any_padding_any_chunks(rows: int, chunks: int, mask: list[bool], smoothing: float) -> None:
    x, y = padded_batch(rows, ignored=tuple(i for i in range(rows) if mask[i]))
    if bool((y == -100).all()):
        y[0] = 1  # an all-padded batch is NaN in the plain model too
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=smoothing)
    check_step(loss_fn, x, y, chunks=min(chunks, rows))


def _distributed(rank: int, world: int) -> list[str]:
    problems = []
    x, y = padded_batch()
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    pipe = DistributedPipe(model(), [2, 2], chunks=3, schedule="1f1b", timeout=20)
    plain = model()
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, loss_fn)
    expected = loss_fn(plain(x), y)
    expected.backward()
    if not close_reordered(loss, expected, k=K):
        problems.append(f"rank {rank}: loss {loss.item()} != plain {expected.item()}")
    names = dict(plain.named_parameters())
    for name, p in pipe.named_parameters():
        if not close_reordered(p.grad, names[name].grad, k=K):
            problems.append(f"rank {rank}: gradient of {name}")
    # fit on the same ranks: each mini-batch's loss is its mean over the targets that count.
    batches = [padded_batch(ignored=ignored) for ignored in ((0, 1, 2, 3, 7), (8, 9, 10, 11))]
    fitted = DistributedPipe(model(), [2, 2], chunks=3, schedule="1f1b", timeout=20)
    opt = torch.optim.SGD(fitted.parameters(), lr=0.0)  # no update: every loss is the first weights'
    losses = [float(v) for v in fitted.fit(batches, loss_fn, opt, consistency="sync", window=2)]
    with torch.no_grad():
        plain_losses = [float(loss_fn(model()(x), y)) for x, y in batches]
    if losses != pytest.approx(plain_losses, rel=1e-5):
        problems.append(f"rank {rank}: fit losses {losses} != plain {plain_losses}")
    return problems


def test_distributed_pipe_equals_the_plain_loss() -> None:
    for problems in check_ok(run_ranks(_distributed, 2)):
        assert problems == []


def test_the_reference_is_not_already_sample_weighted() -> None:
    # Guards the tests above: with these batches, weighing micro-batch means by samples is off.
    x, y = padded_batch(ignored=(0, 1, 2, 7))
    loss_fn = nn.CrossEntropyLoss(ignore_index=-100)
    net = model()
    with torch.no_grad():
        exact = loss_fn(net(x), y)
        by_samples = sum(loss_fn(net(a), b) * len(b) / len(y) for a, b in zip(x.split(4), y.split(4)))
    assert not torch.allclose(exact, by_samples, rtol=1e-3)
