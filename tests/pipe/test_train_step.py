"""Pipe.train_step runs every schedule with the plain Sequential's loss and gradients."""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe

SCHEDULES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("zb-h1", 1),
    ("interleaved", 2),
    ("zb-h2", 1),
    ("zb-v", 2),
    ("dualpipev", 2),
]
# Reductions from input to loss (Linear and LayerNorm widths, the loss's mean), plus the rows a
# weight gradient sums over: micro-batches against the full batch round differently.
K = 8 + 16 + 16 + 16 + 8 + 8 * 16 + 16


def balance_for(name, virtual):
    """4 workers of 2 layers, or 8 stages of 1 on 4 workers; DualPipeV's 4 micro-batches need 4 stages, 2 workers."""
    if name == "dualpipev":
        return [2, 2, 2, 2]
    return [2, 2, 2, 2] if virtual == 1 else [1] * 8


def model():
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Linear(8, 16),
        nn.GELU(),
        nn.LayerNorm(16),
        nn.Linear(16, 16),
        nn.Dropout(0.2),
        nn.Tanh(),
        nn.Linear(16, 8),
        nn.Sequential(nn.Linear(8, 8), nn.ReLU()),
    )


def reference(x, y, loss_fn):
    ref = model().eval()  # dropout makes train-mode runs incomparable to a plain model
    loss = loss_fn(ref(x), y)
    loss.backward()
    return loss, [p.grad for p in ref.parameters()]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("name, virtual", SCHEDULES)
@pytest.mark.parametrize("batch", [16, 13])  # 13 in 4 chunks: 4, 4, 4, 1
def test_loss_and_grads_match_plain(name, virtual, checkpoint, batch):
    x, y = torch.randn(batch, 8), torch.randn(batch, 8)
    loss_ref, grads_ref = reference(x, y, nn.MSELoss())
    balance = balance_for(name, virtual)
    pipe = Pipe(model(), balance=balance, chunks=4, checkpoint=checkpoint).eval()
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=name, virtual_stages=virtual)
    assert_close_reordered(loss, loss_ref.detach(), k=K)
    for (n, p), g in zip(pipe.named_parameters(), grads_ref):
        assert_close_reordered(p.grad, g, k=K, msg=n)


@pytest.mark.parametrize("name, virtual", SCHEDULES)
def test_sum_reduction_and_function_loss(name, virtual):
    x, y = torch.randn(12, 8), torch.randn(12, 8)
    balance = balance_for(name, virtual)
    for loss_fn in (nn.MSELoss(reduction="sum"), lambda out, t: ((out - t) ** 2).mean()):
        loss_ref, grads_ref = reference(x, y, loss_fn)
        pipe = Pipe(model(), balance=balance, chunks=4).eval()
        loss = pipe.train_step(x, y, loss_fn, schedule=name, virtual_stages=virtual)
        assert_close_reordered(loss, loss_ref.detach(), k=K)
        for p, g in zip(pipe.parameters(), grads_ref):
            assert_close_reordered(p.grad, g, k=K)


@pytest.mark.parametrize("name, virtual", SCHEDULES)
def test_dropout_identical_across_schedules_and_checkpointing(name, virtual):
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    balance = balance_for(name, virtual)
    results = []
    for sched, v, bal, ck in (
        (name, virtual, balance, "never"),
        (name, virtual, balance, "always"),
        ("gpipe", 1, [2, 2, 2, 2], "never"),
    ):
        pipe = Pipe(model(), balance=bal, chunks=4, checkpoint=ck)
        torch.manual_seed(9)
        loss = pipe.train_step(x, y, nn.MSELoss(), schedule=sched, virtual_stages=v)
        results.append((loss, [p.grad.clone() for p in pipe.parameters()]))
    # The same (stage, micro-batch) tasks draw the same masks whatever the order they run in,
    # as long as the stages are the same: compare the two runs of the same balance.
    assert torch.equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)
    if balance == [2, 2, 2, 2]:  # the same stages as the GPipe run: the same masks, the same loss
        assert torch.equal(results[0][0], results[2][0])


def test_grads_accumulate_across_steps():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = Pipe(model(), balance=[4, 4], chunks=2).eval()
    pipe.train_step(x, y, nn.MSELoss())
    once = [p.grad.clone() for p in pipe.parameters()]
    pipe.train_step(x, y, nn.MSELoss())
    for p, g in zip(pipe.parameters(), once):
        torch.testing.assert_close(p.grad, 2 * g)


def test_integer_targets_and_cross_entropy():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(20, 8), nn.Flatten(), nn.Linear(24, 5))
    ref = copy.deepcopy(net)
    x, y = torch.randint(0, 20, (10, 3)), torch.randint(0, 5, (10,))
    loss_ref = nn.functional.cross_entropy(ref(x), y)
    loss_ref.backward()
    pipe = Pipe(net, balance=[1, 2], chunks=3)
    loss = pipe.train_step(x, y, nn.CrossEntropyLoss(), schedule="1f1b")
    torch.testing.assert_close(loss, loss_ref.detach())
    for p, q in zip(pipe.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_trace_records_every_action():
    pipe = Pipe(model(), balance=[2, 2, 2, 2], chunks=4)
    pipe.train_step(torch.randn(8, 8), torch.randn(8, 8), nn.MSELoss(), schedule="zb-h1", trace=True)
    timeline = pipe.last_timeline
    assert timeline is not None
    kinds = sorted(e.action for e in timeline.events)
    assert len(kinds) == 4 * 4 * 3  # F, B, W per (stage, micro-batch)
    assert all(e.end >= e.start for e in timeline.events)
