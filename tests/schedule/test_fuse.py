"""fuse_backward: a B directly followed by its own W runs as one BW; the result is a valid schedule
that trains like the plain model, and a caller's Schedule runs in train_step as given."""

from __future__ import annotations

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe.schedule import SCHEDULES, build
from fastpipe.schedule.fuse import fuse_backward

K = 16  # reductions on a gradient's path: 4 Linears of width 8, 8 rows


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "interleaved"])
def test_only_adjacent_pairs_fuse_and_the_result_validates(name: str) -> None:
    s = build(name, 3, 6)
    fused = fuse_backward(s)
    pairs = {
        (a.stage, a.microbatch)
        for w in s.workers
        for a, b in zip(w, w[1:])
        if a.kind == "B" and b.kind == "W" and (a.stage, a.microbatch) == (b.stage, b.microbatch)
    }
    assert {(a.stage, a.microbatch) for w in fused.workers for a in w if a.kind == "BW"} == pairs | {
        (a.stage, a.microbatch) for w in s.workers for a in w if a.kind == "BW"
    }
    assert fused.placement == s.placement and fused.name == f"{s.name}+fused"
    assert sum(len(w) for w in fused.workers) == sum(len(w) for w in s.workers) - len(pairs)


def test_fusing_zb_v_keeps_its_deferred_weight_passes() -> None:
    fused = fuse_backward(build("zb-v", 2, 8))
    kinds = [a.kind for w in fused.workers for a in w]
    assert kinds.count("BW") == 29 and kinds.count("B") == kinds.count("W") == 3  # the cool-down's W's stay apart


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_fused_schedule_trains_like_the_plain_model(checkpoint: str) -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = fastpipe.Pipe(model(), [1, 1, 1, 1], chunks=4, schedule="zb-v", virtual_stages=2, checkpoint=checkpoint)
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=fuse_backward(build("zb-v", 2, 4)))
    ref = model()
    ref_loss = nn.MSELoss()(ref(x), y)
    ref_loss.backward()
    assert_close_reordered(loss, ref_loss.detach(), k=K)
    for (name, p), q in zip(pipe.named_parameters(), ref.parameters()):
        assert_close_reordered(p.grad, q.grad, k=K, msg=name)


def test_a_schedule_that_does_not_fit_the_step_is_refused() -> None:
    pipe = fastpipe.Pipe(model(), [2, 2], chunks=4)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with pytest.raises(ValueError, match="is for 2 stages and 8 micro-batches; this step has 2 stages and 4"):
        pipe.train_step(x, y, nn.MSELoss(), schedule=build("1f1b", 2, 8))
    with pytest.raises(ValueError, match="a stream of mini-batches"):
        from fastpipe.schedule.multistep import build_multistep

        pipe.train_step(x, y, nn.MSELoss(), schedule=build_multistep(2, 2, 2, flush=True))
