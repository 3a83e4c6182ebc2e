"""Skip connections across stages: a pipe with stash/pop skips computes what the plain model computes.

The property is the plain model's result: ``Pipe(unet)`` equals ``fastpipe.Sequential(...)``,
outputs and gradients, under every schedule and checkpoint mode, while each skip travels
straight from the stage that stashes it to the stage that pops it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _unet import K, Up, unet
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe
from fastpipe.runtime.transport import LocalTransport


def by_hand(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The same U-Net written out with explicit skips."""
    d1 = model[1](model[0](x))
    d2 = model[4](model[3](d1))
    y = model[7](model[6](d2))
    y = model[8](y, d2=d2)
    return model[10](model[9](y, d1=d1))


def check_grads(pipe: nn.Module, ref: nn.Module) -> None:
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, name
        assert_close_reordered(p.grad, q.grad, k=K, msg=name)


def check_train_step(pipe: Pipe, ref: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """``pipe.train_step`` gives the plain model's loss and gradients."""
    loss = pipe.train_step(x, y, nn.MSELoss())
    loss_ref = nn.MSELoss()(ref(x), y)
    loss_ref.backward()
    assert_close_reordered(loss, loss_ref.detach(), k=K)
    check_grads(pipe, ref)


def test_the_plain_sequential_passes_each_stash_to_its_pop():
    model = unet()
    x = torch.randn(5, 6)
    assert torch.equal(model(x), by_hand(model, x))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("balance", [[3, 5, 3], [5, 6], [1, 8, 2]])
def test_forward_and_backward_equal_the_plain_model(checkpoint, balance):
    ref = unet()
    pipe = Pipe(copy.deepcopy(ref), balance=balance, chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = pipe(x), ref(x_ref)
    assert_close_reordered(out, out_ref, k=K)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    check_grads(pipe, ref)
    assert_close_reordered(x.grad, x_ref.grad, k=K)


SCHEDULES = [("gpipe", 1, [3, 5, 3]), ("1f1b", 1, [3, 5, 3]), ("zb-h1", 1, [3, 5, 3]), ("interleaved", 2, [3, 3, 2, 3])]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize(("schedule", "virtual", "balance"), SCHEDULES)
def test_train_step_equals_the_plain_model(schedule, virtual, balance, checkpoint):
    ref = unet(1)
    pipe = Pipe(
        copy.deepcopy(ref), balance=balance, chunks=4, schedule=schedule, virtual_stages=virtual, checkpoint=checkpoint
    )
    check_train_step(pipe, ref, torch.randn(8, 6), torch.randn(8, 3))


class SpyTransport(LocalTransport):
    """Records what crosses between stages."""

    def __init__(self, *args, log: list, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log = log

    def send_activation(self, stage, microbatch, value, requires_grad):
        self.log.append(("act", stage, tuple(t.shape for t in fastpipe.step.microbatch.tensors_of(value))))
        super().send_activation(stage, microbatch, value, requires_grad)

    def send_skip(self, producer, consumer, microbatch, value, requires_grad):
        self.log.append(("skip", producer, consumer, tuple(t.shape for t in value)))
        super().send_skip(producer, consumer, microbatch, value, requires_grad)

    def send_skip_grad(self, producer, consumer, microbatch, grads):
        self.log.append(("skip_grad", producer, consumer, tuple(g.shape for g in grads)))
        super().send_skip_grad(producer, consumer, microbatch, grads)


def spy_on(pipe: Pipe) -> list:
    log: list = []
    runtime = pipe.runtime
    runtime.transport = lambda: SpyTransport(  # type: ignore[method-assign]
        [st.device for st in runtime.stages], force_copy=runtime.copy_same_device, log=log
    )
    return log


def test_a_skip_goes_straight_to_its_consumer_not_through_the_stage_between():
    pipe = Pipe(unet(), balance=[3, 5, 3], chunks=2)
    log = spy_on(pipe)
    pipe.train_step(torch.randn(4, 6), torch.randn(4, 3), nn.MSELoss())
    # Stage 1 receives the one activation of width 8 only, stage 2 the one of width 4.
    assert (
        sorted(e for e in log if e[0] == "act" and e[1] > 0)
        == [("act", 1, ((2, 8),))] * 2 + [("act", 2, ((2, 4),))] * 2
    )
    assert sorted(e for e in log if e[0] != "act") == sorted(
        [("skip", 0, 2, ((2, 8),)), ("skip", 1, 2, ((2, 6),))] * 2
        + [("skip_grad", 0, 2, ((2, 8),)), ("skip_grad", 1, 2, ((2, 6),))] * 2
    )


def test_a_stash_and_its_pop_on_one_stage_stay_local():
    pipe = Pipe(unet(), balance=[2, 9], chunks=2)  # both skips are stashed and popped on stage 1
    log = spy_on(pipe)
    pipe.train_step(torch.randn(4, 6), torch.randn(4, 3), nn.MSELoss())
    assert [e for e in log if e[0] != "act"] == []


def test_the_skips_cross_devices_through_the_copy_path():
    ref = unet()
    pipe = Pipe(copy.deepcopy(ref), balance=[3, 5, 3], chunks=4)
    pipe.runtime.copy_same_device = True
    check_train_step(pipe, ref, torch.randn(8, 6), torch.randn(8, 3))


def test_the_backward_on_a_device_thread_runs_the_skips_inline(emu):
    # Stages 0 and 2 on the emulated accelerator: the node's backward runs on its engine
    # thread, which runs their backwards inline; stage 1 keeps its worker.
    ref = unet()
    pipe = Pipe(copy.deepcopy(ref), balance=[3, 5, 3], devices=[emu, torch.device("cpu"), emu], chunks=4)
    x = torch.randn(8, 6)
    pipe(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None, name
        assert_close_reordered(p.grad.cpu(), q.grad, k=K, msg=name)


def test_a_recomputed_producer_stashes_the_same_dropout_mask():
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    results = []
    for checkpoint in ("never", "always"):
        pipe = Pipe(unet(dropout=0.5), balance=[3, 5, 3], chunks=4, checkpoint=checkpoint)
        torch.manual_seed(7)
        loss = pipe.train_step(x, y, nn.MSELoss())
        results.append((loss, [p.grad for p in pipe.parameters()]))
    (loss_kept, grads_kept), (loss_recomputed, grads_recomputed) = results
    assert torch.equal(loss_kept, loss_recomputed)
    assert all(torch.equal(a, b) for a, b in zip(grads_kept, grads_recomputed, strict=True))


def test_a_stashed_input_that_needs_no_gradient_gets_none():
    torch.manual_seed(0)
    model = fastpipe.Sequential(
        fastpipe.stash("raw"), nn.Linear(6, 6), nn.Tanh(), fastpipe.pops(Up("raw", 6, 6, 3), "raw"), nn.Linear(3, 3)
    )
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 3], chunks=2)
    check_train_step(pipe, ref, torch.randn(4, 6), torch.randn(4, 3))


def test_a_skip_in_a_nested_sequential_and_a_class_declaration():
    class Join(nn.Module):
        fastpipe_pops = ("early",)

        def forward(self, x, early):
            return x + early

    torch.manual_seed(0)
    model = fastpipe.Sequential(
        nn.Sequential(nn.Linear(4, 4), fastpipe.stash("early")), nn.Linear(4, 4), nn.Tanh(), Join(), nn.Linear(4, 2)
    )
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 2, 2], chunks=2)
    check_train_step(pipe, ref, torch.randn(4, 4), torch.randn(4, 2))


