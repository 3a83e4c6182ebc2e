"""The balance tools take what Pipe takes: tuple samples (non-tensor items ride along) and tuple-valued layers."""

from __future__ import annotations

import pytest
import torch
from _fake_clock import FakeClock, Work
from torch import nn

from fastpipe import Pipe
from fastpipe.balance import auto_balance, by_size, by_time, profile_layers


class Embed(nn.Module):
    """A HuggingFace-style embedding: ids in, ``(hidden, positions, tag)`` out."""

    def __init__(self, vocab: int = 50, width: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.seen: list[object] = []

    def forward(self, x: tuple[torch.Tensor, str]) -> tuple[torch.Tensor, torch.Tensor, str]:
        ids, tag = x
        self.seen.append(tag)  # the sample's non-tensor item reaches the layer
        positions = torch.arange(ids.size(1)).expand_as(ids)
        return self.wte(ids), positions, tag


class Block(nn.Module):
    """Takes and returns the tuple; the positions (an int tensor) and the tag pass through."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor, str]) -> tuple[torch.Tensor, torch.Tensor, str]:
        hidden, positions, tag = x
        return torch.relu(self.proj(hidden)) + positions.unsqueeze(-1), positions, tag


class Head(nn.Module):
    def __init__(self, width: int = 8, vocab: int = 50) -> None:
        super().__init__()
        self.out = nn.Linear(width, vocab)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor, str]) -> torch.Tensor:
        return self.out(x[0])


def decoder() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Embed(), Block(), Block(), Block(), Head())


def sample(batch: int = 8) -> tuple[torch.Tensor, str]:
    return torch.randint(0, 50, (batch, 6)), "ride-along"


def test_the_profiler_takes_a_tuple_sample_and_tuple_layers() -> None:
    model = decoder()
    x = sample()
    profile = profile_layers(model, x, repeats=2)
    assert len(profile.forward) == len(profile.backward) == 5
    assert profile.parameter_bytes[0] == 50 * 8 * 4 and profile.parameter_bytes[4] == (8 * 50 + 50) * 4
    assert all(a > 0 for a in profile.activation_bytes[1:])  # each Linear saves its input
    assert set(model[0].seen) == {"ride-along"}
    assert all(p.grad is None for p in model.parameters())


def test_backward_seeds_every_tensor_item_that_requires_grad() -> None:
    clock = FakeClock()

    class Two(nn.Module):
        """Returns two differentiable items (backward 2 s and 3 s) and an int tensor."""

        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = Work(clock, 1.0, 2.0), Work(clock, 0.5, 3.0)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.a(x), self.b(x), torch.zeros(x.size(0), dtype=torch.long)

    class Sum(nn.Module):
        def forward(self, x: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return x[0] + x[1]

    profile = profile_layers(nn.Sequential(Two(), Sum()), torch.randn(4, 4), timer=clock)
    assert profile.forward[0] == pytest.approx(1.5) and profile.backward[0] == pytest.approx(5.0)


def test_by_time_by_size_and_auto_take_tuple_samples() -> None:
    model = decoder()
    x = sample(16)
    for balance in (
        by_time(model, x, 2, repeats=1, microbatches=4, schedule="1f1b"),
        by_size(model, x, 3),
        auto_balance(model, ["cpu"] * 3, x, chunks=4, repeats=1),
    ):
        assert sum(balance) == 5 and min(balance) >= 1


def test_auto_balance_profiles_one_micro_batch_of_a_tuple_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastpipe.balance.auto as auto

    seen = []
    real = auto.profile_layers

    def spy(module, micro, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(micro)
        return real(module, micro, **kwargs)

    monkeypatch.setattr(auto, "profile_layers", spy)
    auto_balance(decoder(), ["cpu"] * 2, sample(10), chunks=4, repeats=1)
    ((ids, tag),) = seen
    assert ids.shape == (3, 6) and tag == "ride-along"  # ceil(10 / 4) rows, as torch.chunk cuts


def test_pipe_with_auto_balance_on_a_tuple_model_equals_the_model() -> None:
    model = decoder()
    ids, tag = x = sample(8)
    # Bitwise against the model on the same micro-batches (the same GEMM shapes).
    expected = torch.cat([model((part, tag)) for part in ids.chunk(2)])
    pipe = Pipe(model, balance="auto", devices=["cpu"] * 2, chunks=2, sample=x, checkpoint="never")
    assert sum(pipe.balance) == 5
    assert torch.equal(pipe(x), expected)


def test_refusals_name_the_value() -> None:
    class Dict(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"hidden": x}

    with pytest.raises(TypeError, match="Dict returned dict; a layer of a Pipe returns a Tensor or a tuple"):
        profile_layers(nn.Sequential(Dict()), torch.randn(2, 4))
    with pytest.raises(TypeError, match="sample must be a Tensor or a tuple of tensors"):
        profile_layers(nn.Sequential(nn.ReLU()), [torch.randn(2, 4)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"disagree on the batch size \(dim 0\): \[2, 3\]"):
        auto_balance(nn.Sequential(nn.ReLU(), nn.ReLU()), ["cpu"] * 2, (torch.randn(2), torch.randn(3)), chunks=1)


def test_profiling_leaves_no_trace_on_statistics_or_random_state():
    import torch
    from torch import nn

    from fastpipe.balance import profile_layers

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.randn(8, 4) * 3 + 1
    rng = torch.get_rng_state()
    profile_layers(model, sample)
    assert torch.equal(torch.get_rng_state(), rng)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
