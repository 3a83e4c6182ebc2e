"""Bad input gets a clear exception that says what to change."""

import pytest
import torch
from torch import nn

from fastpipe import Pipe


def model(n=4):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


def test_not_a_sequential():
    with pytest.raises(TypeError, match="takes an nn.Sequential"):
        Pipe(nn.Linear(2, 2), balance=[1])
    with pytest.raises(TypeError, match="takes an nn.Sequential"):
        Pipe(nn.ModuleList([nn.Linear(2, 2)]), balance=[1])


def test_empty_sequential():
    with pytest.raises(ValueError, match="empty"):
        Pipe(nn.Sequential(), balance=[1])


@pytest.mark.parametrize(
    "balance, error, match",
    [
        ([1, 2], ValueError, "sums to 3 but the Sequential has 4"),
        ([2, 3], ValueError, "sums to 5"),
        ([4, 0], ValueError, r"balance\[1\] = 0"),
        ([5, -1], ValueError, r"balance\[1\] = -1"),
        ([], ValueError, "empty"),
        ([2.0, 2], TypeError, "not an int"),
        ([True, 3], TypeError, "not an int"),
        ("22", TypeError, "list of layer counts or 'auto'"),
        (4, TypeError, "list of layer counts"),
    ],
)
def test_bad_balance(balance, error, match):
    with pytest.raises(error, match=match):
        Pipe(model(), balance=balance)


def test_too_few_devices():
    with pytest.raises(ValueError, match="1 devices for 2 stages.*at least one device per stage"):
        Pipe(model(), balance=[2, 2], devices=["cpu"])
    with pytest.raises(TypeError, match="one device per stage"):
        Pipe(model(), balance=[2, 2], devices="cpu")


def test_more_devices_than_stages_uses_the_first():
    # torchgpipe's rule: code that passes every visible device keeps working.
    pipe = Pipe(model(), balance=[2, 2], devices=["cpu", torch.device("cpu"), "cuda:7"])
    assert pipe.devices == [torch.device("cpu")] * 2


def test_devices_none_means_cpu_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    pipe = Pipe(model(), balance=[1, 3])
    assert pipe.devices == [torch.device("cpu")] * 2


@pytest.mark.parametrize("chunks", [0, -2, 1.5, 42.0, True, "8"])  # 42.0: torchgpipe accepts it
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        Pipe(model(), balance=[2, 2], chunks=chunks)


def test_unknown_checkpoint_mode():
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        Pipe(model(), balance=[2, 2], checkpoint="sometimes")


def test_shared_parameter_across_stages():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(ValueError, match="parameter '1.weight' .*stage 1.* same object as '0.weight'"):
        Pipe(nn.Sequential(a, b), balance=[1, 1])
    Pipe(nn.Sequential(a, b), balance=[2])  # sharing within one stage is fine


def test_shared_module_across_stages():
    shared = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="same object"):
        Pipe(nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared)), balance=[2, 1])


@pytest.mark.parametrize("bad", [[torch.zeros(2, 4)], "x", None, {"a": 1}])
def test_input_not_tensor_or_tuple(bad):
    with pytest.raises(TypeError, match="must be a Tensor or a tuple"):
        Pipe(model(), balance=[2, 2])(bad)


def test_move_refused_with_hint():
    pipe = Pipe(model(), balance=[2, 2])
    for call in (lambda: pipe.to("cpu"), lambda: pipe.cuda(), lambda: pipe.cpu(),
                 lambda: pipe.to(torch.device("cpu")), lambda: pipe.to(device="cpu", dtype=torch.float64)):
        with pytest.raises(TypeError, match="cannot be moved as a whole"):
            call()


def test_stage_must_return_tensor():
    class Bad(nn.Module):
        def forward(self, x):
            return [x]

    with pytest.raises(TypeError, match="stage 0 returned list"):
        Pipe(nn.Sequential(Bad(), nn.Identity()), balance=[1, 1])(torch.zeros(2, 2))


def test_backward_twice_is_refused():
    pipe = Pipe(model(), balance=[2, 2], chunks=2)
    out = pipe(torch.randn(4, 4))
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out.sum().backward()


def test_local_only_arguments_refused_with_a_process_group():
    sentinel = object()  # never reaches torch.distributed: the arguments are refused first
    with pytest.raises(TypeError, match="devices does not apply"):
        Pipe(model(), balance=[2, 2], devices=["cpu", "cpu"], process_group=sentinel)
    with pytest.raises(TypeError, match="balance='auto' does not apply"):
        Pipe(model(), balance="auto", process_group=sentinel)