# -- declarations that cannot work ----------------------------------------------------


def seq(*layers: nn.Module) -> fastpipe.Sequential:
    return fastpipe.Sequential(*layers)


def join(*names: str) -> nn.Module:
    class Join(nn.Module):
        def forward(self, x, **skips):
            return x + sum(skips.values())

    return fastpipe.pops(Join(), *names)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda: seq(nn.Tanh(), join("a"), nn.Tanh()), r"layer '1' pops 'a', but no layer stashes it"),
        (
            lambda: seq(join("a"), nn.Tanh(), fastpipe.stash("a")),
            r"layer '0' pops 'a', but layer '2' stashes it only after",
        ),
        (
            lambda: seq(fastpipe.stash("a"), fastpipe.stash("a"), join("a")),
            r"'a' is stashed twice \(layers '0' and '1'\)",
        ),
        (
            lambda: seq(fastpipe.stash("a"), join("a"), join("a")),
            r"'a' is popped twice \(layers '1' and '2'\).*stash the tensor twice",
        ),
        (lambda: seq(fastpipe.stash("a"), nn.Tanh(), nn.Tanh()), r"layer '0' stashes 'a', but no later layer pops it"),
        (
            lambda: seq(nn.ModuleDict({"inner": fastpipe.stash("a")}), join("a"), nn.Tanh()),
            r"fastpipe.stash\('a'\) sits at 0.inner, inside layer '0'",
        ),
    ],
)
def test_bad_declarations_are_refused_when_the_pipe_is_built(model, message):
    with pytest.raises(ValueError, match=message):
        Pipe(model(), balance=[1, 1, 1])
    with pytest.raises(ValueError, match=message):  # and by the plain model, on its call
        model()(torch.randn(2, 3))


def test_names_must_be_keyword_names():
    with pytest.raises(TypeError, match="keyword argument name"):
        fastpipe.stash("not a name")
    with pytest.raises(TypeError, match="keyword argument name"):
        fastpipe.pops(nn.Tanh(), "1x")
    with pytest.raises(TypeError, match="expected an nn.Module"):
        fastpipe.pops(lambda x: x, "a")  # type: ignore[type-var]


def test_a_stash_of_a_tuple_is_refused_with_what_to_do():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x

    pipe = Pipe(seq(Pair(), fastpipe.stash("a"), nn.Identity(), join("a")), balance=[2, 2], chunks=1)
    with pytest.raises(TypeError, match=r"stash\('a'\) received tuple; a stash records a Tensor"):
        pipe((torch.randn(2, 3),))


def test_a_name_both_popped_and_taken_as_a_side_input_is_refused():
    layer = fastpipe.takes(join("a"), "a")
    model = seq(fastpipe.stash("a"), layer)
    with pytest.raises(TypeError, match=r"takes \['a'\] both as a side input and as a skip"):
        model(torch.randn(2, 3), a=torch.ones(2, 3))


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_fit_with_skips_trains_like_the_plain_model(checkpoint):
    ref = unet(2)
    pipe = Pipe(copy.deepcopy(ref), balance=[3, 5, 3], chunks=4, checkpoint=checkpoint)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(4)]
    losses = list(pipe.fit(batches, nn.MSELoss(), opt, consistency="sync", window=2))
    for (x, y), loss in zip(batches, losses, strict=True):
        ref_opt.zero_grad()
        loss_ref = nn.MSELoss()(ref(x), y)
        loss_ref.backward()
        ref_opt.step()
        assert_close_reordered(torch.as_tensor(loss), loss_ref.detach(), k=4 * K)
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p.detach(), q.detach(), k=4 * K, msg=name)
