"""Misuse gets an error that names what to change, not torch's error from deep inside.

One test per case (parametrized where several spellings are one case), grouped by where the
mistake is made: building the Pipe, moving it, calling it, saving and loading it. Exceptions
that a stage itself raises are in ``runtime/test_exceptions.py``.
"""

import copy

import pytest
import torch
from torch import nn

import fastpipe
from fastpipe import Pipe


def model(n=4):
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)])


# -- building the Pipe ----------------------------------------------------------------------


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


def test_process_group_points_to_distributed_pipe():
    sentinel = object()  # never reaches torch.distributed: the argument is refused first
    for kwargs in ({"process_group": sentinel}, {"mesh": sentinel}):
        with pytest.raises(TypeError, match="build fastpipe.DistributedPipe"):
            Pipe(model(), balance=[2, 2], **kwargs)


def test_model_on_the_meta_device():
    with torch.device("meta"):
        meta = model()
    with pytest.raises(ValueError, match=r"parameter '0.weight' is on the meta device.*to_empty\(device="):
        Pipe(meta, balance=[2, 2])


def test_cuda_devices_on_a_host_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(
        ValueError,
        match=r"devices=\['cuda:0', 'cuda:1'\] asks for cuda:0, cuda:1, but "
        r"torch.cuda.is_available\(\) is False and torch.cuda.device_count\(\) "
        r"is 0.*devices=\['cpu'\] \* len\(balance\)",
    ):
        Pipe(model(), balance=[2, 2], devices=["cuda:0", "cuda:1"])


def test_cuda_index_beyond_device_count(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        ValueError,
        match=r"asks for cuda:3, but torch.cuda.is_available\(\) is True and "
        r"torch.cuda.device_count\(\) is 2.*indices 0..1",
    ):
        Pipe(model(), balance=[2, 2], devices=["cuda:0", 3])


@pytest.mark.parametrize(
    "entry, error, match",
    [
        (None, TypeError, r"devices\[1\] = None is not a device"),
        ("gpu0", ValueError, r"devices\[1\] = 'gpu0' is not a device name.*'cuda:0' or 'cpu'"),
    ],
)
def test_device_entry_that_is_not_a_device(entry, error, match):
    with pytest.raises(error, match=match):
        Pipe(model(), balance=[2, 2], devices=["cpu", entry])


def test_unknown_schedule_is_refused_when_building():
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'; valid schedules"):
        Pipe(model(), balance=[2, 2], schedule="pipedream")


@pytest.mark.parametrize(
    "virtual_stages, error, match",
    [
        (0, ValueError, "virtual_stages=0; len.balance. must be a multiple of virtual_stages"),
        (3, ValueError, "virtual_stages=3; len.balance. must be a multiple of virtual_stages"),
        (1.5, TypeError, "virtual_stages must be an int"),
    ],
)
def test_virtual_stages_that_do_not_fit(virtual_stages, error, match):
    with pytest.raises(error, match=match):
        Pipe(model(), balance=[1, 1, 1, 1], schedule="interleaved", virtual_stages=virtual_stages)


def test_virtual_stages_without_the_interleaved_schedule():
    with pytest.raises(ValueError, match="virtual_stages=2 only applies to the 'interleaved', 'zb-v' and 'dualpipev'"):
        Pipe(model(), balance=[1, 1, 1, 1], schedule="1f1b", virtual_stages=2)


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipev"])
def test_v_schedules_need_two_stages_per_worker(schedule):
    with pytest.raises(ValueError, match=f"{schedule}' places 2 stages on each worker in a V.*virtual_stages=2"):
        Pipe(model(), balance=[1, 1, 1, 1], schedule=schedule)
    with pytest.raises(ValueError, match="virtual_stages=3 with 6 stages"):
        Pipe(model(6), balance=[1] * 6, schedule=schedule, virtual_stages=3)
    with pytest.raises(ValueError, match="len\\(balance\\) must be a multiple of virtual_stages"):
        Pipe(model(), balance=[2, 1, 1], schedule=schedule, virtual_stages=2)
    pipe = Pipe(model(), balance=[1, 1, 1, 1], chunks=4, schedule=schedule, virtual_stages=2)
    with pytest.raises(ValueError, match="places 2 stages on each worker"):
        pipe.train_step(torch.zeros(4, 4), torch.zeros(4, 4), torch.nn.MSELoss(), virtual_stages=1)


