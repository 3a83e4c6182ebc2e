"""A tensor that layers on several stages share (a tied embedding) behaves as in the plain model.

The reader stages compute with copies, so the properties to protect are the plain model's:
the same outputs and gradients (the tied gradient summed over every use), one parameter for
the optimizer, the Sequential's ``state_dict``, and copies that never drift from the owner.
"""

import copy

import pytest
import torch
from fp_tolerance import assert_close_reordered
from torch import nn

import fastpipe
from fastpipe import Pipe


class Embed(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids)


def lm(vocab: int = 11, dim: int = 6, blocks: int = 2) -> nn.Sequential:
    """Embedding ... head, the head's weight being the embedding's (GPT-2's tie)."""
    embed = Embed(vocab, dim)
    head = nn.Linear(dim, vocab, bias=False)
    head.weight = embed.wte.weight
    body = [m for _ in range(blocks) for m in (nn.Linear(dim, dim), nn.Tanh())]
    return nn.Sequential(embed, *body, nn.LayerNorm(dim), head)


def reused_block() -> nn.Sequential:
    shared = nn.Linear(5, 5)
    return nn.Sequential(shared, nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), shared, nn.Tanh(), shared)


def _batch(model: nn.Sequential) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(model[0], Embed):
        return torch.randint(0, 11, (8, 4)), torch.randint(0, 11, (8, 4))
    return torch.randn(8, 5), torch.randn(8, 5)


def _loss(model: nn.Sequential):
    if isinstance(model[0], Embed):
        ce = nn.CrossEntropyLoss()
        return lambda out, y: ce(out.flatten(0, 1), y.flatten())
    return nn.MSELoss()


CASES = {
    "embedding-head, first and last stage": (lm, [1, 4, 2]),
    "embedding-head, 2 stages": (lm, [3, 4]),
    "module used on 3 stages": (reused_block, [2, 3, 2]),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_forward_and_backward_equal_the_model(case, checkpoint):
    build, balance = CASES[case]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=balance, chunks=3, checkpoint=checkpoint)
    assert pipe.ties, "the case must tie across stages"
    x, _ = _batch(model)
    out = pipe(x)
    out_ref = ref(x)
    assert_close_reordered(out, out_ref, k=16)
    out.square().sum().backward()
    out_ref.square().sum().backward()
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=64, msg=name)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_train_step_equals_the_model(case, schedule):
    build, balance = CASES[case]
    if schedule == "interleaved":
        balance = {3: [1, 2, 2, 2] if build is lm else [2, 2, 2, 1]}.get(len(balance), balance)
    torch.manual_seed(1)
    model = build()
    ref = copy.deepcopy(model)
    vs = 2 if schedule == "interleaved" else 1
    pipe = Pipe(model, balance=balance, chunks=4, schedule=schedule, virtual_stages=vs)
    x, y = _batch(model)
    loss = pipe.train_step(x, y, _loss(model))
    loss_ref = _loss(ref)(ref(x), y)
    loss_ref.backward()
    assert_close_reordered(loss, loss_ref.detach(), k=64)
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=64, msg=name)


def test_one_parameter_for_the_optimizer_and_the_sequentials_state_dict():
    model = lm()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 4, 2], chunks=2)
    assert len(list(pipe.parameters())) == len(list(ref.parameters()))
    assert list(pipe.state_dict()) == list(ref.state_dict())
    for key, value in pipe.state_dict().items():
        assert torch.equal(value, ref.state_dict()[key]), key
    assert pipe.state_dict()["6.weight"].data_ptr() == pipe.state_dict()["0.wte.weight"].data_ptr()
    x, y = _batch(model)
    pipe.train_step(x, y, _loss(model))
    _loss(ref)(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(pipe.parameters(), 1.0)
    norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    assert_close_reordered(norm, norm_ref, k=64)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_copies_never_drift_over_optimizer_steps(schedule):
    torch.manual_seed(2)
    model = lm()
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[1, 4, 2], chunks=3, schedule=schedule)
    opt = torch.optim.Adam(pipe.parameters(), lr=0.05)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.05)
    for _ in range(5):
        x, y = _batch(model)
        opt.zero_grad()
        opt_ref.zero_grad()
        pipe.train_step(x, y, _loss(model))
        _loss(ref)(ref(x), y).backward()
        opt.step()
        opt_ref.step()
    pipe(x)  # refreshes the copies from the owner
    for tie in pipe.ties:
        assert torch.equal(tie.copy(), tie.source()), tie.name
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p, q, k=4096, msg=name)


