"""A layer used twice in the Sequential (a tied weight) is kept in both places, never dropped.

``named_children()`` and ``parameters()`` skip objects seen before, so walking them would
silently lose the second use. Within one stage both uses run, as in the Sequential; across
stages see test_tied_across_stages.py.
"""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

from fastpipe import Pipe
from fastpipe.balance import profile_layers
from fastpipe.model.partition import tied_blocks


def tied_model():
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.ReLU(), shared, nn.Tanh())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_layer_used_twice_in_one_stage_equals_the_model(checkpoint, chunks):
    model = tied_model()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[3, 1], chunks=chunks, checkpoint=checkpoint)
    assert len(pipe) == 4 and pipe[2] is pipe[0]
    assert list(pipe.state_dict()) == list(ref.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    x = torch.randn(6, 4, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = pipe(x)
    # Bitwise against the plain model on the same micro-batches (same GEMM shapes).
    assert torch.equal(out, torch.cat([ref(c) for c in xr.detach().chunk(chunks)]))
    out_ref = ref(xr)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    assert_close_reordered(x.grad, xr.grad, k=8)
    (shared, *_), (shared_ref, *_) = pipe.partitions[0], ref
    # One parameter, two uses: its gradient is the sum of both, as in the Sequential.
    assert_close_reordered(shared.weight.grad, shared_ref.weight.grad, k=8 + 6)
    assert_close_reordered(shared.bias.grad, shared_ref.bias.grad, k=8 + 6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_layer_used_twice_under_train_step(schedule):
    model = nn.Sequential(nn.Linear(4, 4), *tied_model(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 4, 1], chunks=2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    loss = pipe.train_step(x, y, nn.MSELoss(), schedule=schedule)
    loss_ref = nn.MSELoss()(ref(x), y)
    loss_ref.backward()
    assert_close_reordered(loss, loss_ref.detach(), k=8 + 6)
    for p, q in zip(pipe.parameters(), ref.parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=16 + 6)


def test_stateless_module_reused_across_stages_runs():
    act = nn.Tanh()
    model = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 4), act)
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], chunks=2)
    x = torch.randn(4, 4)
    assert torch.equal(pipe(x), torch.cat([ref(c) for c in x.chunk(2)]))
    assert list(pipe.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize(
    "build, blocks",
    [
        (lambda s: [s, nn.ReLU(), s, nn.Tanh()], [3, 1]),
        (lambda s: [nn.ReLU(), s, nn.Tanh(), s, nn.ReLU()], [1, 3, 1]),
        (lambda s: [nn.ReLU(), s, nn.Sequential(nn.ReLU(), s)], [1, 2]),
        (lambda s: [s, s.__class__(4, 4), nn.ReLU()], [1, 1, 1]),
    ],
    ids=["repeat", "inner repeat", "nested", "untied"],
)
def test_tied_blocks(build, blocks):
    assert tied_blocks(nn.Sequential(*build(nn.Linear(4, 4)))) == blocks


def test_auto_balance_plans_tied_layers_across_stages():
    shared = nn.Linear(4, 4)
    pipe = Pipe(
        nn.Sequential(shared, nn.ReLU(), shared, nn.Tanh()),
        balance="auto",
        devices=["cpu"] * 3,
        sample=torch.randn(8, 4),
        chunks=2,
    )
    assert len(pipe.balance) == 3 and sum(pipe.balance) == 4
    x = torch.randn(8, 4)
    assert_close_reordered(pipe(x), pipe[3](pipe[2](pipe[1](pipe[0](x)))), k=8)


def test_deferred_batch_norm_used_twice_is_refused():
    bn = nn.BatchNorm1d(4)
    with pytest.raises(ValueError, match="BatchNorm layer is used twice.*own BatchNorm, or pass deferred_batch_norm="):
        Pipe(nn.Sequential(bn, nn.ReLU(), bn), balance=[3], deferred_batch_norm=True)
    block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with pytest.raises(ValueError, match="BatchNorm layer is used twice"):
        Pipe(nn.Sequential(block, nn.ReLU(), block), balance=[3], deferred_batch_norm=True)
    Pipe(nn.Sequential(bn, nn.ReLU(), bn), balance=[3])  # undeferred, it runs as in the Sequential


def test_profile_covers_every_use_of_a_layer():
    profile = profile_layers(tied_model(), torch.randn(2, 4), repeats=1)
    assert len(profile.forward) == 4


def _distributed_tied(rank, world):
    from fastpipe.distributed_pipe import DistributedPipe

    out = {}
    for balance in ([3, 2], [1, 4]):  # both uses in one stage; then one on each rank
        torch.manual_seed(0)
        model = nn.Sequential(*tied_model(), nn.Linear(4, 2))
        ref = copy.deepcopy(model)
        pipe = DistributedPipe(model, balance, chunks=2, timeout=20)
        x, y = torch.randn(6, 4), torch.randn(6, 2)
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, nn.MSELoss())
        loss_ref = nn.MSELoss()(ref(x), y)
        loss_ref.backward()
        grads = dict(ref.named_parameters(remove_duplicate=False))
        out[str(balance)] = {
            "loss": (loss, loss_ref.detach()),
            "keys": list(pipe.state_dict()),
            "grads": [(n, p.grad, grads[n].grad) for n, p in pipe.named_parameters()],
        }
        pipe.close()
    return out


def test_distributed_pipe_keeps_a_layer_used_twice_in_a_stage_and_across_ranks():
    from _dist_utils import check_ok, run_ranks

    first, last = check_ok(run_ranks(_distributed_tied, 2, timeout=60))
    assert first["[3, 2]"]["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert last["[3, 2]"]["keys"] == ["4.weight", "4.bias"]
    # Across ranks each holds the layer under the name of its use there.
    assert first["[1, 4]"]["keys"] == ["0.weight", "0.bias"]
    assert last["[1, 4]"]["keys"] == ["2.weight", "2.bias", "4.weight", "4.bias"]
    for outcome in (first, last):
        for case in outcome.values():
            assert_close_reordered(*case["loss"], k=8 + 6)
            for name, grad, grad_ref in case["grads"]:  # the shared layer's: the sum of both uses
                assert_close_reordered(grad, grad_ref, k=16 + 6, msg=name)


def test_checkpoint_of_a_tied_model_loads_into_the_sequential_and_another_balance(tmp_path):
    import fastpipe

    pipe = Pipe(tied_model(), balance=[3, 1], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), nn.MSELoss())
    opt.step()
    fastpipe.save(pipe, str(tmp_path / "tied.pt"), opt)
    for into in (tied_model(), Pipe(tied_model(), balance=[4])):
        opt2 = torch.optim.SGD(into.parameters(), lr=0.1, momentum=0.9)
        fastpipe.load(str(tmp_path / "tied.pt"), into, opt2)
        assert into[2] is into[0]  # still one module in two places
        assert all(torch.equal(a, b) for a, b in zip(into.state_dict().values(), pipe.state_dict().values()))
        for p, q in zip(into.parameters(), pipe.parameters(), strict=True):
            assert torch.equal(opt2.state[p]["momentum_buffer"], opt.state[q]["momentum_buffer"])