def test_planning_arguments_without_auto_balance():
    # memory_limit is not one: with any balance it bounds each step (tests/memory/test_limit.py).
    with pytest.raises(TypeError, match="sample only appl.* balance='auto'"):
        Pipe(model(), balance=[2, 2], sample=torch.zeros(2, 4))


# -- moving the Pipe ------------------------------------------------------------------------

MOVES = {
    "device": lambda p: p.to("cpu"),
    "torch.device": lambda p: p.to(torch.device("cpu")),
    "index": lambda p: p.to(0),
    "device kwarg": lambda p: p.to(device="cpu"),
    "device and dtype": lambda p: p.to("cpu", torch.float64),
    "device kwarg and dtype": lambda p: p.to(device="cpu", dtype=torch.float64),
    "non_blocking": lambda p: p.to("cpu", non_blocking=True),
    "other tensor": lambda p: p.to(torch.zeros(1)),
    "tensor kwarg": lambda p: p.to(tensor=torch.zeros(1)),
    "cuda": lambda p: p.cuda(),
    "cpu": lambda p: p.cpu(),
    "to_empty": lambda p: p.to_empty(device="cpu"),
}


@pytest.mark.parametrize("move", list(MOVES.values()), ids=list(MOVES))
def test_every_form_of_moving_the_pipe_is_refused(move):
    pipe = Pipe(model(), balance=[2, 2])
    with pytest.raises(TypeError, match="cannot be moved as a whole.*Move the nn.Sequential before wrapping it"):
        move(pipe)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in pipe.parameters())


@pytest.mark.parametrize(
    "change",
    [lambda p: p.to(torch.float64), lambda p: p.to(dtype=torch.float64), lambda p: p.double()],
    ids=["positional", "keyword", "double"],
)
def test_dtype_only_changes_still_work(change):
    pipe = Pipe(model(), balance=[2, 2], chunks=2)
    assert change(pipe) is pipe
    assert pipe(torch.randn(4, 4, dtype=torch.float64)).dtype == torch.float64


# -- calling it -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[torch.zeros(2, 4)], "x", None, {"a": 1}])
def test_input_not_tensor_or_tuple(bad):
    with pytest.raises(TypeError, match="must be a Tensor or a tuple"):
        Pipe(model(), balance=[2, 2])(bad)


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


def test_input_on_the_meta_device():
    with pytest.raises(ValueError, match="input tensor 0 is on the meta device.*pass a tensor with data"):
        Pipe(model(), balance=[2, 2])(torch.zeros(4, 4, device="meta"))


@pytest.mark.gpu
def test_input_on_another_device_is_copied_to_the_first_stage():
    net = model()
    ref = copy.deepcopy(net)
    pipe = Pipe(net, balance=[2, 2], devices=["cuda:0", "cuda:0"], chunks=2)
    x = torch.randn(4, 4)  # on the CPU
    torch.testing.assert_close(pipe(x).cpu(), ref(x))


def train_step_pipe():
    return Pipe(model(), balance=[2, 2], chunks=2)