def test_refresh_is_skipped_while_the_owner_is_unchanged():
    pipe = Pipe(lm(), balance=[1, 4, 2])
    (tie,) = pipe.ties
    x, _ = _batch(pipe.partitions[0])
    pipe(x)  # a step refreshes the copies
    assert tie.refresh() is False
    with torch.no_grad():
        pipe[0].wte.weight.add_(1.0)
    assert tie.refresh() is True and torch.equal(tie.copy(), tie.source())


def test_a_dtype_change_reaches_the_copies():
    model = lm()
    ref = copy.deepcopy(model).double()
    pipe = Pipe(model, balance=[1, 4, 2], chunks=2).double()
    x, _ = _batch(model)
    out = pipe(x)
    assert out.dtype == torch.float64
    assert_close_reordered(out, ref(x), k=16)


class Rotary(nn.Module):
    """Constant buffers only, like a rotary embedding shared by every block."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(nn.Module):
    def __init__(self, rotary: Rotary) -> None:
        super().__init__()
        self.rotary = rotary
        self.linear = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(self.rotary(x)))


def test_a_module_of_constant_buffers_is_replicated():
    rotary = Rotary()
    model = nn.Sequential(*[Block(rotary) for _ in range(4)])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], chunks=2)
    assert [t.name for t in pipe.ties] == ["0.rotary.scale"]
    x = torch.randn(4, 5)
    out = pipe(x)
    assert_close_reordered(out, ref(x), k=16)
    out.sum().backward()
    ref(x).sum().backward()
    for (name, p), (_, q) in zip(pipe.named_parameters(), ref.named_parameters(), strict=True):
        assert_close_reordered(p.grad, q.grad, k=16, msg=name)


def test_a_buffer_written_on_a_reader_stage_is_refused():
    norm = nn.BatchNorm1d(5)
    model = nn.Sequential(norm, nn.Linear(5, 5), norm)
    pipe = Pipe(model, balance=[2, 1])
    with pytest.raises(RuntimeError, match=r"stage 1 wrote into buffer '2\.\w+'.*must stay constant"):
        pipe(torch.randn(4, 5))
    pipe.eval()
    pipe(torch.randn(4, 5))  # in eval() the statistics are only read


def test_fit_refuses_a_tie_across_stages_with_what_to_do():
    pipe = Pipe(lm(), balance=[1, 4, 2], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="cannot keep '0.wte.weight'.*'6.weight'.*train_step"):
        pipe.fit([], _loss(pipe.partitions[0]), opt, consistency="sync")


def test_a_tied_pipe_saves_and_loads_like_the_sequential(tmp_path):
    model = lm()
    pipe = Pipe(model, balance=[1, 4, 2])
    path = tmp_path / "tied.pt"
    fastpipe.save(pipe, path)
    plain = lm()
    fastpipe.load(path, plain)
    for key, value in model.state_dict().items():
        assert torch.equal(plain.state_dict()[key], value), key
    assert plain[-1].weight is plain[0].wte.weight


def test_fit_runs_with_constant_buffers_shared_across_stages():
    rotary = Rotary()
    model = nn.Sequential(*[Block(rotary) for _ in range(4)])
    ref = copy.deepcopy(model)
    pipe = Pipe(model, balance=[2, 2], chunks=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    batches = [(torch.randn(4, 5), torch.randn(4, 5)) for _ in range(3)]
    losses = list(pipe.fit(batches, nn.MSELoss(), opt, consistency="sync"))
    for (x, y), loss in zip(batches, losses, strict=True):
        opt_ref.zero_grad()
        expected = nn.MSELoss()(ref(x), y)
        expected.backward()
        opt_ref.step()
        assert_close_reordered(torch.as_tensor(loss), expected.detach(), k=64)