TRAIN_STEP_MISUSE = {
    "targets of another batch size": (
        lambda p, x, y: p.train_step(x, y[:7], nn.MSELoss()),
        ValueError,
        "target batch size 7 differs from the input's 8.*one target row per input row",
    ),
    "loss_fn returns a non-scalar": (
        lambda p, x, y: p.train_step(x, y, lambda out, t: (out - t) ** 2),
        TypeError,
        r"loss_fn must return a scalar tensor, got \(4, 4\); use a mean- or sum-reduced loss",
    ),
    "loss_fn returns a float": (
        lambda p, x, y: p.train_step(x, y, lambda out, t: 1.0),
        TypeError,
        "loss_fn must return a scalar tensor, got float",
    ),
    "loss reduction none": (
        lambda p, x, y: p.train_step(x, y, nn.MSELoss(reduction="none")),
        ValueError,
        "reduction='none'; train_step needs 'mean' or 'sum'",
    ),
    "loss_fn not callable": (
        lambda p, x, y: p.train_step(x, y, "mse"),
        TypeError,
        r"loss_fn must be callable as loss_fn\(output, target\), got str",
    ),
    "unknown schedule": (
        lambda p, x, y: p.train_step(x, y, nn.MSELoss(), schedule="pipedream-2bw"),
        ValueError,
        "unknown schedule 'pipedream-2bw'; valid schedules",
    ),
    "virtual stages that do not divide": (
        lambda p, x, y: p.train_step(x, y, nn.MSELoss(), schedule="interleaved", virtual_stages=3),
        ValueError,
        "multiple of virtual_stages",
    ),
    "virtual stages without interleaved": (
        lambda p, x, y: p.train_step(x, y, nn.MSELoss(), schedule="1f1b", virtual_stages=2),
        ValueError,
        "only applies to the 'interleaved', 'zb-v' and 'dualpipev' schedules",
    ),
    "scaler that is not a GradScaler": (
        lambda p, x, y: p.train_step(x, y, nn.MSELoss(), scaler=2.0**16),
        TypeError,
        "scaler must be a torch.amp.GradScaler, got float",
    ),
    "target not a tensor": (
        lambda p, x, y: p.train_step(x, [1, 2], nn.MSELoss()),
        TypeError,
        "target must be a Tensor or a tuple",
    ),
}


@pytest.mark.parametrize("case", list(TRAIN_STEP_MISUSE.values()), ids=list(TRAIN_STEP_MISUSE))
def test_train_step_misuse(case):
    call, error, match = case
    pipe = train_step_pipe()
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(error, match=match):
        call(pipe, x, y)
    pipe.train_step(x, y, nn.MSELoss())  # still usable after the refusal


INPUT_MISUSE = {
    "tensors of different batch sizes": (
        (torch.zeros(4, 4), torch.zeros(3, 4)),
        ValueError,
        r"disagree on the batch size \(dim 0\): \[3, 4\]",
    ),
    "empty batch": (torch.zeros(0, 4), ValueError, r"batch is empty \(dim 0 has size 0\)"),
    "0-d tensor": (torch.tensor(1.0), ValueError, "0-d tensor .* give it a leading batch dimension"),
    "tuple without a tensor": ((1, 2), TypeError, "holds no tensor; at least one item must be a Tensor"),
}


@pytest.mark.parametrize("case", list(INPUT_MISUSE.values()), ids=list(INPUT_MISUSE))
def test_input_that_cannot_be_split(case):
    value, error, match = case
    with pytest.raises(error, match=match):
        Pipe(nn.Sequential(nn.Identity()), balance=[1], chunks=2)(value)


# -- saving and loading ---------------------------------------------------------------------


def test_load_with_swapped_arguments(tmp_path):
    pipe = Pipe(model(), balance=[2, 2])
    fastpipe.save(pipe, str(tmp_path / "ckpt.pt"))
    with pytest.raises(
        TypeError,
        match=r"fastpipe.load: the arguments are swapped: it is "
        r"fastpipe.load\(path, into, optimizer=None\)",
    ):
        fastpipe.load(pipe, str(tmp_path / "ckpt.pt"))


def test_save_with_swapped_arguments(tmp_path):
    pipe = Pipe(model(), balance=[2, 2])
    with pytest.raises(
        TypeError,
        match=r"fastpipe.save: the arguments are swapped: it is "
        r"fastpipe.save\(pipe, path, optimizer=None\)",
    ):
        fastpipe.save(tmp_path / "ckpt.pt", pipe)
    assert not list(tmp_path.iterdir())  # nothing half-written


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda pipe, path: fastpipe.save(pipe, 42), "path must be a file path .* got int"),
        (lambda pipe, path: fastpipe.save(pipe.state_dict(), path), "pipe must be the Pipe .* got OrderedDict"),
        (lambda pipe, path: fastpipe.save(pipe, path, pipe), "optimizer must be a torch.optim.Optimizer .* got Pipe"),
        (lambda pipe, path: fastpipe.load(path, pipe.state_dict()), "into must be the Pipe .* got OrderedDict"),
    ],
    ids=["save path", "save module", "save optimizer", "load into"],
)
def test_checkpoint_argument_of_the_wrong_kind(tmp_path, call, match):
    with pytest.raises(TypeError, match=match):
        call(Pipe(model(), balance=[2, 2]), str(tmp_path / "ckpt.pt"))
